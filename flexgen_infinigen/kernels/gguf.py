"""Linear layers over a GGUF file's blocks as stored (:class:`~..memory.codes.Blocks`):
``kernels/c/gguf_dot.c`` quantizes the rows of x to 8 bits per block (one scale per 32 values
for the plain types, per 256 for the K-quants) and takes integer dot products with the
weight's codes, one float product per block; a few rows of x (a decode step) read each weight
row once, many (a prefill) meet each weight row in tiles while a chunk of x stays in cache.
The result differs from ``x @ dequantize(W).T`` by the rounding of x to 8 bits (tested
against ``gguf.quants.dequantize``), as llama.cpp's CPU products do.

Each type is multiplied on AVX-512 or AVX2 where the compiler targets them (the library is
built for the machine it runs on), else by a portable loop over the same integers.
"""
from __future__ import annotations

import ctypes

import torch

from ..memory.codes import BLOCK_FORMS, Blocks, PackedWeight
from .cpu_kernels import invoke, library

# ggml's numbers for the types (gguf_dot.h's GT_* values)
TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
            "Q6_K": 14, "MXFP4": 39}
assert set(TYPE_IDS) == set(BLOCK_FORMS)


def takes(weight) -> bool:
    """Whether ``weight`` is a file's blocks that the kernels multiply where they lie."""
    return (isinstance(weight, PackedWeight) and isinstance(weight.packed, Blocks)
            and weight.kernel_ready and library() is not None)


def linear_blocks(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None
                  ) -> torch.Tensor | None:
    """``x @ W.T (+ bias)`` for any number of rows of x (float32, CPU) and W a file's blocks;
    None when the kernels cannot take it (then the caller expands W)."""
    if not takes(weight) or x.is_cuda or x.dtype != torch.float32 or (
            bias is not None and (bias.dtype != torch.float32 or bias.is_cuda)):
        return None
    b: Blocks = weight.packed
    n, k = b.shape
    rows = x.numel() // k if k else 0
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    if rows == 0:
        return out
    xs = x.reshape(rows, k).contiguous()
    bias = bias.contiguous() if bias is not None else None
    done = invoke("gguf_linear", type=TYPE_IDS[b.kind], w=b.raw.data_ptr(),
                  order=b.order.data_ptr() if b.order is not None else None,
                  x=xs.data_ptr(), bias=bias.data_ptr() if bias is not None else None,
                  out=out.data_ptr(), M=rows, N=n, K=k, nthreads=torch.get_num_threads())
    return out if done else None


MOE_BLOCK_ROWS = 16  # tokens an expert may take in moe_blocks (kernels/c/moe_blocks.c)


def moe_blocks(x: torch.Tensor, mats: list, first: list[int], tokens, weights
               ) -> torch.Tensor | None:
    """A decode step's routed experts over a file's blocks in one compiled call
    (``kernels/c/moe_blocks.c``): ``out[t] = sum_u weights * down_u(silu(gate_u x[t]) *
    up_u x[t])``, each product as :func:`linear_blocks` gives it, added in the order of
    ``mats`` (gate, up and down of each expert, in turn) as the per-expert path adds them;
    expert ``u`` takes the tokens ``tokens[first[u]:first[u + 1]]`` with router weights
    ``weights`` at the same places. None when the call cannot take them (a matrix that is
    not blocks the kernels take as they lie, gate and up of different types, more than
    :data:`MOE_BLOCK_ROWS` tokens for an expert): the caller multiplies expert by expert."""
    n, h = len(mats), x.shape[-1]
    if (x.is_cuda or x.dtype != torch.float32 or x.dim() != 2 or not n or n % 3
            or len(first) != n // 3 + 1 or library() is None
            or any(not 0 < b - a <= MOE_BLOCK_ROWS for a, b in zip(first, first[1:]))):
        return None
    blocks = [m.packed for m in mats if takes(m) and m.packed.order is None]
    if len(blocks) != n:
        return None
    f = blocks[0].shape[0]
    if any(b.shape != ((f, h) if i % 3 < 2 else (h, f)) for i, b in enumerate(blocks)):
        return None
    table = (ctypes.c_void_p * n)(*(b.raw.data_ptr() for b in blocks))
    types = torch.tensor([TYPE_IDS[b.kind] for b in blocks], dtype=torch.int64)
    starts = torch.tensor(first, dtype=torch.int64)
    tok = torch.as_tensor(tokens, dtype=torch.int64).contiguous()
    w = torch.as_tensor(weights, dtype=torch.float32).contiguous()
    xs = x.contiguous()
    out = torch.empty(x.shape[0], h, dtype=torch.float32)
    done = invoke("moe_gguf", x=xs.data_ptr(), T=x.shape[0], U=n // 3, first=starts.data_ptr(),
                  tok=tok.data_ptr(), wt=w.data_ptr(), w=table, types=types.data_ptr(),
                  out=out.data_ptr(), H=h, F=f, nthreads=torch.get_num_threads())
    return out if done else None


def dequantize_rows(blocks: Blocks, ids: torch.Tensor) -> torch.Tensor | None:
    """Output rows ``ids`` of ``blocks`` as float32 (an embedding lookup) by the kernels'
    expansion of the format; None without the kernels."""
    if library() is None or blocks.raw.is_cuda or not blocks.raw.is_contiguous():
        return None
    flat = blocks.stored_rows(ids.reshape(-1).cpu()).long().contiguous()
    k = blocks.shape[-1]
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    done = invoke("gguf_dequantize_rows", type=TYPE_IDS[blocks.kind], w=blocks.raw.data_ptr(),
                  rows=flat.data_ptr(), n=flat.numel(), K=k, out=out.data_ptr(),
                  nthreads=torch.get_num_threads())
    return out.view(*ids.shape, k) if done else None
