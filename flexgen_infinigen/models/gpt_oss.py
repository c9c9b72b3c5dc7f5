"""gpt-oss math: Llama's grouped-query attention (biases on q, k, v and the output, YaRN
RoPE, 128-token windows on every other layer: ``cfg.layer_windows``) with

- attention sinks: a learned logit per query head (``layers.{i}.sinks``) that joins every
  softmax's normalizer and carries no value, so a head may attend to nothing. The family
  hands them to the attention (:func:`attention_sinks`); the attention kernels add
  exp(sink) to the sum of exp(scores);
- a mixture-of-experts MLP in every layer (:mod:`.moe`): a router with a bias whose
  softmax over the top-k logits equals the renormalised top-k of the full softmax, and
  experts with biases and the clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``
  (``cfg.swiglu_limit``, ``cfg.swiglu_alpha``).
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from . import llama, moe
from .llama import (attn_input, attn_out, attn_qkv, embed, encode_positions, head,  # noqa: F401
                    query, recurrent_mix, recurrent_state_shapes, rms_norm, same_layers)

SINKS = "sinks"


def _layer_shapes(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    h, kv, qd = cfg.hidden_size, cfg.kv_dim, cfg.q_dim
    attn = {"attn_norm.weight": (h,), "q_proj.weight": (qd, h), "k_proj.weight": (kv, h),
            "v_proj.weight": (kv, h), "o_proj.weight": (h, qd), "q_proj.bias": (qd,),
            "k_proj.bias": (kv,), "v_proj.bias": (kv,), "o_proj.bias": (h,),
            SINKS: (cfg.num_heads,)}
    return {"attn": attn, "mlp": moe.mlp_shapes(cfg)}


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return same_layers(cfg, _layer_shapes(cfg))[0]


def stage_weights(cfg: ModelConfig, layer: int = 0) -> dict[str, list[str]]:
    return same_layers(cfg, _layer_shapes(cfg))[1]


QUERY_WEIGHTS = llama.QUERY_WEIGHTS
SKEW_FOLDS_INTO_WEIGHTS = False
# the compiled decode call computes Llama's layer: no sinks, no biased experts
FUSED_DECODE = False


def attention_sinks(cfg: ModelConfig, w: dict) -> torch.Tensor:
    """The sink logit of each query head [H] (float32)."""
    return w[SINKS].float()


def mlp(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    return h + moe.mlp(cfg, w, rms_norm(h, w["mlp_norm.weight"], cfg.norm_eps))
