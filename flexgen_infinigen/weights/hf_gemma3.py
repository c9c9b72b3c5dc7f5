"""Gemma 3's text model from a Hugging Face config (``gemma3_text``, or a multimodal
``gemma3`` folder's ``text_config``)."""
from __future__ import annotations

from ..config import ModelConfig
from .hf_fields import _first, _require, rope_from_hf

GEMMA3_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq",
    "tie_word_embeddings", "hidden_activation", "hidden_act", "attention_bias",
    "query_pre_attn_scalar", "sliding_window", "sliding_window_pattern",
    "_sliding_window_pattern", "layer_types", "final_logit_softcapping",
    "attn_logit_softcapping", "use_bidirectional_attention",
    # how transformers allocates its cache, not the math
    "cache_implementation"})
# a multimodal Gemma 3 folder: the text model is read from text_config; the image fields
# only matter to images, which this runtime does not take
GEMMA3_VISION = frozenset({"text_config", "vision_config", "boi_token_index",
                           "eoi_token_index", "image_token_index", "mm_tokens_per_image",
                           "initializer_range"})


def text_config(hf: dict) -> dict:
    """A multimodal folder's text config, with the token ids the folder's top level gives."""
    text = dict(hf.get("text_config") or {})
    text.pop("model_type", None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        text.setdefault(key, hf.get(key))
    return text


def gemma3(hf: dict, name: str) -> ModelConfig:
    """Gemma 3's text model (``gemma3_text``, or a multimodal folder's ``text_config``)."""
    if hf.get("model_type") == "gemma3":
        hf = text_config(hf)
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    _require(act == "gelu_pytorch_tanh", "hidden_activation", act,
             "Gemma 3's tanh-approximated GELU")
    _require(hf.get("attn_logit_softcapping") is None, "attn_logit_softcapping",
             hf.get("attn_logit_softcapping"), "Gemma 3 without attention soft-capping")
    _require(not hf.get("use_bidirectional_attention"), "use_bidirectional_attention",
             hf.get("use_bidirectional_attention"), "causal attention")
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if not types:
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
                      or 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]
    _require(len(types) == layers and set(types) <= {"full_attention", "sliding_attention"},
             "layer_types", types, "sliding_attention and full_attention layers, one a layer")
    window = int(hf.get("sliding_window") or 0)
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one set of RoPE parameters a layer type
        theta, scaling = rope_from_hf({"rope_parameters": params["full_attention"]})
        local = params.get("sliding_attention") or {}
        local_theta, local_scaling = rope_from_hf({"rope_parameters": local})
        _require(not local_scaling, "rope_parameters.sliding_attention", local,
                 "unscaled RoPE in the windowed layers")
    else:
        theta, scaling = rope_from_hf(hf)
        local_theta = float(hf.get("rope_local_base_freq") or 10000.0)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    scalar = float(hf.get("query_pre_attn_scalar") or head_dim)
    eos = _first(hf.get("eos_token_id"), 1)
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        name=name, family="gemma3", vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=layers, num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        max_positions=hf.get("max_position_embeddings", 32768),
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        rope_local_theta=local_theta, tie_word_embeddings=hf.get("tie_word_embeddings", True),
        bos_token_id=_first(hf.get("bos_token_id"), 2), eos_token_id=eos,
        pad_token_id=_first(hf.get("pad_token_id"), 0),
        attn_head_dim=head_dim if head_dim * heads != hf["hidden_size"] else 0,
        qkv_bias=bias, o_bias=bias, qk_norm=True,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        query_scale=0.0 if scalar == head_dim else scalar ** -0.5,
        final_logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        model_type="gemma3")
