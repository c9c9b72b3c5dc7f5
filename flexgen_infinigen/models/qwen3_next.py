"""Qwen3.5 and Qwen3-Next math: hybrids whose layers mix tokens in one of two ways.

- Most layers (``cfg.linear_layers``) are a **Gated DeltaNet**: no KV cache, but a state per
  row that a recurrence updates token by token: a causal depthwise convolution over the
  last ``linear_conv`` inputs of q, k and v (its state: the previous ``linear_conv - 1``
  inputs), then for each value head a matrix ``S`` [dk, dv] that decays by ``exp(g_t)`` and
  takes the delta rule's correction ``S += k_t (beta_t (v_t - S^T k_t))^T``; the token's
  output is ``S^T q_t``, normalised per head and gated by ``silu(z)``. The engine holds the
  two states like a KV cache (:mod:`flexgen_infinigen.kv.recurrent`) and hands them in and
  out (:func:`recurrent_mix`); this module only computes.
- The rest are grouped-query attention as Qwen3's (per-head q/k RMSNorm, RoPE on the first
  ``rotary_dim`` dims of each head) whose output is multiplied by ``sigmoid`` of a gate
  projection (``q_gate.weight``, split from the checkpoint's doubled ``q_proj`` at
  conversion) before ``o_proj``. These keep a KV cache as every attention layer does, and
  only these are InfiniGen's.

Every RMSNorm of the model multiplies by ``1 + w`` except the DeltaNet's output norm; the
store holds ``1 + w`` (as for Gemma 3), so the norms here are plain. The MLP is Llama's
SwiGLU (Qwen3.5) or a mixture of experts with a gated shared expert (Qwen3-Next, Qwen3.5-MoE:
:mod:`.moe`).

A prompt runs the recurrence in chunks of :data:`CHUNK` tokens: within a chunk the delta
rule's corrections solve one unit lower-triangular system, and the state crosses chunk
boundaries only; the state it leaves equals the token-by-token recurrence's
(:func:`delta_rule_steps`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels.layers import linear
from . import llama
from .llama import (attention_sinks, attn_input, attn_qkv, embed, encode_positions,  # noqa: F401
                    head, mlp, query, rms_norm)

CHUNK = 64
# the DeltaNet's weights, under ``layers.{i}.`` (its in-projections as transformers'
# Qwen3.5 names them; Qwen3-Next's fused ones are split into these at conversion)
LINEAR = "linear."


def _linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, hv, k = cfg.hidden_size, cfg.linear_value_heads, cfg.linear_conv
    kd = cfg.linear_key_heads * cfg.linear_key_dim
    vd = hv * cfg.linear_value_dim
    return {"attn_norm.weight": (h,), f"{LINEAR}qkv_proj.weight": (2 * kd + vd, h),
            f"{LINEAR}z_proj.weight": (vd, h), f"{LINEAR}b_proj.weight": (hv, h),
            f"{LINEAR}a_proj.weight": (hv, h), f"{LINEAR}conv.weight": (2 * kd + vd, k),
            f"{LINEAR}dt_bias": (hv,), f"{LINEAR}A": (hv,),
            f"{LINEAR}norm.weight": (cfg.linear_value_dim,),
            f"{LINEAR}out_proj.weight": (h, vd)}


def _layer_shapes(cfg: ModelConfig, layer: int) -> dict[str, dict[str, tuple[int, ...]]]:
    parts = llama._layer_shapes(cfg, layer)
    if cfg.is_linear(layer):
        return {"attn": _linear_shapes(cfg), "mlp": parts["mlp"]}
    attn = dict(parts["attn"])
    if cfg.attn_output_gate:
        attn["q_gate.weight"] = (cfg.q_dim, cfg.hidden_size)
    return {"attn": attn, "mlp": parts["mlp"]}


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return llama.model_shapes(cfg, lambda i: {n: s for part in _layer_shapes(cfg, i).values()
                                              for n, s in part.items()})


def stage_weights(cfg: ModelConfig, layer: int = 0) -> dict[str, list[str]]:
    parts = _layer_shapes(cfg, layer)
    return {"embed": ["embed.weight"], "attn": list(parts["attn"]), "mlp": list(parts["mlp"]),
            "head": llama.head_weights(cfg)}


QUERY_WEIGHTS = llama.QUERY_WEIGHTS
SKEW_FOLDS_INTO_WEIGHTS = False
# the compiled decode call computes Llama's layer: no output gate, no recurrence
FUSED_DECODE = False


def attn_out(cfg: ModelConfig, w: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """``o_proj(attn * sigmoid(gate))``: the gate is a projection of the attention's input,
    made again here from ``h`` (a norm and one product) so that the family interface carries
    no extra tensor between the two halves of attention."""
    gate = w.get("q_gate.weight")
    if gate is not None:
        attn = attn * torch.sigmoid(linear(attn_input(cfg, w, h), gate))
    return h + linear(attn, w["o_proj.weight"], w.get("o_proj.bias"))


# ---- the Gated DeltaNet --------------------------------------------------------------------
def recurrent_state_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One row's recurrent state of a DeltaNet layer, by name (float32): the convolution's
    previous inputs and each value head's matrix."""
    kd = cfg.linear_key_heads * cfg.linear_key_dim
    channels = 2 * kd + cfg.linear_value_heads * cfg.linear_value_dim
    return {"conv": (channels, cfg.linear_conv - 1),
            "matrix": (cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim)}


def recurrent_mix(cfg: ModelConfig, w: dict, h: torch.Tensor, state: dict[str, torch.Tensor],
                  valid: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A DeltaNet layer's token mixing of ``h`` [b, s, D] (``valid`` [b, s]: False for left
    padding, whose input is zeroed so that it leaves the state as it was) from ``state``
    (:func:`recurrent_state_shapes`, a batch dim first); the hidden state after it (the
    residual included) and the state after the last token."""
    b, s, _ = h.shape
    x = attn_input(cfg, w, h) * valid[..., None].to(h.dtype)
    mixed = linear(x, w[f"{LINEAR}qkv_proj.weight"])
    conv_in = torch.cat([state["conv"].to(mixed.dtype), mixed.transpose(1, 2)], -1)
    kernel = w[f"{LINEAR}conv.weight"].to(mixed.dtype)
    if s == 1:  # a decode step: each channel's last inputs times its taps
        conv = F.silu((conv_in * kernel).sum(-1, keepdim=True))
    else:
        conv = F.silu(F.conv1d(conv_in, kernel[:, None, :], groups=kernel.shape[0]))
    hk, hv = cfg.linear_key_heads, cfg.linear_value_heads
    dk, dv = cfg.linear_key_dim, cfg.linear_value_dim
    q, k, v = conv.transpose(1, 2).float().split([hk * dk, hk * dk, hv * dv], -1)
    q, k = (_each_value_head(cfg, _l2norm(t.reshape(b, s, hk, dk))) for t in (q, k))
    q = q * dk ** -0.5
    v = v.reshape(b, s, hv, dv)
    beta = torch.sigmoid(linear(x, w[f"{LINEAR}b_proj.weight"]).float())
    a = linear(x, w[f"{LINEAR}a_proj.weight"]).float()
    g = w[f"{LINEAR}A"].float() * F.softplus(a + w[f"{LINEAR}dt_bias"].float())
    rule = delta_rule_step if s == 1 else delta_rule_chunked
    out, matrix = rule(q, k, v, g, beta, state["matrix"].float())
    z = linear(x, w[f"{LINEAR}z_proj.weight"]).float().reshape(b, s, hv, dv)
    out = rms_norm(out, w[f"{LINEAR}norm.weight"].float(), cfg.norm_eps) * F.silu(z)
    out = linear(out.reshape(b, s, hv * dv).to(h.dtype), w[f"{LINEAR}out_proj.weight"])
    kept = conv_in[..., conv_in.shape[-1] - (cfg.linear_conv - 1):].float()
    return h + out, {"conv": kept, "matrix": matrix}


def _each_value_head(cfg: ModelConfig, t: torch.Tensor) -> torch.Tensor:
    """Key-head tensor ``t`` [b, s, key heads, dk] repeated for each value head (in the
    order the value heads' weights are stored: grouped by key head, or tiled)."""
    per = cfg.linear_value_heads // cfg.linear_key_heads
    return t.repeat(1, 1, per, 1) if cfg.linear_value_tiled else t.repeat_interleave(per, 2)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_steps(q, k, v, g, beta, matrix):
    """The gated delta rule token by token: q, k [b, s, H, dk], v [b, s, H, dv], g and beta
    [b, s, H], ``matrix`` [b, H, dk, dv] before the first token; (out [b, s, H, dv], the
    matrix after the last)."""
    outs = []
    for t in range(q.shape[1]):
        matrix = matrix * g[:, t].exp()[..., None, None]
        kt = k[:, t]
        seen = torch.einsum("bhkv,bhk->bhv", matrix, kt)
        delta = (v[:, t] - seen) * beta[:, t][..., None]
        matrix = matrix + kt[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", matrix, q[:, t]))
    return torch.stack(outs, 1), matrix


def delta_rule_step(q, k, v, g, beta, matrix):
    """One token of :func:`delta_rule_steps` (its arguments, ``s`` = 1) in fewer passes over
    the matrices, which a decode step's time is: with the decay ``e = exp(g)``, ``S^T k``
    and ``S^T q`` come from the entering matrix in one product (the correction's
    ``e S^T k``, and the output ``e S^T q + (k . q) d``), and the matrix is decayed and
    corrected in one more."""
    b, _, heads, dk = k.shape
    kt, qt, e = k[:, 0], q[:, 0], g[:, 0].exp()
    both = torch.stack([kt, qt], -2) @ matrix  # [b, H, 2, dv]: S^T k, S^T q
    delta = (v[:, 0] - e[..., None] * both[..., 0, :]) * beta[:, 0][..., None]
    out = e[..., None] * both[..., 1, :] + (kt * qt).sum(-1, keepdim=True) * delta
    dv = delta.shape[-1]
    matrix = (matrix * e[..., None, None]).reshape(b * heads, dk, dv)  # a new tensor
    matrix.baddbmm_(kt.reshape(b * heads, dk, 1), delta.reshape(-1, 1, dv))
    return out[:, None], matrix.reshape(b, heads, dk, dv)


def delta_rule_chunked(q, k, v, g, beta, matrix, chunk: int = CHUNK):
    """:func:`delta_rule_steps` over chunks of ``chunk`` tokens.

    With ``G_t`` the chunk's running sum of ``g`` and ``S0`` the matrix entering it, the
    corrections ``d_t = beta_t (v_t - S_{t-1}^T k_t)`` satisfy the unit lower-triangular
    system ``d_t + beta_t sum_{j<t} e^(G_t - G_j) (k_t . k_j) d_j = beta_t (v_t - e^G_t S0^T
    k_t)``; then ``out_t = e^G_t S0^T q_t + sum_{j<=t} e^(G_t - G_j) (q_t . k_j) d_j`` and the
    matrix leaving the chunk is ``e^G_C S0 + sum_j e^(G_C - G_j) k_j d_j^T``. Padding the last
    chunk with g = 0 and beta = 0 tokens leaves the matrix as the real tokens left it."""
    b, s, heads, dk = k.shape
    pad = -s % chunk
    q, k, v, g, beta = (F.pad(t.transpose(1, 2), (0, 0, 0, pad) if t.dim() == 4 else (0, pad))
                        for t in (q, k, v, g, beta))
    n = (s + pad) // chunk
    q, k, v = (t.reshape(b, heads, n, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = (t.reshape(b, heads, n, chunk) for t in (g, beta))
    cum = g.cumsum(-1)  # G_t within each chunk
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    gap = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()
    scaled_k = k * beta[..., None]
    system = (scaled_k @ k.transpose(-1, -2) * gap).tril(-1)
    system = system + torch.eye(chunk, dtype=q.dtype, device=q.device)
    from_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                           unitriangular=True)
    from_s0 = torch.linalg.solve_triangular(system, scaled_k * cum.exp()[..., None],
                                            upper=False, unitriangular=True)
    within = q @ k.transpose(-1, -2) * gap  # j <= t (gap is 0 above the diagonal)
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    out = torch.empty_like(v)
    for c in range(n):
        d = from_v[:, :, c] - from_s0[:, :, c] @ matrix
        out[:, :, c] = q_decayed[:, :, c] @ matrix + within[:, :, c] @ d
        matrix = matrix * cum[:, :, c, -1].exp()[..., None, None] + \
            k_to_end[:, :, c].transpose(-1, -2) @ d
    out = out.reshape(b, heads, n * chunk, -1)[:, :, :s].transpose(1, 2)
    return out, matrix
