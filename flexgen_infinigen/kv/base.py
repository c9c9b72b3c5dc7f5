"""The KV cache policy interface: what the engine asks of a cache, whatever it keeps or moves.

A :class:`KVPolicy` is one object that knows everything about itself: its command-line
flags (:meth:`~KVPolicy.add_args` / :meth:`~KVPolicy.from_args`), what it reads and adds to a
decode step for the cost model (:meth:`~KVPolicy.fetch_fraction`,
:meth:`~KVPolicy.decode_work`, :meth:`~KVPolicy.device_bytes`), its report, and how to make
its caches. The registry in :mod:`flexgen_infinigen.kv` lists the policies by name.

One :class:`KVCache` holds the keys and values of one layer for one GPU batch. It sees
tensors only, never the engine. A decode step drives it in three calls, which the
overlapped schedule may run on different lanes:

* ``load(length)``: bring to the compute device what decode attention will read
  (issued one schedule step ahead, overlapped with other compute);
* ``attend(loaded, q, k_new, v_new, valid, bias)``: attention of the new token;
* ``store_token(k_new, v_new, position)``: keep the new token's key and value.

``store_prompt(q, k, v, valid)`` keeps the prompt's keys and values after prefill, and
``speculate(x, pos_enc, valid, visible)`` (InfiniGen) receives the previous layer's attention input
during decode, before this cache's ``load`` is waited for.
Shapes: q ``[b, s, H, d]``; k, v ``[b, s, KV, d]``; ``valid`` ``[b, length + s]``
(True for the keys the new token may see: real tokens, not left padding, and inside the
sliding window if the model has one); ``bias`` is the matching additive mask
``[b, 1, s, length + s]``.
"""
from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..config import ConfigError
from ..runtime.tiers import Tiers


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


@dataclass(frozen=True)
class DecodeWork:
    """What a policy adds to one decode step of one GPU batch, in bytes and parameters (the
    cost model turns them into seconds with the hardware profile's rates)."""

    gathers_rows: bool = False  # chosen rows are gathered on the host before the link
    layers: int = 0  # how many layers do the work below
    matmul_params: float = 0.0  # per layer: parameters of extra products with the batch
    scan_bytes: float = 0.0  # per layer: bytes streamed like attention (scoring keys)
    overhead: str | None = None  # per layer: the profile's measured fixed cost of this name


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

    def speculate(self, x: torch.Tensor, pos_enc, valid: torch.Tensor,
                  visible: torch.Tensor) -> None:
        """Decode only: the previous layer's normalized attention input ``x`` ``[b, 1, D]``
        with the positions' encoding, the batch's ``valid`` ``[b, length + 1]`` and the keys
        the new token may see (``visible``); called on the compute stream before this cache's
        ``load`` is waited for. Most caches ignore it."""

    def prompt_reader(self, length: int, batch_size: int):
        """A function that reads the prompt's keys and values back as stored, ``[b, P, KV, d]``
        each, or None when the cache does not hold them exactly (a kept prefill then copies
        them: :mod:`..prefill_cache`)."""
        return None

    def abort(self) -> None:
        """The block failed: wake a ``load`` that waits for work the engine will not do."""

    def bytes_by_tier(self) -> dict[str, int]:
        return {}

    # True when load and store move nothing: the schedule then runs them inline, on the
    # compute thread, instead of on a lane
    inline: bool = False


class KVPolicy(ABC):
    """Makes caches and reports what they moved; one instance per engine."""

    name = "base"
    summary = ""  # one line for ``--kv-policy``'s help
    plannable = True  # the optimizer and cost model can plan for it
    attends_on_cpu = True  # it can attend where the cache lives (``--cpu-cache-compute``)
    speculates = False  # its caches use ``speculate`` (a pipeline then sends its input on)
    # its caches' ``store_prompt`` reads the prompt's queries (it cannot start from a kept
    # prefill, which holds keys and values only: :mod:`..prefill_cache`)
    needs_prompt_queries = False

    # ---- command line -----------------------------------------------------------------------
    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add this policy's own flags (each policy's flags, in its own group)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "KVPolicy":
        """The policy the parsed flags describe, its values checked (before any loading)."""
        return cls()

    @classmethod
    def planned(cls, fraction: float) -> "KVPolicy":
        """The policy at its defaults reading ``fraction`` of the context per selecting layer
        (what the optimizer plans with)."""
        return cls()

    def check_placement(self, cpu_cache_compute: bool) -> None:
        """Refuse a placement this policy cannot run (a :class:`ConfigError` naming the fix)."""
        if cpu_cache_compute and not self.attends_on_cpu:
            raise ConfigError(f"--kv-policy {self.name} moves selected KV rows to the compute "
                              "device; it cannot be combined with --cpu-cache-compute (drop one)")

    # ---- what it costs ----------------------------------------------------------------------
    @property
    def kv_fraction(self) -> float:
        """Fraction of the context read in each layer that selects (1.0: everything)."""
        return 1.0

    def fetch_fraction(self, cfg, context: float | None = None) -> float:
        """Average fraction of each layer's cached rows read per decode step (at ``context``
        cached tokens where given: a policy may read more of a short context)."""
        return 1.0

    # the fixed time a decode step's layer spends on this policy beyond bytes and flops, for
    # the cost model: its name in a hardware profile (``DecodeWork.overhead``), its value in
    # the built-in profiles, and how ``profile`` measures it (see ``overhead_probe``)
    overhead_name: str | None = None
    default_overhead_s: float = 0.0

    @classmethod
    def overhead_probe(cls) -> "KVPolicy":
        """The policy a tiny model runs with when ``profile`` measures ``overhead_name``
        (against the full cache, with the cache in CPU memory)."""
        return cls()

    def overhead_layers(self, cfg) -> int:
        """How many layers of ``cfg`` pay ``overhead_name`` at a decode step."""
        return cfg.num_layers

    def decode_work(self, cfg, batch: int, context: float, item: int) -> DecodeWork:
        """What one decode step of a GPU batch of ``batch`` at ``context`` cached tokens adds
        besides reading its share of the cache (see :class:`DecodeWork`)."""
        return DecodeWork()

    def device_bytes(self, cfg, policy, item: int, max_len: int,
                     weights_in_place: bool = False, on_cpu: bool = False) -> dict[str, int]:
        """Compute-device bytes this policy allocates besides the KV cache, by term, for an
        engine run with ``policy`` (a :class:`~..policy.Policy`) and ``max_len`` tokens;
        ``weights_in_place``: 4-bit weights are multiplied where they are stored (a CPU);
        ``on_cpu``: the compute device is a CPU."""
        return {}

    # ---- running ----------------------------------------------------------------------------
    @abstractmethod
    def make_cache(self, spec: CacheSpec) -> KVCache: ...

    def prepare(self, lm) -> None:
        """Called once after the weights are placed (InfiniGen takes its skew here)."""

    def reset_stats(self) -> None:
        """Called at the start of every ``generate``: counters in the report restart."""

    def report(self) -> dict:
        return {"kv_policy": self.name}
