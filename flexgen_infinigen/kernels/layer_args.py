"""The argument block of ``kernels/c/decode_layer.c`` as ctypes structures, and filling one
linear layer's part of it from a weight as loaded: shared by :mod:`.layer_call` (the layer's
call) and :mod:`..kv.infinigen.fused_select` (InfiniGen's layer inside it)."""
from __future__ import annotations

import ctypes

import torch

from ..memory.codes import Blocks, PackedWeight
from .gguf import TYPE_IDS

IN, ATTEND, OUT, MLP = 1, 2, 4, 8
_FLOAT, _Q4, _Q8, _Q4_H16, _Q8_H16, _GGUF = 0, 1, 2, 3, 4, 5
PTR = ctypes.c_void_p
I64 = ctypes.c_int64


class LinearSpec(ctypes.Structure):
    _fields_ = [("kind", I64), ("n", I64), ("k", I64), ("group", I64), ("w", PTR), ("scale", PTR),
                ("minimum", PTR), ("bias", PTR)]


class LayerArgs(ctypes.Structure):  # kernels/c/decode_layer.c's dl_args, field for field
    _fields_ = ([(n, I64) for n in ("B", "H", "KV", "D", "hidden", "inter", "nthreads")]
                + [("eps", ctypes.c_double), ("attn_norm", PTR), ("mlp_norm", PTR)]
                + [(n, LinearSpec) for n in ("q", "k", "v", "o", "gate", "up", "down")]
                + [("h", PTR), ("h_out", PTR), ("cos", PTR), ("sin", PTR), ("bias", PTR),
                   ("bias_stride", I64), ("kc", PTR), ("vc", PTR)]
                + [(n, I64) for n in ("st", "sc", "position", "first")]
                # select_step: the C function pointer InfiniGen's selection sets with sel
                # (cpu_kernels.function_address("dl_select_step")); NULL otherwise
                + [(n, PTR) for n in ("x", "q_rot", "kn", "vn", "attn", "lin", "mid", "x2", "g",
                                     "u", "bias_rows", "sel", "select_step", "q_norm",
                                     "k_norm")]
                + [("qk_full", I64)])


def point_linear(spec: LinearSpec, weight, bias, q4_ready: bool) -> bool:
    """Fill ``spec`` from a weight as loaded; False when the kernel does not read its form."""
    if bias is not None:
        if bias.dtype != torch.float32 or not bias.is_contiguous() or bias.is_cuda:
            return False
        spec.bias = bias.data_ptr()
    if isinstance(weight, PackedWeight) and isinstance(weight.packed, Blocks):
        b = weight.packed  # the file's blocks, multiplied as stored (gguf_dot.c)
        if not weight.kernel_ready:
            return False
        spec.kind, spec.group = _GGUF, TYPE_IDS[b.kind]
        spec.n, spec.k = b.shape
        spec.w = b.raw.data_ptr()
        spec.scale = b.order.data_ptr() if b.order is not None else None
        return True
    if isinstance(weight, PackedWeight):
        p = weight.packed
        if not weight.kernel_ready or p.bits not in (4, 8) or (p.bits == 4 and not q4_ready):
            return False
        # the scales' width picks the kernel: float32 (linear_q4/q8) or float16 (the _h16 pair)
        half = p.scale.dtype == torch.float16
        spec.kind = (_Q4_H16 if half else _Q4) if p.bits == 4 else (_Q8_H16 if half else _Q8)
        spec.n, spec.k = p.shape
        spec.group = p.group
        spec.w, spec.scale, spec.minimum = (t.data_ptr() for t in (p.codes, p.scale, p.minimum))
        return True
    if (not isinstance(weight, torch.Tensor) or weight.is_cuda or weight.dtype != torch.float32
            or weight.dim() != 2 or not weight.is_contiguous()):
        return False
    spec.kind = _FLOAT
    spec.n, spec.k = weight.shape
    spec.w = weight.data_ptr()
    return True
