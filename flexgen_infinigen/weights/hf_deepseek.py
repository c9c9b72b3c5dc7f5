"""DeepSeek-V3 / R1 from a Hugging Face config (``deepseek_v3``): multi-head latent attention
(:mod:`..models.mla`) and GLM-4.5's sigmoid group router (the same fields)."""
from __future__ import annotations

from ..config import ModelConfig
from ..models.llama import yarn_mscale
from .hf_fields import _first, _require, rope_from_hf

DEEPSEEK_V3_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "hidden_act",
    "attention_bias", "head_dim", "qk_head_dim", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave",
    "moe_intermediate_size", "n_shared_experts", "n_routed_experts", "routed_scaling_factor",
    "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob",
    "topk_method", "scoring_func", "moe_layer_freq", "num_nextn_predict_layers",
    "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "ep_size"})


def deepseek_v3(hf: dict, name: str, experts: dict) -> ModelConfig:
    """The config of a DeepSeek-V3 checkpoint; ``experts``: its MoE fields (read as
    GLM-4.5's)."""
    _require(hf.get("hidden_act", "silu") == "silu", "hidden_act", hf.get("hidden_act"),
             "SiLU-gated MLPs")
    _require(not hf.get("attention_bias"), "attention_bias", hf.get("attention_bias"),
             "MLA without projection biases")
    _require(hf.get("topk_method", "noaux_tc") == "noaux_tc", "topk_method",
             hf.get("topk_method"), "DeepSeek-V3's noaux_tc router")
    _require(hf.get("scoring_func", "sigmoid") == "sigmoid", "scoring_func",
             hf.get("scoring_func"), "sigmoid router scores")
    _require(int(hf.get("moe_layer_freq") or 1) == 1, "moe_layer_freq",
             hf.get("moe_layer_freq"), "every layer after the dense ones a MoE layer")
    _require(hf.get("rope_interleave", True), "rope_interleave", hf.get("rope_interleave"),
             "DeepSeek's interleaved rotary dims")
    theta, scaling = rope_from_hf(hf)
    rope, nope = int(hf["qk_rope_head_dim"]), int(hf["qk_nope_head_dim"])
    rank = int(hf["kv_lora_rank"])
    eos = _first(hf.get("eos_token_id"), 1)
    scale = (nope + rope) ** -0.5
    if scaling.get("mscale_all_dim"):  # YaRN's correction, on the scores of every dim
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return ModelConfig(
        name=name, family="mla", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], num_kv_heads=1,
        max_positions=hf.get("max_position_embeddings", 4096),
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        bos_token_id=_first(hf.get("bos_token_id"), 0), eos_token_id=eos,
        pad_token_id=_first(hf.get("pad_token_id"), eos),
        attn_head_dim=rank + rope, rotary_dim=rope, mla_kv_rank=rank,
        mla_q_rank=int(hf.get("q_lora_rank") or 0), mla_nope_dim=nope,
        mla_v_dim=int(hf["v_head_dim"]), query_scale=scale,
        model_type="deepseek_v3", **experts)
