"""DeepSeek-V3 / R1 (and V2) multi-head latent attention (MLA), in its absorbed form.

A token's keys and values are made from one latent: ``c = RMSNorm(W_DKV x)`` (``kv_rank``
dims) and one rotary key ``k_pe`` (``rope_dim`` dims) shared by every head; a head's key is
``[W_UK_h c, k_pe]`` and its value ``W_UV_h c``. The KV cache holds ``[c, k_pe]`` (one KV
head of ``kv_rank + rope_dim`` dims, ``cfg.head_dim``), never the per-head keys and values.
Attention is scored against the latent: ``q_h . k_h = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe``,
so a head's query is ``[W_UK_h^T q_nope_h, q_pe_h]`` over the cached rows (multi-query
attention with every head in one group), and its output ``W_UV_h`` times the weighted sum
of the latents. Every KV policy, InfiniGen included, sees that one-head cache: InfiniGen
speculates with the absorbed query against the cached latent rows (its skew is computed
from them like any head's), and the rows it selects are latent rows.

The value is the cached row itself: the model hands the same row as K and V, and the cache
(``cfg.values_are_keys``) keeps, reads and moves it once, so a token's cache bytes in a
layer are the latent row's. The MoE MLP (sigmoid group
router, shared experts, dense first layers) is :mod:`.moe`'s, through :mod:`.llama`'s MLP.
DeepSeek's RoPE pairs dims interleaved; the rotary parts are de-interleaved (the same order
for query and key, which leaves their dot product unchanged) and rotated as Llama's.
"""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig
from ..kernels.layers import linear
from ..memory.codes import dense
from . import llama, moe
from .llama import recurrent_mix, recurrent_state_shapes  # noqa: F401


def _attn_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, heads = cfg.hidden_size, cfg.num_heads
    qk = cfg.mla_nope_dim + cfg.rope_dim
    shapes = {"attn_norm.weight": (h,),
              "kv_a_proj.weight": (cfg.mla_kv_rank + cfg.rope_dim, h),
              "kv_a_norm.weight": (cfg.mla_kv_rank,),
              "o_proj.weight": (h, heads * cfg.mla_v_dim)}
    if cfg.mla_kv_b_split:
        shapes.update({"k_b_proj.weight": (heads * cfg.mla_kv_rank, cfg.mla_nope_dim),
                       "v_b_proj.weight": (heads * cfg.mla_v_dim, cfg.mla_kv_rank)})
    else:
        shapes["kv_b_proj.weight"] = (heads * (cfg.mla_nope_dim + cfg.mla_v_dim),
                                      cfg.mla_kv_rank)
    if cfg.mla_q_rank:
        shapes.update({"q_a_proj.weight": (cfg.mla_q_rank, h),
                       "q_a_norm.weight": (cfg.mla_q_rank,),
                       "q_b_proj.weight": (heads * qk, cfg.mla_q_rank)})
    else:
        shapes["q_proj.weight"] = (heads * qk, h)
    return shapes


def _mlp_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    if moe.is_moe_layer(cfg, layer):
        return moe.mlp_shapes(cfg)
    h, f = cfg.hidden_size, cfg.intermediate_size
    return {"mlp_norm.weight": (h,), "gate_proj.weight": (f, h), "up_proj.weight": (f, h),
            "down_proj.weight": (h, f)}


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    attn = _attn_shapes(cfg)
    return llama.model_shapes(cfg, lambda i: {**attn, **_mlp_shapes(cfg, i)})


def stage_weights(cfg: ModelConfig, layer: int = 0) -> dict[str, list[str]]:
    return {"embed": ["embed.weight"], "attn": list(_attn_shapes(cfg)),
            "mlp": list(_mlp_shapes(cfg, layer)), "head": llama.head_weights(cfg)}


# the absorbed query needs W_UK, which is part of kv_b_proj
QUERY_WEIGHTS = ("q_proj.weight", "q_a_proj.weight", "q_a_norm.weight", "q_b_proj.weight",
                 "kv_b_proj.weight", "k_b_proj.weight")
SKEW_FOLDS_INTO_WEIGHTS = False
FUSED_DECODE = False


# Llama's: the rotary tables of the ``rope_dim`` rotated dims, with the config's scaling;
# the embedding, the attention input's norm, the MLP (dense or MoE) and the head
encode_positions = llama.encode_positions
embed = llama.embed
attn_input = llama.attn_input
mlp = llama.mlp
head = llama.head


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...) on the last dim."""
    *lead, d = x.shape
    return x.reshape(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)


def _w_uk(cfg: ModelConfig, w: dict) -> torch.Tensor:
    """W_UK as [heads, nope, kv_rank]: the first ``nope`` rows of each head's kv_b_proj, or
    llama.cpp's k_b_proj (each head's transposed) turned back."""
    if cfg.mla_kv_b_split:
        return dense(w["k_b_proj.weight"]).view(cfg.num_heads, cfg.mla_kv_rank,
                                                 cfg.mla_nope_dim).transpose(1, 2)
    return dense(w["kv_b_proj.weight"]).view(
        cfg.num_heads, cfg.mla_nope_dim + cfg.mla_v_dim, cfg.mla_kv_rank)[:, :cfg.mla_nope_dim]


def _w_uv(cfg: ModelConfig, w: dict) -> torch.Tensor:
    """W_UV as [heads, v, kv_rank]."""
    if cfg.mla_kv_b_split:
        return dense(w["v_b_proj.weight"]).view(cfg.num_heads, cfg.mla_v_dim, cfg.mla_kv_rank)
    return dense(w["kv_b_proj.weight"]).view(
        cfg.num_heads, cfg.mla_nope_dim + cfg.mla_v_dim, cfg.mla_kv_rank)[:, cfg.mla_nope_dim:]


def query(cfg: ModelConfig, w: dict, x: torch.Tensor, pos_enc) -> torch.Tensor:
    """The absorbed query [b, s, H, kv_rank + rope_dim]: ``W_UK_h^T q_nope_h`` and the rotated
    ``q_pe_h``, scaled so that the attention's 1/sqrt(head_dim) leaves the model's scale."""
    b, s, _ = x.shape
    if "q_proj.weight" in w:
        q = linear(x, w["q_proj.weight"])
    else:
        latent = llama.rms_norm(linear(x, w["q_a_proj.weight"]), w["q_a_norm.weight"],
                                cfg.norm_eps)
        q = linear(latent, w["q_b_proj.weight"])
    q = q.view(b, s, cfg.num_heads, cfg.mla_nope_dim + cfg.rope_dim)
    nope, pe = q[..., :cfg.mla_nope_dim], q[..., cfg.mla_nope_dim:]
    absorbed = torch.einsum("bshn,hnc->bshc", nope, _w_uk(cfg, w).to(q.dtype))
    pe = llama.rotary(_deinterleave(pe).contiguous(), pos_enc)
    return torch.cat([absorbed, pe], -1) * (cfg.query_scale * math.sqrt(cfg.head_dim))


def attn_qkv(cfg: ModelConfig, w: dict, x: torch.Tensor, pos_enc):
    """q (absorbed), and the cached row ``[c, k_pe]`` [b, s, 1, kv_rank + rope_dim] as both
    key and value."""
    b, s, _ = x.shape
    kv = linear(x, w["kv_a_proj.weight"])
    latent = llama.rms_norm(kv[..., :cfg.mla_kv_rank].contiguous(), w["kv_a_norm.weight"],
                            cfg.norm_eps)
    pe = _deinterleave(kv[..., cfg.mla_kv_rank:]).view(b, s, 1, cfg.rope_dim).contiguous()
    row = torch.cat([latent.view(b, s, 1, cfg.mla_kv_rank), llama.rotary(pe, pos_enc)], -1)
    return query(cfg, w, x, pos_enc), row, row


def attn_out(cfg: ModelConfig, w: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Each head's weighted latent (the first ``kv_rank`` dims of its output) through
    ``W_UV_h``, then ``o_proj``."""
    b, s, _ = attn.shape
    heads = attn.view(b, s, cfg.num_heads, cfg.head_dim)[..., :cfg.mla_kv_rank]
    values = torch.einsum("bshc,hvc->bshv", heads, _w_uv(cfg, w).to(attn.dtype))
    return h + linear(values.reshape(b, s, -1), w["o_proj.weight"])



def attention_sinks(cfg: ModelConfig, w: dict) -> None:
    """No attention sinks."""
    return None
