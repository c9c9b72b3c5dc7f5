"""Reading a Hugging Face ``config.json`` into a :class:`ModelConfig`, refusing what we do not
compute.

Every field of a config is either read (it sets our math), known not to change inference
(metadata, training-only settings), or refused with one error naming it. An unknown field
is refused too: a converter that ignores a field that changes the math gives wrong text
without a word. The lists below (Gemma 3's in :mod:`.hf_gemma3`) are the one place that says
which is which.
"""
from __future__ import annotations

from ..config import ConfigError, ModelConfig
from .hf_fields import _first, _require, rope_from_hf
from .hf_deepseek import DEEPSEEK_V3_FIELDS, deepseek_v3
from .hf_gemma3 import GEMMA3_FIELDS, GEMMA3_VISION, gemma3, text_config
from .hf_gpt_oss import GPT_OSS_FIELDS, gpt_oss
from .hf_qwen3_next import HYBRID_FIELDS, HYBRID_TYPES, HYBRID_VISION, hybrid
from .hf_qwen3_next import text_config as hybrid_text

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
# GLM-4.5/4.6 (and Air): the sigmoid group router, shared experts, dense first layers,
# partial rotary; the multi-token-prediction layers (num_nextn_predict_layers) only draft
# tokens for speculative decoding, and their tensors are not read
GLM4_MOE = EXPERT_FIELDS | {"moe_intermediate_size", "n_shared_experts", "n_routed_experts",
                            "routed_scaling_factor", "n_group", "topk_group",
                            "first_k_dense_replace", "norm_topk_prob", "use_qk_norm",
                            "partial_rotary_factor", "num_nextn_predict_layers"}
UNDERSTOOD = {
    "deepseek_v3": DEEPSEEK_V3_FIELDS,
    "glm4_moe": LLAMA_FIELDS | GLM4_MOE,
    "gemma3_text": GEMMA3_FIELDS,
    "gemma3": GEMMA3_VISION,
    "gpt_oss": GPT_OSS_FIELDS,
    **{kind: HYBRID_FIELDS for kind in HYBRID_TYPES},
    "qwen3_5": HYBRID_VISION,
    "qwen3_5_moe": HYBRID_VISION,
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
MOE_HINTS = ("expert", "moe", "router")
# architectures whose attention this runtime does not compute, refused by what it lacks
NOT_COMPUTED = {
    "deepseek_v2": "DeepSeek-V2's softmax group-limited router (V3's MLA and sigmoid router "
                   "are computed: model_type deepseek_v3)",
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


MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3",
             "gpt_oss", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe")


def experts_from_hf(hf: dict, kind: str) -> dict:
    """The mixture-of-experts fields of our config (none for a dense model type)."""
    if kind not in MOE_TYPES:
        return {}
    if kind in ("glm4_moe", "deepseek_v3"):  # the same router, and the same fields
        return _glm4_moe_experts(hf)
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


def _glm4_moe_experts(hf: dict) -> dict:
    experts, top_k = int(hf["n_routed_experts"]), int(hf.get("num_experts_per_tok") or 0)
    groups, best = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    _require(0 < top_k <= experts, "num_experts_per_tok", top_k,
             f"a top-k between 1 and the number of experts ({experts})")
    _require(experts % groups == 0 and 0 < best <= groups and experts // groups >= 2,
             "n_group", groups, "groups of at least two experts that divide the experts")
    size = int(hf["moe_intermediate_size"])
    return dict(num_experts=experts, experts_per_token=top_k, expert_intermediate_size=size,
                norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                dense_layers=tuple(range(int(hf.get("first_k_dense_replace") or 0))),
                shared_expert_size=size * int(hf.get("n_shared_experts") or 0),
                shared_expert_gated=False, router_sigmoid=True, router_groups=groups,
                router_topk_groups=best,
                routed_scaling=float(hf.get("routed_scaling_factor") or 1.0))


def _partial_rotary(hf: dict) -> tuple[dict, float]:
    """(``hf`` without its partial rotary factor, the factor): transformers 5 keeps it in
    ``rope_parameters``, earlier configs at the top."""
    params = dict(hf.get("rope_parameters") or {})
    factor = float(params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    return {**hf, "rope_parameters": params or None}, factor


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
    hf, partial = _partial_rotary(hf)
    theta, scaling = rope_from_hf(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rotary_dim = int(head_dim * partial)
    _require(0 < rotary_dim <= head_dim and rotary_dim % 2 == 0, "partial_rotary_factor",
             partial, "RoPE on an even number of a head's dims")
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
        o_bias=bias and kind != "glm4_moe",  # GLM: biases on q, k and v only
        qk_norm=kind in ("qwen3", "qwen3_moe", "olmoe") or bool(hf.get("use_qk_norm")),
        qk_norm_full=kind == "olmoe", rotary_dim=rotary_dim,
        sliding_window=window, rope_scaling=scaling, model_type=kind,
        **experts_from_hf(hf, kind))


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
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    if kind == "gpt_oss" and quant == "mxfp4":  # the Hub's: its experts as MXFP4 blocks,
        # which the converter keeps as they are (hf_gpt_oss); everything else is float
        hf = {k: v for k, v in hf.items() if k != "quantization_config"}
    check_fields(hf, kind, allow)
    try:
        if kind == "opt":
            return opt(hf, name)
        if kind == "gemma3":  # the text model's own fields, checked as gemma3_text's
            check_fields(text_config(hf), "gemma3_text")
        if kind in ("gemma3", "gemma3_text"):
            return gemma3(hf, name)
        if kind == "gpt_oss":
            return gpt_oss(hf, name)
        if kind in ("qwen3_5", "qwen3_5_moe"):  # the text model's own fields and type
            text = hybrid_text(hf)
            kind = text.get("model_type") or f"{kind}_text"
            _require(kind in HYBRID_TYPES, "text_config.model_type", kind,
                     " or ".join(HYBRID_TYPES))
            check_fields(text, kind, allow)
        if kind in HYBRID_TYPES:
            return hybrid(hf, name, kind)
        if kind == "deepseek_v3":
            return deepseek_v3(hf, name, experts_from_hf(hf, kind))
        return llama_like(hf, name, kind)
    except KeyError as e:
        raise ConfigError(f"config.json lacks {e.args[0]!r}; the checkpoint folder is "
                          "incomplete") from None
