"""What the readers of Hugging Face configs share: a refusal naming the field, a value of a
list-or-scalar field, and the RoPE parameters (transformers 5's ``rope_parameters`` or the
earlier ``rope_theta``/``rope_scaling``)."""
from __future__ import annotations

from ..config import ConfigError

# RoPE scaling kinds we compute and the parameters each reads
ROPE_TYPES = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "llama3": {"rope_type", "type", "rope_theta", "factor", "low_freq_factor",
               "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
             "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
             "truncate"},
}
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
    scaling = {k: v for k, v in params.items()
               if k not in ("type", "rope_theta") and v is not None}
    scaling["rope_type"] = kind
    if kind == "yarn":  # transformers' defaults, made explicit
        scaling.setdefault("original_max_position_embeddings",
                           hf.get("max_position_embeddings", 4096))
        scaling.setdefault("factor", hf.get("max_position_embeddings", 4096)
                           / scaling["original_max_position_embeddings"])
    return theta, scaling


def _first(x, default):
    if isinstance(x, list):
        return x[0] if x else default
    return default if x is None else x
