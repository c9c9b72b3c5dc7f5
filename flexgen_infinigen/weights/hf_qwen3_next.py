"""The Qwen3.5 and Qwen3-Next hybrids from a Hugging Face folder: their configs
(``qwen3_next``, ``qwen3_5_text``, ``qwen3_5_moe_text``, and the multimodal ``qwen3_5`` /
``qwen3_5_moe`` whose ``text_config`` is the text model; their vision towers are not read),
and the tensors the Llama names do not cover: the Gated DeltaNet's (Qwen3-Next fuses q, k,
v and z into one projection grouped by key head, and b and a into another; the store keeps
Qwen3.5's separate ones; ``A_log`` is kept as the decay rate ``A = -exp(A_log)`` itself, in
float32, as llama.cpp's GGUF files hold it) and the full-attention layers' doubled
``q_proj`` (each head's query, then its output gate), split into ``q_proj`` and
``q_gate``."""
from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from ..config import ModelConfig
from .hf_fields import _first, _require, rope_from_hf

HYBRID_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
    "tie_word_embeddings", "hidden_act", "attention_bias", "layer_types",
    "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    # mixture-of-experts (Qwen3-Next, Qwen3.5-MoE); the router's auxiliary loss and its
    # logits as an output act only in training
    "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "output_router_logits", "router_aux_loss_coef",
    # the multi-token-prediction layers only draft tokens for speculative decoding; their
    # tensors are not read
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"})
# the multimodal wrapper: its text_config is read; the vision tower and the image and video
# tokens' ids do not change text generation
HYBRID_VISION = frozenset({"text_config", "vision_config", "image_token_id", "video_token_id",
                           "vision_start_token_id", "vision_end_token_id",
                           "tie_word_embeddings"})
HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# Qwen3.5's multimodal RoPE gives each of its three sections a position; text tokens have
# the same position in all three, which makes it plain RoPE
_MROPE = ("mrope_section", "mrope_interleaved")


def text_config(hf: dict) -> dict:
    """The text model's config of a multimodal Qwen3.5 config (else ``hf`` itself)."""
    if "text_config" not in hf:
        return hf
    text = dict(hf["text_config"])
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return text


def hybrid(hf: dict, name: str, kind: str) -> ModelConfig:
    hf = text_config(hf)
    _require(hf.get("hidden_act", "silu") == "silu", "hidden_act", hf.get("hidden_act"),
             "SiLU (the MLP's gate and the DeltaNet's convolution)")
    _require(not hf.get("attention_bias", False), "attention_bias", hf.get("attention_bias"),
             "attention without biases")
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    every = int(hf.get("full_attention_interval") or 4)
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0
                                      else "linear_attention" for i in range(layers)]
    _require(len(types) == layers and set(types) <= {"full_attention", "linear_attention"},
             "layer_types", types, "linear_attention and full_attention layers, one a layer")
    params = dict(hf.get("rope_parameters") or {})
    # transformers' default for these models: RoPE on a quarter of each head
    partial = float(params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
    for key in _MROPE:
        params.pop(key, None)
    theta, scaling = rope_from_hf({**hf, "rope_parameters": params or None})
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rotary_dim = int(head_dim * partial)
    _require(0 < rotary_dim <= head_dim and rotary_dim % 2 == 0, "partial_rotary_factor",
             partial, "RoPE on an even number of a head's dims")
    key_heads, value_heads = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    _require(value_heads % key_heads == 0, "linear_num_value_heads", value_heads,
             f"a multiple of linear_num_key_heads ({key_heads})")
    experts = {}
    if kind != "qwen3_5_text":
        top_k, count = int(hf.get("num_experts_per_tok") or 0), int(hf["num_experts"])
        _require(0 < top_k <= count, "num_experts_per_tok", top_k,
                 f"a top-k between 1 and the number of experts ({count})")
        step, only = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or ())
        experts = dict(num_experts=count, experts_per_token=top_k,
                       expert_intermediate_size=hf["moe_intermediate_size"],
                       norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                       shared_expert_size=int(hf.get("shared_expert_intermediate_size") or 0),
                       dense_layers=tuple(i for i in range(layers)
                                          if i in only or (i + 1) % step))
    eos = _first(hf.get("eos_token_id"), 248044)
    return ModelConfig(
        name=name, family="qwen3_next", vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf.get("intermediate_size") or hf.get("moe_intermediate_size", 0),
        num_layers=layers, num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        attn_head_dim=head_dim, max_positions=hf.get("max_position_embeddings", 32768),
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=_first(hf.get("bos_token_id"), eos), eos_token_id=eos,
        pad_token_id=_first(hf.get("pad_token_id"), eos), qk_norm=True,
        rotary_dim=rotary_dim, attn_output_gate=True,
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        linear_key_heads=key_heads, linear_value_heads=value_heads,
        linear_key_dim=hf["linear_key_head_dim"], linear_value_dim=hf["linear_value_head_dim"],
        linear_conv=hf.get("linear_conv_kernel_dim", 4), model_type=kind, **experts)


_LAYER = re.compile(r"^(?:model\.language_model\.|model\.)?layers\.(\d+)\.(.+)$")
_DELTANET = {"in_proj_qkv.weight": "qkv_proj.weight", "in_proj_z.weight": "z_proj.weight",
             "in_proj_b.weight": "b_proj.weight", "in_proj_a.weight": "a_proj.weight",
             "conv1d.weight": "conv.weight", "dt_bias": "dt_bias", "A_log": "A",
             "norm.weight": "norm.weight", "out_proj.weight": "out_proj.weight"}


def hybrid_tensors(cfg: ModelConfig, hf_name: str, tensor: torch.Tensor
                   ) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The store's (name, tensor) pairs of a hybrid's checkpoint tensor that the Llama names
    do not cover; None for the others."""
    m = _LAYER.match(hf_name)
    if not m:
        return None
    layer, rest = m.group(1), m.group(2)
    prefix = f"layers.{layer}."
    if rest == "self_attn.q_proj.weight":  # per head: its query rows, then its gate rows
        both = tensor.reshape(cfg.num_heads, 2, cfg.head_dim, tensor.shape[-1])
        return iter([(prefix + "q_proj.weight", both[:, 0].reshape(cfg.q_dim, -1)),
                     (prefix + "q_gate.weight", both[:, 1].reshape(cfg.q_dim, -1))])
    if not rest.startswith("linear_attn."):
        return None
    part = rest[len("linear_attn."):]
    if part == "in_proj_qkvz.weight":
        return _split_qkvz(cfg, prefix, tensor)
    if part == "in_proj_ba.weight":
        per = cfg.linear_value_heads // cfg.linear_key_heads
        width = tensor.shape[-1]
        grouped = tensor.reshape(cfg.linear_key_heads, 2, per, width)
        return iter([(prefix + "linear.b_proj.weight", grouped[:, 0].reshape(-1, width)),
                     (prefix + "linear.a_proj.weight", grouped[:, 1].reshape(-1, width))])
    if part == "conv1d.weight":  # [channels, 1, kernel]
        return iter([(prefix + "linear.conv.weight", tensor.reshape(tensor.shape[0], -1))])
    if part in _DELTANET:
        return iter([(prefix + "linear." + _DELTANET[part], tensor)])
    return iter([(None, tensor)])


def _split_qkvz(cfg: ModelConfig, prefix: str, t: torch.Tensor):
    """Qwen3-Next's fused projection, grouped by key head (each: its q, k, then the v and z
    of the value heads it serves), as Qwen3.5's separate q|k|v and z projections."""
    hk, dk, dv = cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_dim
    per = cfg.linear_value_heads // hk
    grouped = t.reshape(hk, 2 * dk + 2 * per * dv, t.shape[-1])
    q, k, v, z = grouped.split([dk, dk, per * dv, per * dv], 1)
    flat = [x.reshape(-1, t.shape[-1]) for x in (q, k, v, z)]
    yield prefix + "linear.qkv_proj.weight", torch.cat(flat[:3]).contiguous()
    yield prefix + "linear.z_proj.weight", flat[3].contiguous()
