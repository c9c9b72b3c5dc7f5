"""Which path a decode stage takes, decided once per stage and batch: a :class:`StagePlan`.

The engine asks :class:`StagePlans` for every stage of a decode step; what it gets is made
from what is loaded at the stage's first decode step of a block (the weights' forms, the
caches), never per step:

- **per operation**: the family's torch math (and the KV cache's ``load``/``attend``);
- **fused layer**: a Llama-family stage on a CPU as one compiled call of
  ``kernels/c/decode_layer.c`` (:class:`~..kernels.layer_call.LayerCall`): the layer's
  weights are float32 rows, or 4-bit/8-bit codes with float32 or float16 scales, in CPU
  memory. Attention runs between the call's two halves, through the cache's ``attend``;
- **fused attention**: the same call with the KV cache's own part inside it (the cache
  offers it: ``KVCache.fused_attention``; the full cache's attention over its rows read in
  place, or a selecting cache's chosen rows and the next layer's speculation). A step the cache's
  part does not take runs as a fused layer;
- **fused MoE**: a decode step's mixture-of-experts MLP stage, the tokens of the whole
  block in one call (:mod:`.fused_moe`);
- **experts on the host**: a decode step's MoE stage whose routed experts the CPU
  multiplies where they are held (``--cpu-expert-compute``), per operation otherwise.

A stage takes no compiled call on another family (``Family.FUSED_DECODE``), a GPU, a dtype
other than float32, weights off the CPU or in a form the kernels do not read, more than
:data:`MAX_BATCH` rows, without a compiler, or with ``FLEXGEN_INFINIGEN_FUSED=0``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from ..config import ModelConfig
from ..kernels.cpu_kernels import library
from ..kernels.layer_call import LayerCall
from ..kv.base import FusedAttention, KVCache
from ..models import family_of
from ..switches import FUSED
from .fused_moe import MoePlan, moe_plan

ENV = FUSED.name
MAX_BATCH = 16  # rows a decode step's linear kernels are written for (kernels/layers.py)


class StagePath(Enum):
    PER_OPERATION = "per operation"
    FUSED_LAYER = "fused layer"
    FUSED_ATTENTION = "fused attention"
    FUSED_MOE = "fused MoE"
    EXPERTS_ON_HOST = "experts on the host"


@dataclass(frozen=True)
class StagePlan:
    """How one stage runs a decode step for one batch (a MoE stage: for the block)."""

    path: StagePath
    call: LayerCall | None = None  # FUSED_LAYER, FUSED_ATTENTION
    attention: FusedAttention | None = None  # FUSED_ATTENTION: the cache's part of the call
    moe: MoePlan | None = None  # FUSED_MOE


PER_OPERATION = StagePlan(StagePath.PER_OPERATION)


def enabled() -> bool:
    return FUSED.get()


def supports(cfg: ModelConfig, dtype: torch.dtype, is_cuda: bool) -> bool:
    """Whether a model of this config may take the compiled layer call at all (decided at
    load): a family whose math the call computes, float32 on a CPU, shapes it is written
    for."""
    return (enabled() and not is_cuda and dtype == torch.float32
            and family_of(cfg).FUSED_DECODE and not cfg.rotary_dim
            and cfg.q_dim == cfg.num_heads * cfg.head_dim and cfg.head_dim % 8 == 0
            and cfg.head_dim <= 256 and cfg.num_heads % cfg.num_kv_heads == 0
            and cfg.num_heads // cfg.num_kv_heads <= 16)


class StagePlans:
    """The engine's plans: a layer stage's per (stage, batch) for the block being run (its
    caches and batch sizes are the block's), a MoE stage's per stage for the engine's life
    (its tables of expert pointers are made once)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, is_cuda: bool):
        self.cfg, self.is_cuda = cfg, is_cuda
        lib = library() if supports(cfg, dtype, is_cuda) else None
        # the compiled layer call, or None: every layer stage then runs per operation
        self.fused = lib if lib is not None and hasattr(lib, "decode_layer") else None
        self.layers: dict[tuple[int, int], StagePlan] = {}
        self.moe: dict[int, StagePlan] = {}

    def reset(self) -> None:
        """A new block: caches and batch sizes are new, layer plans are remade."""
        self.layers.clear()

    def layer(self, stage: int, batch: int, kind: str, w: dict, rows: int, resident: bool,
              cache: KVCache | None, next_cache: KVCache | None,
              hands_off: bool) -> StagePlan:
        """Stage ``stage``'s plan for GPU batch ``batch`` of ``rows`` rows (kind "attn",
        "mlp" or "layer"; ``resident``: every weight read in place each step, so the call's
        pointers hold; ``hands_off``: the next layer is on the next pipeline rank, which
        needs this layer's attention input)."""
        key = (stage, batch)
        plan = self.layers.get(key)
        if plan is None:
            plan = self.layers[key] = self._layer(kind, w, rows, resident, cache, next_cache,
                                                  hands_off)
        return plan

    def _layer(self, kind, w, rows, resident, cache, next_cache, hands_off) -> StagePlan:
        # a MoE model's attention stages only: its MLPs (routed experts, or dense among
        # them) run per operation, a decode step's experts in their own call (moe_plan)
        moe_mlp = bool(self.cfg.num_experts) and kind != "attn"
        if self.fused is None or not resident or not 0 < rows <= MAX_BATCH or moe_mlp:
            return PER_OPERATION
        call = LayerCall(self.fused, self.cfg, kind, w, rows)
        if not call.ok:
            return PER_OPERATION
        if kind != "mlp" and not hands_off and cache is not None:
            attention = cache.fused_attention(call, next_cache)
            if attention is not None:
                return StagePlan(StagePath.FUSED_ATTENTION, call, attention)
        return StagePlan(StagePath.FUSED_LAYER, call)

    def moe_stage(self, stage: int, w: dict, dense_resident: Callable[[], bool], on_host: bool,
                  counting: bool) -> StagePlan:
        """A MoE MLP stage's plan for a decode step (``w``: its weights as loaded for it;
        ``dense_resident()``: the router and norm read in place, asked once; ``counting``: a
        routing profile counts the reads, so each runs per operation)."""
        if counting:
            return StagePlan(StagePath.EXPERTS_ON_HOST) if on_host else PER_OPERATION
        plan = self.moe.get(stage)
        if plan is None:
            made = moe_plan(self.cfg, w) if not self.is_cuda and dense_resident() else None
            plan = StagePlan(StagePath.FUSED_MOE, moe=made) if made is not None else (
                StagePlan(StagePath.EXPERTS_ON_HOST) if on_host else PER_OPERATION)
            self.moe[stage] = plan
        return plan
