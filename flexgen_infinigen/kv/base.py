"""The KV cache policy interface: what the engine asks of a cache, whatever it keeps or moves.

One :class:`KVCache` holds the keys and values of one layer for one GPU batch.
The engine drives it through a decode step in three calls, which the
overlapped schedule may run on different streams:

* ``load(length)``: bring to the compute device what decode attention will read
  (issued one schedule step ahead, overlapped with other compute);
* ``attend(loaded, q, k_new, v_new, valid, bias)``: attention of the new token;
* ``store_token(k_new, v_new, position)``: keep the new token's key and value.

``store_prompt`` keeps the prompt's keys and values after prefill.
Shapes: q ``[b, s, H, d]``; k, v ``[b, s, KV, d]``; ``valid`` ``[b, length + s]``
(True for the keys the new token may see: real tokens, not left padding, and inside the
sliding window if the model has one); ``bias`` is the matching additive mask
``[b, 1, s, length + s]``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..tiers import Tiers


@dataclass(frozen=True)
class CacheSpec:
    """Everything a policy needs to build the cache of one (layer, GPU batch)."""

    tiers: Tiers
    layer: int
    batch: int  # index of the GPU batch within the block
    batch_size: int
    max_len: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    fractions: tuple[float, float, float]
    compress: bool
    cpu_compute: bool
    window: int = 0  # sliding window (Mistral): a token sees only the newest this many keys

    def first_visible(self, length: int) -> int:
        """The oldest cached row the token after ``length`` cached ones may attend to."""
        return max(0, length + 1 - self.window) if self.window else 0


class KVCache(ABC):
    @abstractmethod
    def store_prompt(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     valid: torch.Tensor) -> None: ...

    @abstractmethod
    def load(self, length: int): ...

    @abstractmethod
    def attend(self, loaded, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               valid: torch.Tensor, bias: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def store_token(self, k_new: torch.Tensor, v_new: torch.Tensor, position: int) -> None: ...

    def bytes_by_tier(self) -> dict[str, int]:
        return {}

    # True when load and store move nothing (the schedule then runs them inline)
    resident: bool = False


class KVPolicy(ABC):
    """Makes caches and reports what they moved; one instance per engine."""

    name = "base"

    @abstractmethod
    def make_cache(self, spec: CacheSpec) -> KVCache: ...

    def reset_stats(self) -> None:
        """Called at the start of every ``generate``: counters in the report restart."""

    def prepare(self, lm) -> None:
        """Called once after the weights are placed (InfiniGen skews them here)."""

    def before_attention(self, layer: int, batch: int, x: torch.Tensor, state) -> None:
        """Decode only: layer ``layer``'s normalized attention input ``x`` for GPU batch
        ``batch`` (``state`` has ``pos_enc``, ``valid``), before its attention runs."""

    def device_bytes(self, cfg, policy, item: int, max_len: int) -> dict[str, int]:
        """Compute-device bytes this policy allocates besides the KV cache, by term, for an
        engine run with ``policy`` (a :class:`~..policy.Policy`) and ``max_len`` tokens."""
        return {}

    def abort(self) -> None:
        """The block failed: wake anything that waits on work the engine will not do."""

    def report(self) -> dict:
        return {"kv_policy": self.name}
