"""The compiled kernels' interface as one table: every C function Python calls in the library
(``kernels/c/*.c``), its return type, then its arguments by the C prototype's parameter names
and in its order, each with its ctypes type. The library's ``argtypes`` and ``restype`` are
built from it once, when it loads (:func:`declare`), and :func:`~.cpu_kernels.invoke` orders
keyword arguments by it; ``tests/test_kernel_table.py`` checks it against the prototypes, so
a prototype changed without the table fails there rather than passing wrong arguments.

C types map as ctypes passes them: any pointer (to data, to a pointer table or to a
function) is ``c_void_p``; ``int64_t`` is ``c_int64``, ``int`` ``c_int``, ``float``
``c_float``, ``double`` ``c_double``; a ``void`` return is None.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

__all__ = ["KERNELS", "Kernel", "declare"]

PTR, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
F32, F64 = ctypes.c_float, ctypes.c_double


@dataclass(frozen=True)
class Kernel:
    """One C function: what it returns (a ctypes type, or None for ``void``) and its
    parameters, ``(name, ctypes type)`` in the prototype's order."""

    returns: type | None
    params: tuple[tuple[str, type], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.params)

    @property
    def argtypes(self) -> list[type]:
        return [t for _, t in self.params]


def _k(returns: type | None, **params: type) -> Kernel:
    return Kernel(returns, tuple(params.items()))


_LINEAR_CODES = dict(x=PTR, codes=PTR, scale=PTR, minimum=PTR, bias=PTR, out=PTR, M=I64,
                     N=I64, K=I64, group=I64, nthreads=I64)

KERNELS: dict[str, Kernel] = {
    # speculation.c: InfiniGen's packed speculation keys
    "score_packed": _k(None, codes=PTR, scale=PTR, lo=PTR, q=PTR, qsum=PTR, out=PTR, T=I64,
                       L=I64, C=I64, P=I64, G=I64, bits=I64, nthreads=I64),
    "speculate_mass": _k(None, codes=PTR, scale=PTR, lo=PTR, q=PTR, qsum=PTR, visible=PTR,
                         cap=PTR, order=PTR, T=I64, L=I64, C=I64, KV=I64, P=I64, G=I64,
                         bits=I64, width=I64, nthreads=I64),
    "spec_write": _k(None, x=PTR, codes=PTR, lo=PTR, scale=PTR, n=I64, start=I64, L=I64,
                     C=I64, W=I64, P=I64, bits=I64),
    # pages.c, selection.c, projection.c
    "speculate_pages": _k(None, lo=PTR, hi=PTR, q=PTR, visible=PTR, cap=PTR, order=PTR,
                          counts=PTR, T=I64, NPmax=I64, C=I64, KV=I64, W=I64, G=I64, P=I64,
                          width=I64, nthreads=I64),
    "select_mass": _k(None, scores=PTR, visible=PTR, cap=PTR, order=PTR, C=I64, KV=I64,
                      G=I64, T=I64, width=I64, nthreads=I64),
    "project_heads": _k(None, x=PTR, P=PTR, out=PTR, B=I64, N=I64, KV=I64, d=I64, r=I64,
                        xsb=I64, xsn=I64, xsk=I64, osb=I64, osn=I64, osk=I64, psb=I64,
                        nthreads=I64),
    # linear.c, linear_h16.c: few-row linear layers
    "linear_rows": _k(None, x=PTR, w=PTR, bias=PTR, out=PTR, M=I64, N=I64, K=I64,
                      nthreads=I64),
    "linear_q4": _k(INT, **_LINEAR_CODES),
    "linear_q8": _k(INT, **_LINEAR_CODES),
    "linear_q4_h16": _k(INT, **_LINEAR_CODES),
    "linear_q8_h16": _k(INT, **_LINEAR_CODES),
    "h16_widen_rows": _k(None, src=PTR, dst=PTR, n=I64),
    # gguf_dot.c: GGUF blocks as stored, against activations quantized to 8 bits
    "gguf_linear": _k(INT, type=I64, w=PTR, order=PTR, x=PTR, bias=PTR, out=PTR, M=I64, N=I64,
                      K=I64, nthreads=I64),
    "gguf_dequantize_rows": _k(INT, type=I64, w=PTR, rows=PTR, n=I64, K=I64, out=PTR,
                               nthreads=I64),
    # moe_experts.c, moe_layer.c: a MoE layer's routed experts
    "moe_gguf": _k(INT, x=PTR, T=I64, U=I64, first=PTR, tok=PTR, wt=PTR, w=PTR, types=PTR,
                   out=PTR, H=I64, F=I64, nthreads=I64),
    "moe_q4_h16": _k(INT, x=PTR, T=I64, U=I64, first=PTR, tok=PTR, wt=PTR, codes=PTR,
                     scales=PTR, minima=PTR, out=PTR, H=I64, F=I64, group=I64, nthreads=I64),
    "moe_layer_q4_h16": _k(INT, h=PTR, T=I64, norm_w=PTR, eps=F32, router=PTR, E=I64, K=I64,
                           renorm=I64, codes=PTR, scales=PTR, minima=PTR, out=PTR, H=I64,
                           F=I64, group=I64, nthreads=I64),
    # attention.c, attention_q4.c: decode attention over rows read in place
    "attend_rows": _k(None, q=PTR, k=PTR, v=PTR, bias=PTR, out=PTR, sinks=PTR, T=I64, C=I64,
                      G=I64, D=I64, st=I64, sc=I64, nthreads=I64),
    "attend_indexed": _k(None, q=PTR, k=PTR, v=PTR, index=PTR, counts=PTR, n=I64, k_new=PTR,
                         v_new=PTR, out=PTR, sinks=PTR, C=I64, G=I64, D=I64, st=I64, sc=I64,
                         nthreads=I64),
    "attend_rows_q4": _k(None, q=PTR, kc=PTR, ks=PTR, km=PTR, vc=PTR, vs=PTR, vm=PTR,
                         bias=PTR, index=PTR, k_new=PTR, v_new=PTR, out=PTR, sinks=PTR,
                         T=I64, C=I64, G=I64, D=I64, cs0=I64, cs1=I64, ss0=I64, ss1=I64,
                         nthreads=I64),
    # pointwise.c
    "rms_norm_rows": _k(None, x=PTR, weight=PTR, y=PTR, rows=I64, n=I64, eps=F32,
                        nthreads=I64),
    "rotary_rows": _k(None, x=PTR, cos=PTR, sin=PTR, y=PTR, tokens=I64, heads=I64, d=I64,
                      nthreads=I64),
    # decode_layer.c: a whole decode layer from its argument block (kernels/layer_args.py)
    "decode_layer": _k(INT, a=PTR, mode=I64),
    "decode_layer_q4_ready": _k(INT),
    # decode_select.c: InfiniGen's part of that call, for the block's select_step slot
    # (called by address from decode_layer, never by Python itself)
    "dl_select_step": _k(INT, a=PTR, mode=I64),
}


def declare(lib: ctypes.CDLL) -> None:
    """Every table function's ``argtypes`` and ``restype`` on the loaded library (a name the
    library lacks raises AttributeError: the table and the sources disagree)."""
    for name, kernel in KERNELS.items():
        fn = getattr(lib, name)
        fn.argtypes = kernel.argtypes
        fn.restype = kernel.returns
