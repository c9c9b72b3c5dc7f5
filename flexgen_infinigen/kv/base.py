"""The KV cache policy interface: what the engine asks of a cache, whatever it keeps or moves.

A :class:`KVPolicy` is one object that knows everything about itself: its command-line
flags (:meth:`~KVPolicy.add_args` / :meth:`~KVPolicy.from_args`), what it reads and adds to a
decode step for the cost model (:meth:`~KVPolicy.fetch_fraction`,
:meth:`~KVPolicy.decode_work`, :meth:`~KVPolicy.device_bytes`), its report, and how to make
its caches. The registry in :mod:`flexgen_infinigen.kv` lists the policies by name.

One :class:`KVCache` holds the keys and values of one layer for one GPU batch. It sees
tensors only, never the engine. A decode step drives it in three calls, which the
overlapped schedule may run on different lanes:

* ``load(length) -> Loaded``: bring to the compute device what decode attention will read
  (issued one schedule step ahead, overlapped with other compute); the :class:`Loaded` says
  how the rows were read (:class:`Read`) and holds the tensors;
* ``attend(loaded, q, k_new, v_new, valid, bias)``: attention of the new token;
* ``store_token(k_new, v_new, position)``: keep the new token's key and value.

A cache may also offer its part of a fused decode layer (``fused_attention``): attention
inside the layer's one compiled call (:mod:`..kernels.layer_call`). The engine asks every
cache the same question and never asks which class it holds.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from ..config import ConfigError, ModelConfig
from ..memory.split_tensor import SplitTensor
from ..memory.tiers import Tiers
from ..placement import Placement

if TYPE_CHECKING:
    from ..kernels.layer_call import LayerCall, StepState


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
    # the value rows are the key rows (MLA's latent): one copy is kept, read and moved, and
    # ``v`` is ``k`` (the model hands the same tensor as both)
    values_are_keys: bool = False

    def first_visible(self, length: int) -> int:
        """The oldest cached row the token after ``length`` cached ones may attend to."""
        return max(0, length + 1 - self.window) if self.window else 0


@dataclass(frozen=True)
class DecodeWork:
    """What a policy adds to one decode step of one GPU batch, in bytes and parameters (the
    cost model turns them into seconds with the hardware profile's rates)."""

    gathers_rows: bool = False  # chosen rows are gathered on the host before the link
    # ... or, where the device reads pinned host memory by index itself, read in place
    maps_rows: bool = False
    layers: int = 0  # how many layers do the work below
    matmul_params: float = 0.0  # per layer: parameters of extra products with the batch
    scan_bytes: float = 0.0  # per layer: bytes streamed like attention (scoring keys)
    overhead: str | None = None  # per layer: the profile's measured fixed cost of this name


class Read(Enum):
    """How a decode step's ``load`` read the rows attention will use (the status of a
    :class:`Loaded`, as llama.cpp's memory context carries one)."""

    LATER = "later"  # nothing ahead: attention reads every visible row itself
    ROWS = "rows"  # every visible row brought: k, v
    CHOSEN = "chosen"  # the chosen rows brought: k, v, counts, order
    CHOSEN_IN_PLACE = "chosen in place"  # the chosen rows, read where they are: counts, order
    CHOSEN_PACKED = "chosen packed"  # the chosen rows, as 4-bit codes where they are
    CHOOSE_WHEN_ATTENDING = "choose when attending"  # the layer chooses with its own query


@dataclass(frozen=True)
class Loaded:
    """What ``load`` gave ``attend``: how the rows were read, then the tensors that way has.

    ``k``, ``v``: rows ``[t + 1, b * KV, d]`` (the last row is left for the new token);
    ``counts`` ``[b, KV]``: rows each KV head uses; ``order`` ``[b, KV, n]``: their
    positions, ranked."""

    read: Read
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    order: torch.Tensor | None = None

    @classmethod
    def later(cls) -> "Loaded":
        return _LATER

    @classmethod
    def rows(cls, kv: tuple[torch.Tensor, torch.Tensor]) -> "Loaded":
        return cls(Read.ROWS, kv[0], kv[1])

    @classmethod
    def chosen(cls, k, v, counts, order) -> "Loaded":
        return cls(Read.CHOSEN, k, v, counts, order)

    @classmethod
    def chosen_in_place(cls, counts, order) -> "Loaded":
        return cls(Read.CHOSEN_IN_PLACE, counts=counts, order=order)

    @classmethod
    def chosen_packed(cls, counts, order) -> "Loaded":
        return cls(Read.CHOSEN_PACKED, counts=counts, order=order)

    @classmethod
    def choose_when_attending(cls) -> "Loaded":
        return _CHOOSE


_LATER = Loaded(Read.LATER)
_CHOOSE = Loaded(Read.CHOOSE_WHEN_ATTENDING)


class FusedAttention(Protocol):
    """A cache's part of a fused decode layer (see ``KVCache.fused_attention``)."""

    def layer(self, h: torch.Tensor, state: "StepState",
              loaded: Loaded) -> "tuple[torch.Tensor, torch.Tensor | None] | None":
        """The whole layer in the call: ``(output, x)``, ``x`` the attention input when the
        engine must still speculate for the next layer from it (else None); None when this
        step's ``loaded`` is not one the call takes (the engine then runs the two calls
        around ``attend``)."""


class KVCache(ABC):
    @abstractmethod
    def store_prompt(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     valid: torch.Tensor) -> None: ...

    @abstractmethod
    def load(self, length: int) -> Loaded: ...

    @abstractmethod
    def attend(self, loaded: Loaded, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               valid: torch.Tensor, bias: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The new token's attention [b, 1, H*d]; ``sinks`` [H]: each query head's sink logit
        in the normalizer (only a policy with ``computes_sinks`` is given them)."""

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
        them: :mod:`flexgen_infinigen.engine.prefill_cache`)."""
        return None

    # :meth:`take_row` can give a row of the running block another sequence's columns
    takes_rows: bool = False

    def take_row(self, row: int, start: int, other: "KVCache", length: int) -> None:
        """Between two decode steps: row ``row`` holds, from column ``start``, the first
        ``length`` columns of ``other``, a one-row cache of the same policy and layer that
        a prompt's prefill alone filled, exactly as it holds them (everything the policy
        keeps per token and per row), so that the row's next steps read what that prompt's
        own block would read (:mod:`flexgen_infinigen.engine.join`). Only where
        ``takes_rows``."""
        raise NotImplementedError(f"{type(self).__name__} cannot take a row's columns")

    def restart_row(self, row: int) -> None:
        """Between two steps: row ``row`` starts a new sequence. A KV cache needs nothing
        (the row's old columns are masked out by its ``valid``); a state that is not kept
        per column (a recurrent layer's) starts over."""

    def abort(self) -> None:
        """The block failed: wake a ``load`` that waits for work the engine will not do."""

    def fused_attention(self, call: "LayerCall",
                        next_cache: "KVCache | None") -> FusedAttention | None:
        """This cache's attention inside a decode layer's one compiled call ``call`` (made
        once per stage and batch), given the next layer's cache in this process (None: the
        last layer); None: the engine runs the call's two halves around :meth:`attend`."""
        return None

    # its ``speculate`` does something: the layer before must hand it its attention input
    # (a fused layer before it then cannot keep that input to itself)
    speculates: bool = False

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
    computes_sinks = False  # its attention takes attention sinks (gpt-oss), see ``attend``
    speculates = False  # its caches use ``speculate`` (a pipeline then sends its input on)
    # its caches' ``store_prompt`` reads the prompt's queries (it cannot start from a kept
    # prefill, which holds keys and values only: :mod:`flexgen_infinigen.engine.prefill_cache`)
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

    @classmethod
    def check_model(cls, cfg: ModelConfig) -> None:
        """Refuse a model whose attention this policy does not compute (a
        :class:`ConfigError` naming the fix), before its weights are read."""
        if cfg.attn_sinks and not cls.computes_sinks:
            raise ConfigError(f"--kv-policy {cls.name} does not compute attention sinks, which "
                              f"{cfg.name} ({cfg.architecture}) has; use --kv-policy full or "
                              "infinigen")

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
        engine run with ``policy`` (a :class:`~..placement.Placement`) and ``max_len`` tokens;
        ``weights_in_place``: 4-bit weights are multiplied where they are stored (a CPU);
        ``on_cpu``: the compute device is a CPU."""
        return {}

    # ---- running ----------------------------------------------------------------------------
    @abstractmethod
    def make_cache(self, spec: CacheSpec) -> KVCache: ...

    def prepare(self, ctx: "PolicyContext") -> None:
        """Called once after the weights are placed (InfiniGen takes its skew here)."""

    def reset_stats(self) -> None:
        """Called at the start of every ``generate``: counters in the report restart."""

    def report(self) -> dict:
        return {"kv_policy": self.name}


# called with (layer, q, k, valid) of each layer's prompt pass instead of storing it
PromptRecorder = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may take from the loaded model when it prepares, handed down by the API
    (never the model or the engine itself): InfiniGen reads its skew from the store or
    calibrates it with ``run_prompt``, and keeps the rehearsal's weights."""

    cfg: ModelConfig
    placement: Placement
    tiers: Tiers
    dtype: torch.dtype
    family: object  # the model family's math (:class:`..models.Family`)
    weights: Mapping[str, SplitTensor]  # as placed, by store name
    layers: range  # the layers this process runs (a pipeline rank: its own)
    store_path: Path | None  # the weight store, where a policy may keep what it computed
    tokenizer: object | None
    # runs the prompt pass of ids ``[1, P]`` (valid ``[1, P]``), handing each layer's q, k
    # and valid to the recorder instead of keeping a cache
    run_prompt: Callable[[torch.Tensor, torch.Tensor, PromptRecorder], None]
    # ``flag`` on any process of the run (a pipeline's ranks agree); one process: ``flag``
    any_rank: Callable[[bool, str], bool]
