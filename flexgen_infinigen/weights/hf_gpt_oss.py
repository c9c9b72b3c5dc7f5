"""gpt-oss from a Hugging Face folder (``gpt_oss``): its config, and its routed experts,
which the checkpoint keeps fused (``mlp.experts.gate_up_proj`` [E, hidden, 2 * width] with
gate and up interleaved column by column, ``down_proj`` [E, width, hidden], both as ``x @ W``,
and their biases) and the store keeps one matrix per expert, as ``F.linear`` takes it.

The Hub's folders keep the experts as MXFP4 (``quantization_config.quant_method: mxfp4``):
``gate_up_proj_blocks`` [E, 2 * width, hidden / 32, 16] (rows are outputs, gate and up
interleaved row by row) with ``gate_up_proj_scales`` [E, 2 * width, hidden / 32], and
``down_proj_blocks``/``_scales`` likewise. A block's 16 bytes hold its 32 codes in pairs (the
low nibble the even value, the high the odd one), its scale byte the power of two (biased by
127). The store keeps them as GGUF's MXFP4 blocks (:func:`mxfp4_blocks`): the same codes and
exponent, the nibbles in GGUF's order (the low nibbles the first 16 values), so the kernels
multiply them as stored; nothing is widened.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from ..config import ModelConfig
from .hf_fields import _first, _require, rope_from_hf

GPT_OSS_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings",
    "hidden_act", "attention_bias", "sliding_window", "layer_types", "num_local_experts",
    "num_experts_per_tok", "experts_per_token", "swiglu_limit", "swiglu_alpha",
    # the training context YaRN extends (rope_scaling's original_max_position_embeddings)
    "initial_context_length",
    # the router's auxiliary loss and its logits as an output act only in training
    "router_aux_loss_coef", "output_router_logits"})

_FUSED = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)"
                    r"(_bias)?$")
_PACKED = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)"
                     r"_(blocks|scales)$")
_SINKS = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.sinks$")
_ROUTER = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.router\.(weight|bias)$")


def gpt_oss(hf: dict, name: str) -> ModelConfig:
    _require(hf.get("hidden_act", "silu") == "silu", "hidden_act", hf.get("hidden_act"),
             "gpt-oss's clamped SwiGLU")
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(layers)]
    _require(len(types) == layers and set(types) <= {"full_attention", "sliding_attention"},
             "layer_types", types, "sliding_attention and full_attention layers, one a layer")
    window = int(hf.get("sliding_window") or 0)
    experts = int(hf["num_local_experts"])
    top_k = int(hf.get("num_experts_per_tok") or hf.get("experts_per_token") or 0)
    _require(0 < top_k <= experts, "num_experts_per_tok", top_k,
             f"a top-k between 1 and the number of experts ({experts})")
    limit = float(hf.get("swiglu_limit") or 7.0)
    _require(limit > 0, "swiglu_limit", hf.get("swiglu_limit"), "a positive SwiGLU clamp")
    theta, scaling = rope_from_hf(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    eos = _first(hf.get("eos_token_id"), 200002)
    return ModelConfig(
        name=name, family="gpt_oss", vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=layers, num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        attn_head_dim=head_dim, max_positions=hf.get("max_position_embeddings", 131072),
        norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=_first(hf.get("bos_token_id"), 199998), eos_token_id=eos,
        pad_token_id=_first(hf.get("pad_token_id"), eos),
        qkv_bias=bool(hf.get("attention_bias", True)), o_bias=bool(hf.get("attention_bias", True)),
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        num_experts=experts, experts_per_token=top_k,
        expert_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
        attn_sinks=True, router_bias=True, expert_bias=True,
        swiglu_limit=limit,
        swiglu_alpha=float(hf.get("swiglu_alpha") or 1.702), model_type="gpt_oss")


class Packed(NamedTuple):
    """An expert's matrix as GGUF MXFP4 blocks: ``raw`` uint8 [rows, bytes] of the float
    ``shape`` [rows, columns]."""

    raw: np.ndarray
    shape: tuple[int, int]


def mxfp4_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Hugging Face MXFP4 (``blocks`` [..., G, 16], ``scales`` [..., G]) as GGUF's MXFP4
    blocks, [..., G * 17]: each block its exponent byte, then byte j holding code j (low
    nibble) and code j + 16 (high)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None].astype(np.uint8), packed.astype(np.uint8)], -1)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 17)


def gpt_oss_tensors(hf_name: str, tensor: torch.Tensor, pending: dict | None = None
                    ) -> Iterator[tuple[str, torch.Tensor | Packed]] | None:
    """The store's (name, tensor) pairs of a gpt-oss checkpoint tensor that the Llama names
    do not cover (sinks, the router, the fused experts split per expert); None for others.
    An MXFP4 expert tensor waits in ``pending`` for the other half of its pair (blocks and
    scales), then both give one :class:`Packed` matrix per expert."""
    m = _PACKED.match(hf_name)
    if m:
        layer, which, part = m.groups()
        if pending is None:
            raise ValueError("MXFP4 experts are read with a pending table")
        key = (layer, which)
        half = pending.setdefault(key, {})
        half[part] = tensor.numpy()
        if len(half) < 2:
            return iter([])
        del pending[key]
        return _split_packed(layer, which, mxfp4_blocks(half["blocks"], half["scales"]),
                             half["blocks"].shape[-2] * 32)
    m = _SINKS.match(hf_name)
    if m:
        return iter([(f"layers.{m.group(1)}.sinks", tensor)])
    m = _ROUTER.match(hf_name)
    if m:
        return iter([(f"layers.{m.group(1)}.router.{m.group(2)}", tensor)])
    m = _FUSED.match(hf_name)
    if not m:
        return None
    layer, which, bias = m.group(1), m.group(2), bool(m.group(3))
    return _split_experts(layer, which, bias, tensor)


def _split_experts(layer: str, which: str, bias: bool, t: torch.Tensor):
    kind = "bias" if bias else "weight"
    for e in range(t.shape[0]):
        prefix = f"layers.{layer}.experts.{e}"
        if which == "down_proj":  # [width, hidden] as x @ W: the store's [hidden, width]
            yield f"{prefix}.down_proj.{kind}", t[e] if bias else t[e].t().contiguous()
            continue
        both = t[e]  # gate and up interleaved along the last dim
        gate, up = both[..., 0::2], both[..., 1::2]
        if not bias:
            gate, up = gate.t(), up.t()
        yield f"{prefix}.gate_proj.{kind}", gate.contiguous()
        yield f"{prefix}.up_proj.{kind}", up.contiguous()


def _split_packed(layer: str, which: str, raw: np.ndarray, columns: int):
    """Per expert: ``down_proj`` as it is, ``gate_up_proj``'s rows split (gate the even
    rows, up the odd ones)."""
    for e in range(raw.shape[0]):
        prefix = f"layers.{layer}.experts.{e}"
        if which == "down_proj":
            yield f"{prefix}.down_proj.weight", Packed(raw[e], (raw.shape[1], columns))
            continue
        gate, up = raw[e, 0::2], raw[e, 1::2]
        yield f"{prefix}.gate_proj.weight", Packed(np.ascontiguousarray(gate),
                                                   (gate.shape[0], columns))
        yield f"{prefix}.up_proj.weight", Packed(np.ascontiguousarray(up), (up.shape[0], columns))
