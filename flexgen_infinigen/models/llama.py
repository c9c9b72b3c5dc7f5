"""Llama-family math: RoPE, RMSNorm, SwiGLU MLP, grouped-query attention.

The variants are flags of :class:`~flexgen_infinigen.config.ModelConfig`, not separate code:
Llama 3.x RoPE scaling (``rope_scaling``), Mistral's sliding window (applied by the mask,
see :func:`flexgen_infinigen.kernels.attention.mask_bias`), Qwen2's q/k/v biases (``qkv_bias``),
Qwen3's per-head q/k RMSNorm (``qk_norm``; OLMoE's spans all heads, ``qk_norm_full``), a
head width that is not hidden/heads (``attn_head_dim``), GLM's RoPE on part of each head
(``rotary_dim``) and mixture-of-experts MLPs (``num_experts``: the math is in :mod:`.moe`,
GLM-4.5's sigmoid group router and ungated shared expert included; a config's
``dense_layers`` keep a dense MLP).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from . import moe
from ..memory.codes import lookup
from ..kernels import layers as cpu_layers
from ..kernels.layers import linear


def _layer_shapes(cfg: ModelConfig, layer: int = 0) -> dict[str, dict[str, tuple[int, ...]]]:
    """Layer ``layer``'s weights by stage kind, with the names a ``layers.{i}.`` prefix
    completes (a MoE layer's MLP differs from a dense one's)."""
    h, f, kv, qd, d = (cfg.hidden_size, cfg.intermediate_size, cfg.kv_dim, cfg.q_dim,
                       cfg.head_dim)
    attn = {"attn_norm.weight": (h,), "q_proj.weight": (qd, h), "k_proj.weight": (kv, h),
            "v_proj.weight": (kv, h), "o_proj.weight": (h, qd)}
    if cfg.qkv_bias:
        attn.update({"q_proj.bias": (qd,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
    if cfg.o_bias:
        attn["o_proj.bias"] = (h,)
    if cfg.qk_norm:
        attn.update({"q_norm.weight": (qd,), "k_norm.weight": (kv,)} if cfg.qk_norm_full else
                    {"q_norm.weight": (d,), "k_norm.weight": (d,)})
    if moe.is_moe_layer(cfg, layer):
        return {"attn": attn, "mlp": moe.mlp_shapes(cfg)}
    mlp = {"mlp_norm.weight": (h,), "gate_proj.weight": (f, h), "up_proj.weight": (f, h),
           "down_proj.weight": (h, f)}
    return {"attn": attn, "mlp": mlp}


def model_shapes(cfg: ModelConfig, layer_shapes) -> dict[str, tuple[int, ...]]:
    """Every weight of a model with a token embedding, a final RMSNorm and a head (tied or
    not), and the weights ``layer_shapes(i)`` gives of each layer (the Llama-like families
    share this)."""
    h = cfg.hidden_size
    shapes = {"embed.weight": (cfg.vocab_size, h), "final_norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        shapes.update({f"layers.{i}.{n}": s for n, s in layer_shapes(i).items()})
    return shapes


def same_layers(cfg: ModelConfig, parts: dict[str, dict[str, tuple[int, ...]]]):
    """(every weight's shape, the stages' weight names) of a model whose layers all have the
    weights ``parts`` gives by stage kind (``attn``, ``mlp``): what :func:`weight_shapes` and
    :func:`stage_weights` return for such a family (Gemma 3, gpt-oss)."""
    per_layer = {n: s for part in parts.values() for n, s in part.items()}
    stages = {"embed": ["embed.weight"], "attn": list(parts["attn"]), "mlp": list(parts["mlp"]),
              "head": head_weights(cfg)}
    return model_shapes(cfg, lambda i: per_layer), stages


def head_weights(cfg: ModelConfig) -> list[str]:
    """The head stage's weights: the final norm and the head (the embedding when tied)."""
    return ["final_norm.weight", "embed.weight" if cfg.tie_word_embeddings else "lm_head.weight"]


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return model_shapes(cfg, lambda i: {n: s for part in _layer_shapes(cfg, i).values()
                                        for n, s in part.items()})


def stage_weights(cfg: ModelConfig, layer: int = 0) -> dict[str, list[str]]:
    """Weight names used by each schedule stage; layer stages (of layer ``layer``) use a
    ``layers.{i}.`` prefix."""
    layer = _layer_shapes(cfg, layer)
    return {"embed": ["embed.weight"], "attn": list(layer["attn"]), "mlp": list(layer["mlp"]),
            "head": head_weights(cfg)}


# the weights the query alone needs (InfiniGen's rehearsal keeps these on the device)
QUERY_WEIGHTS = ("q_proj.weight", "q_proj.bias", "q_norm.weight")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    fused = cpu_layers.rms_norm(x, weight, eps)  # float32 on a CPU: one kernel call
    if fused is not None:
        return fused
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def inverse_frequencies(cfg: ModelConfig, device=None) -> torch.Tensor:
    """The rotary frequencies [d/2], with the config's RoPE scaling applied.

    ``linear`` divides every frequency by ``factor``; ``llama3`` (Llama 3.1+) divides the
    low frequencies (wavelengths past ``original / low_freq_factor``) by ``factor``, keeps
    the high ones (past ``original / high_freq_factor`` the other way) and blends between.
    """
    d = cfg.rope_dim
    exponent = torch.arange(0, d, 2, device=device, dtype=torch.int64).float() / d
    inv = 1.0 / cfg.rope_theta ** exponent
    rope = cfg.rope
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        return inv / rope["factor"]
    if kind == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        original = rope["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv
        scaled = torch.where(wavelength > original / low, inv / factor, inv)
        blend = (original / wavelength - low) / (high - low)
        smooth = (1 - blend) * scaled / factor + blend * scaled
        medium = (wavelength >= original / high) & (wavelength <= original / low)
        return torch.where(medium, smooth, scaled)
    if kind == "yarn":
        return _yarn(inv, rope, d, cfg.rope_theta)
    if kind != "default":  # the converter refuses these; a hand-made config must too
        raise ValueError(f"RoPE scaling {kind!r} is not implemented")
    return inv


def _yarn(inv: torch.Tensor, rope: dict, d: int, base: float) -> torch.Tensor:
    """YaRN (NTK-by-parts): the high frequencies kept, the low ones divided by ``factor``,
    and a linear ramp between the dims that turn ``beta_fast`` and ``beta_slow`` times over
    the original context."""
    factor = rope["factor"]
    original = rope["original_max_position_embeddings"]

    def dim_of(turns: float) -> float:
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(rope.get("beta_fast") or 32), dim_of(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=inv.device) - low)
            / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv / factor * (1 - keep) + inv * keep


def attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies the rotary tables by (1 for every other RoPE)."""
    rope = cfg.rope
    if rope.get("rope_type") != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    factor, mscale, every = rope["factor"], rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and every:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, every)
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``factor`` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def encode_positions(cfg: ModelConfig, positions: torch.Tensor, window: int = 0):
    """cos [b, s, 1, d] of the rotary angles at ``positions`` [b, s], and their sin with the
    first half negated (what :func:`rotary` multiplies the halves, swapped, with). Every
    layer has the same RoPE, windowed or not."""
    return rotary_tables(inverse_frequencies(cfg, positions.device), positions,
                         attention_factor(cfg))


def rotary_tables(inv: torch.Tensor, positions: torch.Tensor, scale: float = 1.0):
    """:func:`encode_positions` for the frequencies ``inv`` [d/2], both tables times
    ``scale`` (YaRN's attention factor)."""
    angles = positions.float()[..., None] * inv  # [b, s, d/2]
    sin = angles.sin()
    cos = torch.cat([angles, angles], -1)[:, :, None, :].cos()
    signed = torch.cat([-sin, sin], -1)[:, :, None, :]
    return (cos, signed) if scale == 1.0 else (cos * scale, signed * scale)


def rotary(x: torch.Tensor, rope) -> torch.Tensor:
    """Rotate ``x`` [b, s, heads, d] (half-split layout, as Hugging Face Llama):
    x cos + (-x2, x1) sin, the swapped halves from one roll and the sign in the sin. Tables
    narrower than a head (partial rotary, GLM) rotate its first dims and pass the rest."""
    cos, signed_sin = rope
    if cos.shape[-1] < x.shape[-1]:
        rd = cos.shape[-1]
        return torch.cat([rotary(x[..., :rd].contiguous(), rope), x[..., rd:]], -1)
    fused = cpu_layers.rotary(x, cos, signed_sin)  # float32 on a CPU: one kernel call
    if fused is not None:
        return fused
    swapped = torch.roll(x, x.shape[-1] // 2, -1)  # (x2, x1)
    return (x.float() * cos + swapped.float() * signed_sin).to(x.dtype)


def embed(cfg: ModelConfig, w: dict, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return lookup(w["embed.weight"], ids)


def attn_input(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    """The normalized attention input (what InfiniGen's rehearsal multiplies)."""
    return rms_norm(h, w["attn_norm.weight"], cfg.norm_eps)


# RoPE sits between the projections and the dot product, so an orthogonal skew of q and k
# cannot be folded into the weights; it is applied to the rotated q and k instead.
SKEW_FOLDS_INTO_WEIGHTS = False
# the compiled decode call (kernels/c/decode_layer.c) computes this family's layer: RMSNorm,
# RoPE, grouped-query attention, SwiGLU
FUSED_DECODE = True


def _project(cfg: ModelConfig, w: dict, x: torch.Tensor, part: str, heads: int):
    """x through ``{part}_proj`` (with its bias, if any) as [b, s, heads, d], then the
    per-head norm where the config has one (q and k of Qwen3), before RoPE."""
    b, s, _ = x.shape
    y = linear(x, w[f"{part}_proj.weight"], w.get(f"{part}_proj.bias"))
    norm = w.get(f"{part}_norm.weight")
    if norm is not None and cfg.qk_norm_full:  # over every head at once (OLMoE)
        y = rms_norm(y, norm, cfg.norm_eps)
    y = y.view(b, s, heads, cfg.head_dim)
    if norm is not None and not cfg.qk_norm_full:
        y = rms_norm(y, norm, cfg.norm_eps)
    return y


def query(cfg: ModelConfig, w: dict, x: torch.Tensor, pos_enc) -> torch.Tensor:
    """q [b, s, H, d] with RoPE applied (``pos_enc``: :func:`encode_positions`' cos, sin)."""
    return rotary(_project(cfg, w, x, "q", cfg.num_heads), pos_enc)


def attn_qkv(cfg: ModelConfig, w: dict, x: torch.Tensor, pos_enc):
    """q [b, s, H, d], k and v [b, s, KV, d] from the normalized input ``x``; RoPE applied.

    A key bias is added before RoPE, so the cached keys (and InfiniGen's speculation keys,
    made from them) hold it exactly; the rehearsal's query goes through the same
    :func:`query`, so nothing is folded or approximated."""
    k = _project(cfg, w, x, "k", cfg.num_kv_heads)
    v = _project(cfg, w, x, "v", cfg.num_kv_heads)
    return query(cfg, w, x, pos_enc), rotary(k, pos_enc), v


def attn_out(cfg: ModelConfig, w: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    return h + linear(attn, w["o_proj.weight"], w.get("o_proj.bias"))


def mlp(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    x = rms_norm(h, w["mlp_norm.weight"], cfg.norm_eps)
    if moe.ROUTER in w:
        return h + moe.mlp(cfg, w, x)
    gated = F.silu(linear(x, w["gate_proj.weight"])) * linear(x, w["up_proj.weight"])
    return h + linear(gated, w["down_proj.weight"])


def head(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    x = rms_norm(h, w["final_norm.weight"], cfg.norm_eps)
    table = w["embed.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    return linear(x, table)


def attention_sinks(cfg: ModelConfig, w: dict) -> None:
    """No attention sinks."""
    return None


def recurrent_state_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """No layer keeps a recurrent state."""
    return {}


def recurrent_mix(cfg: ModelConfig, w: dict, h: torch.Tensor, state: dict[str, torch.Tensor],
                  valid: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    raise ValueError(f"{cfg.name} has no recurrent layers")
