"""A GGUF model's header: the file opened (a split model's shards read as one), its metadata
fields, and the model config they describe (llama, qwen2, qwen3, gemma3, deepseek2's latent
attention, the Qwen3.5 / Qwen3-Next hybrids of :mod:`.gguf_hybrid` and the
mixture-of-experts types of :mod:`.gguf_moe`). Reads no tensor data.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from ..config import KNOWN_MODELS, ConfigError, ModelConfig
from . import gguf_hybrid, gguf_moe
from .gguf_shards import JoinedReader, shard_paths

GGUF_MAGIC = b"GGUF"
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "olmoe", "gemma3",
                 "glm4moe", "deepseek2", "gpt-oss", *gguf_hybrid.ARCHITECTURES)
# partial rotary embeddings (RoPE on the first rope.dimension_count dims of each head)
PARTIAL_ROTARY = ("glm4moe", "deepseek2", *gguf_hybrid.ARCHITECTURES)


def _open_reader(path: Path):
    import gguf

    if not path.is_file():
        raise ConfigError(f"GGUF file {path} does not exist; check the path")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ConfigError(f"{path} is not a GGUF file; pass a .gguf model file")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # corrupt or truncated files raise assorted errors
        raise ConfigError(f"cannot read GGUF file {path} ({e}); re-download it") from e


def open_model(path: Path):
    """The reader of a GGUF model: one file, or all shards of a split one (any shard
    named) read as one (:class:`.gguf_shards.JoinedReader`)."""
    paths = shard_paths(Path(path))
    if len(paths) == 1:
        return _open_reader(paths[0])
    return JoinedReader([_open_reader(p) for p in paths], str(path))


def field_value(reader, key: str, default=None):
    """The decoded value of one GGUF metadata key, or ``default``."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "gguf-model"


def _gemma3(reader, p: str, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    """Gemma 3's fields as llama.cpp reads them: windowed layers by the file's pattern (a flag
    a layer, or every n-th layer global; 6 when absent), their RoPE base (10000 when
    absent), the logits' soft cap, and the query scale (the 27B's, 62 layers, is
    hidden/heads; every other size's the head width)."""
    window = int(field_value(reader, p + "attention.sliding_window", 0) or 0)
    pattern = field_value(reader, p + "attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        windowed = [bool(x) for x in pattern]
    else:
        windowed = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    if len(windowed) != layers:
        raise ConfigError(f"GGUF sliding_window_pattern has {len(windowed)} entries for "
                          f"{layers} layers; the file is inconsistent")
    scalar = hidden / heads if layers == 62 else head_dim
    return dict(family="gemma3",
                layer_windows=tuple(window if w else 0 for w in windowed),
                rope_local_theta=float(field_value(reader, p + "rope.freq_base_swa", 10000.0)),
                query_scale=0.0 if scalar == head_dim else scalar ** -0.5,
                final_logit_softcap=float(field_value(reader, p + "final_logit_softcapping",
                                                      0.0) or 0.0))


def _gpt_oss(reader, p: str, layers: int) -> dict:
    """gpt-oss as llama.cpp writes it: every other layer windowed, the first one first (its
    window from the file); sinks, biases on the router, the experts and the attention's
    output, and the clamped SwiGLU, whose limit and alpha llama.cpp's graph fixes (7 and
    1.702, as the Hugging Face config has them)."""
    window = int(field_value(reader, p + "attention.sliding_window", 0) or 0)
    return dict(family="gpt_oss", o_bias=True, attn_sinks=True, router_bias=True,
                expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702,
                layer_windows=tuple(window if i % 2 == 0 else 0 for i in range(layers)))


def _gpt_oss_yarn(reader, p: str) -> dict:
    """gpt-oss's YaRN: the file's factor and original context, the ramp unrounded
    (``truncate`` false, as the model's config says; llama.cpp rounds its ends)."""
    return {"rope_type": "yarn", "factor": float(field_value(reader, p + "rope.scaling.factor")),
            "original_max_position_embeddings": int(field_value(
                reader, p + "rope.scaling.original_context_length")),
            "beta_fast": float(field_value(reader, p + "rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(field_value(reader, p + "rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False}


def _deepseek_yarn(reader, p: str) -> dict:
    """DeepSeek's YaRN as llama.cpp's converter writes it (its log multiplier is 0.1 x
    mscale_all_dim; mscale equals it, so the rotary tables are unscaled)."""
    every = float(field_value(reader, p + "rope.scaling.yarn_log_multiplier", 0.0) or 0.0) / 0.1
    return {"rope_type": "yarn", "factor": float(field_value(reader, p + "rope.scaling.factor")),
            "original_max_position_embeddings": int(field_value(
                reader, p + "rope.scaling.original_context_length")),
            "beta_fast": float(field_value(reader, p + "rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(field_value(reader, p + "rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": every, "mscale_all_dim": every}


def _deepseek2(reader, p: str, rope_dim: int, rope: dict, tensors) -> dict:
    """DeepSeek-V3's latent attention as llama.cpp writes it: one KV head of ``kv_lora_rank
    + rope`` dims, the per-head widths in ``key_length_mla``/``value_length_mla`` (older
    files: ``key_length``/``value_length``), kv_b_proj whole or split into k_b and v_b."""
    from ..models.llama import yarn_mscale

    rank = int(field_value(reader, p + "attention.kv_lora_rank"))
    key = int(field_value(reader, p + "attention.key_length_mla", 0)
              or field_value(reader, p + "attention.key_length"))
    value = int(field_value(reader, p + "attention.value_length_mla", 0)
                or field_value(reader, p + "attention.value_length"))
    scale = key ** -0.5
    if rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return dict(family="mla", num_kv_heads=1, attn_head_dim=rank + rope_dim, rotary_dim=rope_dim,
                mla_kv_rank=rank, mla_q_rank=int(field_value(reader, p + "attention.q_lora_rank",
                                                             0) or 0),
                mla_nope_dim=key - rope_dim, mla_v_dim=value, query_scale=scale,
                mla_kv_b_split="blk.0.attn_k_b.weight" in tensors)


def config_from_gguf(reader, name: str | None = None, source: str = "") -> ModelConfig:
    """Build (or, for a known ``name``, verify) the model config from GGUF metadata."""
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"GGUF {source} has architecture {arch!r}; only "
                          f"{', '.join(ARCHITECTURES)} GGUF files can be converted")
    p = arch + "."
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ConfigError(f"GGUF {source} has no token_embd.weight; it is not a complete model")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    vocab = field_value(reader, p + "vocab_size") or (len(tokens) if tokens else None)
    vocab = vocab or int(tensors["token_embd.weight"].shape[-1])
    hidden = int(field_value(reader, p + "embedding_length"))
    heads = int(field_value(reader, p + "attention.head_count"))
    head_dim = int(field_value(reader, p + "attention.key_length", hidden // heads))
    rope_dim = int(field_value(reader, p + "rope.dimension_count") or head_dim)
    if rope_dim != head_dim and (arch not in PARTIAL_ROTARY or rope_dim % 2
                                 or rope_dim > head_dim):
        raise ConfigError(f"GGUF {source} uses partial rotary embeddings ({rope_dim} of "
                          f"{head_dim} dims), which this runtime computes for "
                          f"{', '.join(PARTIAL_ROTARY)} only")
    scaling = field_value(reader, p + "rope.scaling.type")
    rope = {}
    if scaling == "linear":
        rope = {"rope_type": "linear", "factor": float(field_value(reader,
                                                                   p + "rope.scaling.factor"))}
    elif scaling == "yarn" and arch == "deepseek2":
        rope = _deepseek_yarn(reader, p)
    elif scaling == "yarn" and arch == "gpt-oss":
        rope = _gpt_oss_yarn(reader, p)
    elif scaling not in (None, "none"):
        raise ConfigError(f"GGUF {source} uses rope scaling {scaling!r}, which the GGUF path "
                          "does not read; convert the Hugging Face checkpoint instead")
    # block_count counts GLM's multi-token-prediction layers, which only draft tokens
    layers = int(field_value(reader, p + "block_count")) - int(
        field_value(reader, p + "nextn_predict_layers", 0) or 0)
    moe = gguf_moe.experts_from_gguf(reader, arch, source, layers)
    extra = _gemma3(reader, p, layers, hidden, heads, head_dim) if arch == "gemma3" else \
        _deepseek2(reader, p, rope_dim, rope, tensors) if arch == "deepseek2" else \
        _gpt_oss(reader, p, layers) if arch == "gpt-oss" else \
        gguf_hybrid.hybrid_fields(lambda k, d=None: field_value(reader, k, d), p, arch,
                                  layers) if arch in gguf_hybrid.ARCHITECTURES else {}
    fields = dict(
        name=name or _slug(field_value(reader, "general.name") or Path(source).stem),
        family=extra.pop("family", "llama"),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(field_value(reader, p + "feed_forward_length", 0)
                              or moe.get("expert_intermediate_size", 0)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(field_value(reader, p + "attention.head_count_kv", heads)),
        max_positions=int(field_value(reader, p + "context_length", 2048)),
        norm_eps=float(field_value(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field_value(reader, p + "rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=int(field_value(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(field_value(reader, "tokenizer.ggml.eos_token_id", 2)),
        pad_token_id=int(field_value(reader, "tokenizer.ggml.padding_token_id", 0)),
        attn_head_dim=head_dim if head_dim * heads != hidden else 0,
        qkv_bias="blk.0.attn_q.bias" in tensors, rope_scaling=rope,
        qk_norm="blk.0.attn_q_norm.weight" in tensors, qk_norm_full=arch == "olmoe",
        rotary_dim=rope_dim, model_type=arch)
    meta = ModelConfig(**{**fields, **moe, **extra})
    if name is None or name not in KNOWN_MODELS:
        return meta
    known = KNOWN_MODELS[name]
    for field in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "tie_word_embeddings", "head_dim", "qkv_bias",
                  "rope_scaling"):
        if getattr(known, field) != getattr(meta, field):
            raise ConfigError(f"GGUF {source} has {field}={getattr(meta, field)}, but "
                              f"{name} has {getattr(known, field)}; pick the matching --model")
    for field in ("norm_eps", "rope_theta"):
        if not math.isclose(getattr(known, field), getattr(meta, field), rel_tol=1e-5):
            raise ConfigError(f"GGUF {source} has {field}={getattr(meta, field)}, but "
                              f"{name} has {getattr(known, field)}; pick the matching --model")
    return known
