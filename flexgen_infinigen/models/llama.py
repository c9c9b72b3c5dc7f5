"""Llama-family math: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.kv_dim
    shapes = {"embed.weight": (cfg.vocab_size, h), "final_norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attn_norm.weight": (h,), p + "q_proj.weight": (h, h),
            p + "k_proj.weight": (kv, h), p + "v_proj.weight": (kv, h),
            p + "o_proj.weight": (h, h),
            p + "mlp_norm.weight": (h,), p + "gate_proj.weight": (f, h),
            p + "up_proj.weight": (f, h), p + "down_proj.weight": (h, f),
        })
    return shapes


def stage_weights(cfg: ModelConfig) -> dict[str, list[str]]:
    """Weight names used by each schedule stage; layer stages use a ``layers.{i}.`` prefix."""
    head = ["final_norm.weight", "embed.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    return {
        "embed": ["embed.weight"],
        "attn": ["attn_norm.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight",
                 "o_proj.weight"],
        "mlp": ["mlp_norm.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight"],
        "head": head,
    }


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def encode_positions(cfg: ModelConfig, positions: torch.Tensor):
    """cos and sin [b, s, 1, d] of the rotary angles at ``positions`` [b, s]."""
    d = cfg.head_dim
    exponent = torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d
    angles = positions.float()[..., None] * (1.0 / cfg.rope_theta ** exponent)  # [b, s, d/2]
    angles = torch.cat([angles, angles], -1)[:, :, None, :]
    return angles.cos(), angles.sin()


def rotary(x: torch.Tensor, rope) -> torch.Tensor:
    """Rotate ``x`` [b, s, heads, d] (half-split layout, as Hugging Face Llama)."""
    cos, sin = rope
    d = x.shape[-1]
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def embed(cfg: ModelConfig, w: dict, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, w["embed.weight"])


def attn_input(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    """The normalized attention input (what InfiniGen's rehearsal multiplies)."""
    return rms_norm(h, w["attn_norm.weight"], cfg.norm_eps)


# RoPE sits between the projections and the dot product, so an orthogonal skew of q and k
# cannot be folded into the weights; it is applied to the rotated q and k instead.
SKEW_FOLDS_INTO_WEIGHTS = False


def query(cfg: ModelConfig, w: dict, x: torch.Tensor, rope) -> torch.Tensor:
    """q [b, s, H, d] with RoPE applied."""
    b, s, _ = x.shape
    return rotary(F.linear(x, w["q_proj.weight"]).view(b, s, cfg.num_heads, cfg.head_dim), rope)


def attn_qkv(cfg: ModelConfig, w: dict, x: torch.Tensor, rope):
    """q [b, s, H, d], k and v [b, s, KV, d] from the normalized input ``x``; RoPE applied."""
    b, s, _ = x.shape
    k = F.linear(x, w["k_proj.weight"]).view(b, s, cfg.num_kv_heads, cfg.head_dim)
    v = F.linear(x, w["v_proj.weight"]).view(b, s, cfg.num_kv_heads, cfg.head_dim)
    return query(cfg, w, x, rope), rotary(k, rope), v


def attn_out(cfg: ModelConfig, w: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    return h + F.linear(attn, w["o_proj.weight"])


def mlp(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    x = rms_norm(h, w["mlp_norm.weight"], cfg.norm_eps)
    gated = F.silu(F.linear(x, w["gate_proj.weight"])) * F.linear(x, w["up_proj.weight"])
    return h + F.linear(gated, w["down_proj.weight"])


def head(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    x = rms_norm(h, w["final_norm.weight"], cfg.norm_eps)
    table = w["embed.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    return F.linear(x, table)
