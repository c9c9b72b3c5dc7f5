"""Gemma 3 (text) math: Llama's grouped-query attention and RoPE, with

- the token embedding scaled by sqrt(hidden);
- RMSNorms before and after both the attention and the MLP (four a layer), and per-head
  q/k RMSNorms. Gemma's norms multiply by (1 + w); the store holds 1 + w in float32 (the
  converter adds the 1, as GGUF files already do), so every norm here is a plain RMSNorm;
- a GeGLU MLP (the tanh approximation of GELU);
- the query scaled by ``query_pre_attn_scalar ** -0.5`` (``cfg.query_scale``) rather than
  by 1/sqrt(head width);
- windowed layers (``cfg.layer_windows``, five to one global layer) with their own RoPE base
  (``cfg.rope_local_theta``, never scaled); the global layers take ``rope_theta`` and the
  config's RoPE scaling;
- logits soft-capped where the config asks (``cfg.final_logit_softcap``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels.layers import linear
from ..memory.codes import lookup
from .llama import (attention_factor, inverse_frequencies, recurrent_mix,  # noqa: F401
                    recurrent_state_shapes, rms_norm, rotary, rotary_tables, same_layers)


def _layer_shapes(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    h, f, kv, qd, d = (cfg.hidden_size, cfg.intermediate_size, cfg.kv_dim, cfg.q_dim,
                       cfg.head_dim)
    attn = {"attn_norm.weight": (h,), "q_proj.weight": (qd, h), "k_proj.weight": (kv, h),
            "v_proj.weight": (kv, h), "o_proj.weight": (h, qd), "q_norm.weight": (d,),
            "k_norm.weight": (d,), "post_attn_norm.weight": (h,)}
    if cfg.qkv_bias:
        attn.update({"q_proj.bias": (qd,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
    if cfg.o_bias:
        attn["o_proj.bias"] = (h,)
    mlp = {"mlp_norm.weight": (h,), "gate_proj.weight": (f, h), "up_proj.weight": (f, h),
           "down_proj.weight": (h, f), "post_mlp_norm.weight": (h,)}
    return {"attn": attn, "mlp": mlp}


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return same_layers(cfg, _layer_shapes(cfg))[0]


def stage_weights(cfg: ModelConfig, layer: int = 0) -> dict[str, list[str]]:
    return same_layers(cfg, _layer_shapes(cfg))[1]


QUERY_WEIGHTS = ("q_proj.weight", "q_proj.bias", "q_norm.weight")
# RoPE sits between the projections and the dot product (as in Llama): InfiniGen's skew is
# applied to the rotated q and k
SKEW_FOLDS_INTO_WEIGHTS = False
# the compiled decode call computes Llama's layer, not this one (post-norms, GeGLU)
FUSED_DECODE = False


def encode_positions(cfg: ModelConfig, positions: torch.Tensor, window: int = 0):
    """Rotary tables (as Llama's) at ``positions``: a windowed layer's from its own base,
    unscaled; a global layer's from ``rope_theta`` with the config's scaling."""
    if window and cfg.rope_local_theta:
        d = cfg.head_dim
        exponent = torch.arange(0, d, 2, device=positions.device, dtype=torch.int64).float() / d
        return rotary_tables(1.0 / cfg.rope_local_theta ** exponent, positions)
    return rotary_tables(inverse_frequencies(cfg, positions.device), positions,
                         attention_factor(cfg))


def embed(cfg: ModelConfig, w: dict, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = lookup(w["embed.weight"], ids)
    # the scale rounded to the activations' type first, as the reference multiplies it
    return x * torch.tensor(math.sqrt(cfg.hidden_size), dtype=x.dtype)


def attn_input(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    return rms_norm(h, w["attn_norm.weight"], cfg.norm_eps)


def _project(cfg: ModelConfig, w: dict, x: torch.Tensor, part: str, heads: int):
    b, s, _ = x.shape
    y = linear(x, w[f"{part}_proj.weight"], w.get(f"{part}_proj.bias"))
    return y.view(b, s, heads, cfg.head_dim)


def query(cfg: ModelConfig, w: dict, x: torch.Tensor, pos_enc) -> torch.Tensor:
    """q [b, s, H, d]: projected, normed per head, rotated, and scaled so that the
    attention's 1/sqrt(d) leaves ``cfg.query_scale``."""
    q = rms_norm(_project(cfg, w, x, "q", cfg.num_heads), w["q_norm.weight"], cfg.norm_eps)
    q = rotary(q, pos_enc)
    if cfg.query_scale:
        q = q * (cfg.query_scale * math.sqrt(cfg.head_dim))
    return q


def attn_qkv(cfg: ModelConfig, w: dict, x: torch.Tensor, pos_enc):
    k = rms_norm(_project(cfg, w, x, "k", cfg.num_kv_heads), w["k_norm.weight"], cfg.norm_eps)
    v = _project(cfg, w, x, "v", cfg.num_kv_heads)
    return query(cfg, w, x, pos_enc), rotary(k, pos_enc), v


def attn_out(cfg: ModelConfig, w: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    out = linear(attn, w["o_proj.weight"], w.get("o_proj.bias"))
    return h + rms_norm(out, w["post_attn_norm.weight"], cfg.norm_eps)


def mlp(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    x = rms_norm(h, w["mlp_norm.weight"], cfg.norm_eps)
    gated = F.gelu(linear(x, w["gate_proj.weight"]), approximate="tanh") * \
        linear(x, w["up_proj.weight"])
    return h + rms_norm(linear(gated, w["down_proj.weight"]), w["post_mlp_norm.weight"],
                        cfg.norm_eps)


def head(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    x = rms_norm(h, w["final_norm.weight"], cfg.norm_eps)
    table = w["embed.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    logits = linear(x, table)
    if cfg.final_logit_softcap:
        cap = cfg.final_logit_softcap
        logits = torch.tanh(logits / cap) * cap
    return logits


def attention_sinks(cfg: ModelConfig, w: dict) -> None:
    """No attention sinks."""
    return None
