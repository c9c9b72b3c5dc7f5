"""A decode step's mixture-of-experts MLP stage on a CPU as one compiled call
(``kernels/c/moe_layer.c``, over ``kernels/c/moe_experts.c``).

The per-operation path (``models/llama.py``'s ``mlp`` over ``models/moe.py``) makes a norm
call, the router's call, a softmax, a top-k and a renormalisation in torch, groups the
tokens by expert in Python lists, gathers the chosen experts' pointers and calls the experts
kernel, then adds the residual: a fixed cost a layer that a step at batch 1, whose experts
are read in well under a millisecond, notices. A :class:`MoePlan` holds tables of every
routed expert's pointers, made once per stage, and the call does the rest: norm, router,
softmax, top-k, grouping, experts, residual.

A stage gets a plan when every routed expert is 4-bit codes with float16 factors read where
they are (a GGUF's Q4_0, Q4_1, Q4_K ... in CPU memory: the experts kernel's form), the router
and the norm are float32 in CPU memory, and the model has no shared expert (Qwen3-MoE,
Mixtral and OLMoE; Qwen2-MoE keeps the per-operation path). The call's softmax and
renormalising sum are its own loops: the router's weights may differ from torch's in the
last bit, which changes an expert's choice only where two logits tie to that bit
(``tests/test_fused_moe.py`` measures both). ``FLEXGEN_INFINIGEN_FUSED=0`` turns it off with
the other fused calls.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..models import moe
from ..memory.codes import PackedWeight
from ..kernels.cpu_kernels import invoke, library
from ..kernels.layers import expert_tables
from ..switches import FUSED

MAX_TOKENS = 16  # tokens one call takes (MOE_MAX_ROWS in kernels/c/moe_experts.c)
MAX_TOP_K = 64  # experts a token may take (MOE_MAX_TOP_K in kernels/c/moe_layer.c)


class MoePlan:
    """One MoE stage's call: the tables of its experts' codes, scales and minima (expert e's
    gate, up and down at 3e, 3e + 1, 3e + 2) and the router's and norm's tensors, all read
    in place; :meth:`__call__` runs a decode step's tokens through it."""

    def __init__(self, cfg: ModelConfig, router: torch.Tensor, norm: torch.Tensor,
                 experts: list[PackedWeight], tables: tuple):
        self.cfg, self.router, self.norm = cfg, router, norm
        self.experts = experts  # the tables point into them: kept alive with the plan
        self.group, self.f, self.tables = tables
        self.h = cfg.hidden_size

    def __call__(self, h: torch.Tensor) -> torch.Tensor | None:
        """``h + MoE(RMSNorm(h))`` for ``h [b, s, hidden]`` (float32, b * s tokens, at most
        :data:`MAX_TOKENS`), or None where the call does not take it."""
        tokens = h.numel() // self.h
        if (h.is_cuda or h.dtype != torch.float32 or h.shape[-1] != self.h
                or not 0 < tokens <= MAX_TOKENS or not h.is_contiguous()):
            return None
        cfg = self.cfg
        out = torch.empty_like(h)
        codes, scales, minima = self.tables
        done = invoke(
            "moe_layer_q4_h16", h=h.data_ptr(), T=tokens, norm_w=self.norm.data_ptr(),
            eps=cfg.norm_eps, router=self.router.data_ptr(), E=cfg.num_experts,
            K=cfg.experts_per_token, renorm=int(bool(cfg.norm_topk_prob)), codes=codes,
            scales=scales, minima=minima, out=out.data_ptr(), H=self.h, F=self.f,
            group=self.group, nthreads=torch.get_num_threads())
        return out if done else None


def moe_plan(cfg: ModelConfig, w: dict) -> MoePlan | None:
    """Stage weights ``w``'s plan, or None where the call does not apply (see the module)."""
    if (not FUSED.get() or not cfg.num_experts or cfg.shared_expert_size or cfg.router_sigmoid
            or cfg.router_bias or not moe.plain_experts(cfg)
            or not 0 < cfg.experts_per_token <= min(cfg.num_experts, MAX_TOP_K)):
        return None
    router, norm = w.get(moe.ROUTER), w.get("mlp_norm.weight")
    hidden = cfg.hidden_size
    for t, shape in ((router, (cfg.num_experts, hidden)), (norm, (hidden,))):
        if (not isinstance(t, torch.Tensor) or t.is_cuda or t.dtype != torch.float32
                or tuple(t.shape) != shape or not t.is_contiguous()):
            return None
    experts = [w.get(f"experts.{e}.{m}.weight") for e in range(cfg.num_experts)
               for m in moe.EXPERT_MATRICES]
    tables = expert_tables(experts, hidden)
    if tables is None or library() is None:
        return None
    return MoePlan(cfg, router, norm, experts, tables)
