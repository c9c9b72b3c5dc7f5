"""The Qwen3.5 / Qwen3-Next hybrids as llama.cpp writes their GGUF files (``qwen35``,
``qwen35moe``, ``qwen3next``): the metadata of their Gated DeltaNet layers, and the store
names of their tensors (:mod:`flexgen_infinigen.models.qwen3_next` computes them).

What the files hold, against the store's names:

- ``attn_qkv`` (the DeltaNet's q|k|v in-projection), ``attn_gate`` (its z), ``ssm_beta`` and
  ``ssm_alpha`` (b and a; a ``qwen3next`` file fuses them into ``ssm_ba``, each key head's
  value heads' b rows then their a rows), ``ssm_conv1d`` ``[channels, kernel]``,
  ``ssm_dt.bias``, ``ssm_norm``, ``ssm_out``, and ``ssm_a``: the decay rate
  ``-exp(A_log)`` itself, which the store keeps as ``linear.A`` too.
- A full-attention layer's ``attn_q`` is Hugging Face's doubled projection (per head its
  query rows, then its gate rows): two store tensors, each a pick of its rows
  (:func:`row_picks`); a file's blocks are whole rows, so the picks keep their codes.
- ``qwen35``/``qwen35moe`` files reorder the value heads "tiled" (value head j reads key
  head j mod key heads; ``qwen3next`` keeps Hugging Face's grouping): every per-value-head
  row, channel and column moved the same way, so the model computes the same thing given
  ``linear_value_tiled`` (the config flag the math reads).
- Every norm holds ``1 + w`` already except ``ssm_norm``, as the store keeps them.
"""
from __future__ import annotations

import re

from ..config import ConfigError, ModelConfig

ARCHITECTURES = ("qwen35", "qwen35moe", "qwen3next")
_DELTANET = {"attn_qkv": "qkv_proj", "attn_gate": "z_proj", "ssm_beta": "b_proj",
             "ssm_alpha": "a_proj", "ssm_conv1d": "conv", "ssm_norm": "norm",
             "ssm_out": "out_proj"}
# llama.cpp names the decay rate without a suffix (``blk.N.ssm_a``)
_NAME = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?")


def hybrid_fields(field, p: str, arch: str, layers: int) -> dict:
    """Our config's hybrid fields from a file's metadata (``field(key, default)``; ``p``
    the ``{arch}.`` prefix): every ``full_attention_interval``-th layer attention, the rest
    DeltaNet layers of ``ssm.group_count`` key heads of ``ssm.state_size`` dims and
    ``ssm.time_step_rank`` value heads sharing ``ssm.inner_size`` dims."""
    every = int(field(p + "full_attention_interval", 4) or 4)
    try:
        keys, values = int(field(p + "ssm.group_count")), int(field(p + "ssm.time_step_rank"))
        inner, key_dim = int(field(p + "ssm.inner_size")), int(field(p + "ssm.state_size"))
        conv = int(field(p + "ssm.conv_kernel"))
    except TypeError as e:  # a field missing: int(None)
        raise ConfigError(f"GGUF {arch} file lacks its DeltaNet fields ({p}ssm.*); it is "
                          "not a complete hybrid model, re-convert it") from e
    if values % keys or inner % values:
        raise ConfigError(f"GGUF {p}ssm.time_step_rank = {values} value heads of "
                          f"{p}ssm.inner_size = {inner} dims over {keys} key heads "
                          "(ssm.group_count) do not divide; the file is inconsistent")
    return dict(family="qwen3_next", qk_norm=True, attn_output_gate=True,
                linear_layers=tuple(i for i in range(layers) if (i + 1) % every),
                linear_key_heads=keys, linear_value_heads=values, linear_key_dim=key_dim,
                linear_value_dim=inner // values, linear_conv=conv,
                linear_value_tiled=arch != "qwen3next" and keys != values)


def store_names(gguf_name: str, cfg: ModelConfig) -> list[str] | None:
    """The store names of a hybrid's tensor that the Llama names do not cover (two for a
    tensor split by :func:`row_picks`), or None."""
    m = _NAME.fullmatch(gguf_name)
    if cfg.family != "qwen3_next" or not m:
        return None
    part, kind, p = m.group(2), m.group(3), f"layers.{m.group(1)}."
    if part == "attn_q" and kind == "weight" and cfg.attn_output_gate:
        return [p + "q_proj.weight", p + "q_gate.weight"]
    if part == "ssm_ba" and kind == "weight":
        return [p + "linear.b_proj.weight", p + "linear.a_proj.weight"]
    if part == "ssm_a" and kind in (None, "weight"):
        return [p + "linear.A"]
    if part == "ssm_dt" and kind == "bias":
        return [p + "linear.dt_bias"]
    if part in _DELTANET and kind == "weight":
        return [f"{p}linear.{_DELTANET[part]}.weight"]
    return None


def row_picks(keys: list[str], cfg: ModelConfig) -> list[list[tuple[int, int]]] | None:
    """For a tensor split into ``keys`` by rows that interleave, each key's rows as
    ``(first, count)`` runs of the stored tensor's; None for any other tensor."""
    if len(keys) != 2 or cfg.family != "qwen3_next":
        return None
    if keys[0].endswith(".q_proj.weight"):  # per head: head_dim query rows, then gate rows
        d = cfg.head_dim
        return [[(2 * h * d + half * d, d) for h in range(cfg.num_heads)] for half in (0, 1)]
    if keys[0].endswith(".linear.b_proj.weight"):  # per key head: its value heads' b, then a
        per = cfg.linear_value_heads // cfg.linear_key_heads
        return [[(2 * g * per + half * per, per) for g in range(cfg.linear_key_heads)]
                for half in (0, 1)]
    return None


def check_picked(name: str, shape: tuple[int, ...], keys: list[str], picks: list,
                 expected: dict, source: str) -> tuple[int, ...]:
    """The shape of each part of a split tensor; one error when the file's shape is not the
    parts' rows stacked."""
    rows = sum(count for runs in picks for _, count in runs)
    want = [expected[k] for k in keys]
    if len(shape) != 2 or shape[0] != rows or any(
            w != (sum(c for _, c in runs), shape[1]) for w, runs in zip(want, picks)):
        raise ConfigError(f"GGUF {source}: tensor {name!r} has shape {shape}, but the model "
                          f"wants {' and '.join(map(str, want))} from its rows; the file "
                          "does not match the model")
    return want[0]
