"""Reading a Hugging Face ``config.json`` into a :class:`ModelConfig`, refusing what we do not
compute.

Every field of a config is either read (it sets our math), known not to change inference
(metadata, training-only settings), or refused with one error naming it. An unknown field
is refused too: a converter that ignores a field that changes the math gives wrong text
without a word. The lists below are the one place that says which is which.
"""
from __future__ import annotations

from ..config import ConfigError, ModelConfig

# present in most configs, no effect on the numbers of inference
METADATA = frozenset({
    "_name_or_path", "architectures", "model_type", "torch_dtype", "dtype",
    "transformers_version", "use_cache", "initializer_range", "init_std", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "is_encoder_decoder", "chunk_size_feed_forward", "tokenizer_class", "prefix",
    "decoder_start_token_id", "torchscript", "use_return_dict", "pruned_heads",
    "tie_encoder_decoder", "finetuning_task", "task_specific_params", "sep_token_id",
    "cross_attention_hidden_size", "add_cross_attention", "max_length", "num_labels",
    "bos_token_id", "eos_token_id", "pad_token_id", "tf_legacy_loss",
    # dropout and layer drop act only in training
    "attention_dropout", "dropout", "activation_dropout", "layerdrop", "hidden_dropout",
    # splits of the projections that only reorder a sum (pretraining tensor parallelism)
    "pretraining_tp",
})

# math fields each model type's reader understands (the value checks are in the readers)
LLAMA_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "head_dim",
    "hidden_act", "attention_bias", "mlp_bias",
})
QWEN_WINDOW = frozenset({"use_sliding_window", "sliding_window", "max_window_layers",
                         "layer_types"})
# mixture-of-experts fields (models/moe.py computes them); the router's auxiliary loss, its
# logits as an output and its jitter noise act only in training
EXPERT_FIELDS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok",
                           "output_router_logits", "router_aux_loss_coef",
                           "router_jitter_noise"})
QWEN_MOE = EXPERT_FIELDS | {"moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                            "mlp_only_layers"}
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
UNDERSTOOD = {
    "gemma3_text": GEMMA3_FIELDS,
    "gemma3": GEMMA3_VISION,
    "llama": LLAMA_FIELDS,
    "mistral": LLAMA_FIELDS | {"sliding_window"},
    "qwen2": LLAMA_FIELDS | QWEN_WINDOW,
    "qwen3": LLAMA_FIELDS | QWEN_WINDOW,
    "qwen3_moe": LLAMA_FIELDS | QWEN_WINDOW | QWEN_MOE,
    "qwen2_moe": LLAMA_FIELDS | QWEN_WINDOW | QWEN_MOE | {"shared_expert_intermediate_size",
                                                          "qkv_bias"},
    "mixtral": LLAMA_FIELDS | {"sliding_window"} | EXPERT_FIELDS,
    "olmoe": LLAMA_FIELDS | EXPERT_FIELDS | {"norm_topk_prob", "clip_qkv"},
    "opt": frozenset({
        "vocab_size", "hidden_size", "ffn_dim", "num_hidden_layers", "num_attention_heads",
        "max_position_embeddings", "word_embed_proj_dim", "do_layer_norm_before",
        "activation_function", "enable_bias", "layer_norm_elementwise_affine",
        "_remove_final_layer_norm", "tie_word_embeddings"}),
}
# RoPE scaling kinds we compute and the parameters each reads
ROPE_TYPES = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor",
               "high_freq_factor", "original_max_position_embeddings"},
}
MOE_HINTS = ("expert", "moe", "router")
# architectures whose attention this runtime does not compute, refused by what it lacks
NOT_COMPUTED = {
    "deepseek_v2": "DeepSeek's multi-head latent attention (MLA)",
    "deepseek_v3": "DeepSeek's multi-head latent attention (MLA)",
    "gpt_oss": "gpt-oss's attention sinks",
}


def check_fields(hf: dict, kind: str, allow: tuple[str, ...] = ()) -> None:
    """One error naming the first field that we neither compute nor know to be harmless."""
    known = UNDERSTOOD[kind] | METADATA | set(allow)
    for field in hf:
        if field in known:
            continue
        if any(h in field.lower() for h in MOE_HINTS):
            raise ConfigError(f"config.json field {field!r} is not computed by this runtime "
                              f"for model_type {kind!r} (its mixture-of-experts types: "
                              f"{', '.join(sorted(k for k in UNDERSTOOD if k in MOE_TYPES))})")
        if field == "quantization_config":
            raise ConfigError("config.json has a quantization_config: pre-quantized checkpoints "
                              "are not supported; convert the unquantized (bf16/fp16) weights")
        raise ConfigError(
            f"config.json field {field!r} is not understood for model_type {kind!r} and may "
            f"change the model's math; if it does not, pass --allow-field {field} to convert")


def _require(ok: bool, field: str, value, what: str) -> None:
    if not ok:
        raise ConfigError(f"config.json has {field}={value!r}; this runtime computes only "
                          f"{what}")


def rope_from_hf(hf: dict) -> tuple[float, dict]:
    """(theta, scaling dict) from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (earlier configs); unknown kinds and parameters are refused."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"config.json asks for RoPE scaling {kind!r}, which this runtime does "
                          f"not compute (it does: {', '.join(ROPE_TYPES)})")
    extra = sorted(set(params) - ROPE_TYPES[kind])
    if extra:
        raise ConfigError(f"config.json RoPE parameter {extra[0]!r} (with rope_type {kind!r}) "
                          "is not computed by this runtime")
    if kind == "default":
        return theta, {}
    scaling = {k: v for k, v in params.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = kind
    return theta, scaling


def _first(x, default):
    if isinstance(x, list):
        return x[0] if x else default
    return default if x is None else x


MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def experts_from_hf(hf: dict, kind: str) -> dict:
    """The mixture-of-experts fields of our config (none for a dense model type)."""
    if kind not in MOE_TYPES:
        return {}
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    top_k = int(hf.get("num_experts_per_tok") or 0)
    _require(0 < top_k <= experts, "num_experts_per_tok", top_k,
             f"a top-k between 1 and the number of experts ({experts})")
    out = dict(num_experts=experts, experts_per_token=top_k,
               expert_intermediate_size=hf["intermediate_size"],
               norm_topk_prob=kind == "mixtral" or bool(hf.get("norm_topk_prob", False)))
    if kind in ("qwen3_moe", "qwen2_moe"):
        step = int(hf.get("decoder_sparse_step") or 1)
        only = set(hf.get("mlp_only_layers") or ())
        out["expert_intermediate_size"] = hf["moe_intermediate_size"]
        out["dense_layers"] = tuple(i for i in range(hf["num_hidden_layers"])
                                    if i in only or (i + 1) % step)
    if kind == "qwen2_moe":
        out["shared_expert_size"] = int(hf.get("shared_expert_intermediate_size") or 0)
    if kind == "olmoe":
        _require(hf.get("clip_qkv") is None, "clip_qkv", hf.get("clip_qkv"),
                 "OLMoE without q/k/v clipping")
    return out


def llama_like(hf: dict, name: str, kind: str) -> ModelConfig:
    """Llama 1-3.x, Mistral, Qwen2/2.5, Qwen3 and the mixture-of-experts Qwen3-MoE,
    Qwen2-MoE, Mixtral and OLMoE: one family with flags."""
    _require(hf.get("hidden_act", "silu") == "silu", "hidden_act", hf.get("hidden_act"),
             "SiLU-gated MLPs")
    _require(not hf.get("mlp_bias", False), "mlp_bias", hf.get("mlp_bias"), "MLPs without bias")
    window = 0
    if kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        _require(not hf.get("use_sliding_window", False), "use_sliding_window",
                 hf.get("use_sliding_window"), "full attention in every Qwen layer")
        types = set(hf.get("layer_types") or ["full_attention"])
        _require(types == {"full_attention"}, "layer_types", sorted(types),
                 "full_attention layers for Qwen")
    if kind in ("mistral", "mixtral"):
        window = int(hf.get("sliding_window") or 0)
    heads = hf["num_attention_heads"]
    theta, scaling = rope_from_hf(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    bias = bool(hf.get("attention_bias", False))
    eos = _first(hf.get("eos_token_id"), 2)
    return ModelConfig(
        name=name, family="llama", vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        max_positions=hf.get("max_position_embeddings", 4096),
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta,
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=_first(hf.get("bos_token_id"), 1),
        eos_token_id=eos, pad_token_id=_first(hf.get("pad_token_id"), eos),  # pads are masked
        attn_head_dim=head_dim if head_dim * heads != hf["hidden_size"] else 0,
        qkv_bias=bias or kind == "qwen2" or (kind == "qwen2_moe" and hf.get("qkv_bias", True)),
        o_bias=bias, qk_norm=kind in ("qwen3", "qwen3_moe", "olmoe"), qk_norm_full=kind == "olmoe",
        sliding_window=window, rope_scaling=scaling, model_type=kind,
        **experts_from_hf(hf, kind))


def gemma3(hf: dict, name: str) -> ModelConfig:
    """Gemma 3's text model (``gemma3_text``, or a multimodal folder's ``text_config``)."""
    if hf.get("model_type") == "gemma3":
        text = dict(hf.get("text_config") or {})
        text.pop("model_type", None)
        check_fields(text, "gemma3_text")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            text.setdefault(key, hf.get(key))
        hf = text
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


def opt(hf: dict, name: str) -> ModelConfig:
    _require(hf.get("activation_function", "relu") == "relu", "activation_function",
             hf.get("activation_function"), "ReLU MLPs for OPT")
    _require(hf.get("enable_bias", True), "enable_bias", hf.get("enable_bias"),
             "OPT with biases")
    _require(hf.get("layer_norm_elementwise_affine", True), "layer_norm_elementwise_affine",
             hf.get("layer_norm_elementwise_affine"), "OPT with affine layer norms")
    _require(not hf.get("_remove_final_layer_norm", False), "_remove_final_layer_norm",
             hf.get("_remove_final_layer_norm"), "OPT with its final layer norm")
    _require(hf.get("tie_word_embeddings", True), "tie_word_embeddings",
             hf.get("tie_word_embeddings"), "OPT with its head tied to the embedding")
    proj = hf.get("word_embed_proj_dim", hf["hidden_size"])
    return ModelConfig(
        name=name, family="opt", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["ffn_dim"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_attention_heads"],
        max_positions=hf["max_position_embeddings"], tie_word_embeddings=True,
        bos_token_id=_first(hf.get("bos_token_id"), 2),
        eos_token_id=_first(hf.get("eos_token_id"), 2),
        pad_token_id=_first(hf.get("pad_token_id"), 1),
        word_embed_proj_dim=proj if proj != hf["hidden_size"] else 0,
        do_layer_norm_before=hf.get("do_layer_norm_before", True))


def config_from_hf(hf: dict, name: str, allow: tuple[str, ...] = ()) -> ModelConfig:
    """Our config for a Hugging Face one; one :class:`ConfigError` for anything we would not
    compute as the model's authors did."""
    kind = hf.get("model_type")
    if kind in NOT_COMPUTED:
        raise ConfigError(f"model_type {kind!r}: {NOT_COMPUTED[kind]} is not computed by this "
                          f"runtime; it converts {', '.join(sorted(UNDERSTOOD))}")
    if kind not in UNDERSTOOD:
        raise ConfigError(f"model_type {kind!r} is not supported; this runtime converts "
                          f"{', '.join(sorted(UNDERSTOOD))}")
    check_fields(hf, kind, allow)
    try:
        if kind == "opt":
            return opt(hf, name)
        if kind in ("gemma3", "gemma3_text"):
            return gemma3(hf, name)
        return llama_like(hf, name, kind)
    except KeyError as e:
        raise ConfigError(f"config.json lacks {e.args[0]!r}; the checkpoint folder is "
                          "incomplete") from None
