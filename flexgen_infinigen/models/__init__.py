"""Model families: each is a small module of math with the same functions.

A family module provides ``weight_shapes``, ``stage_weights`` (of one layer: a model may mix
dense and mixture-of-experts layers), ``encode_positions``,
``embed``, ``attn_input``, ``query``, ``attn_qkv``, ``attn_out``, ``mlp`` and ``head``,
the names ``QUERY_WEIGHTS`` (the weights the query alone needs) and the flag
``SKEW_FOLDS_INTO_WEIGHTS`` (whether q and k are plain affine maps of
the attention input, so that InfiniGen's skew can be folded into W_Q and W_K). The engine
calls only these; it never asks which family it runs.
"""
from types import ModuleType

from . import llama, opt

FAMILIES: dict[str, ModuleType] = {"opt": opt, "llama": llama}


def family_of(cfg) -> ModuleType:
    return FAMILIES[cfg.family]
