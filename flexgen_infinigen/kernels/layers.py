"""The per-token layer math of a decode step on a CPU, through the compiled kernels (see
:mod:`.cpu_kernels`): linear layers of a few rows in float32 or in packed 4 bits
(``kernels/c/linear.c``), RMSNorm and the rotary embedding (``kernels/c/pointwise.c``). Each
function gives what its torch expression gives, to float rounding (tested against it), or
hands the inputs back to torch: ``linear`` itself falls back; ``linear_q4``, ``rms_norm``
and ``rotary`` return None when the kernel cannot take them (a GPU tensor, another dtype, a
layout they do not read, no compiler).
"""
from __future__ import annotations

import ctypes

import torch

from ..memory.codes import Blocks, PackedWeight
from .cpu_kernels import invoke, library
from .gguf import linear_blocks


MAX_LINEAR_ROWS = 16  # above this many rows a BLAS matrix product is the better tool


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None):
    """``F.linear`` for the few rows of a decode step on a CPU in float32: each weight row is
    read once (BLAS reads these shapes at a third of the memory's bandwidth on some CPUs);
    a packed 4-bit weight (:class:`~..memory.codes.PackedWeight`, 4 or 8 bits) is multiplied as
    stored (:func:`linear_q4`), and a GGUF file's blocks too, at any number of rows
    (:func:`.gguf.linear_blocks`). Anything else, or without the kernels, goes to ``F.linear``."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if isinstance(weight, PackedWeight) and isinstance(weight.packed, Blocks):
        out = linear_blocks(x, weight, bias)  # a file's blocks: any number of rows
        return out if out is not None else torch.nn.functional.linear(
            x, weight.dense().to(device=x.device, dtype=x.dtype), bias)
    if isinstance(weight, PackedWeight):
        out = linear_q4(x, weight, bias) if 0 < rows <= MAX_LINEAR_ROWS else None
        return out if out is not None else torch.nn.functional.linear(x, weight.dense(), bias)
    if (x.is_cuda or x.dtype != torch.float32 or weight.dtype != torch.float32
            or not 0 < rows <= MAX_LINEAR_ROWS or not weight.is_contiguous()
            or (bias is not None and bias.dtype != torch.float32)):
        return torch.nn.functional.linear(x, weight, bias)
    if library() is None:
        return torch.nn.functional.linear(x, weight, bias)
    xs = x.reshape(rows, x.shape[-1]).contiguous()
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)
    b = bias.contiguous() if bias is not None else None
    invoke("linear_rows", x=xs.data_ptr(), w=weight.data_ptr(),
           bias=b.data_ptr() if b is not None else None, out=out.data_ptr(), M=rows,
           N=weight.shape[0], K=weight.shape[1], nthreads=torch.get_num_threads())
    return out


def linear_q4(x: torch.Tensor, weight, bias: torch.Tensor | None = None):
    """``x @ W.T (+ bias)`` for a packed weight read as stored (``kernels/c/linear.c``): 4-bit
    codes (groups of 64 or 32; x rounded to 16 bits per block of 64 for the integer
    products) or 8-bit codes (``linear_q8``: floats); scales and minima held as float16
    go to the same kernels' ``_h16`` forms (``kernels/c/linear_h16.c``), float32 ones to
    ``linear.c``. None when the kernel cannot take the inputs (4 bits with float32 scales
    without AVX2, not float32, a GPU)."""
    if not weight.kernel_ready or x.is_cuda or x.dtype != torch.float32 or (
            bias is not None and bias.dtype != torch.float32):
        return None
    if library() is None:
        return None
    p = weight.packed
    n, k = p.shape
    rows = x.numel() // k
    xs = x.reshape(rows, k).contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    b = bias.contiguous() if bias is not None else None
    if p.scale.dtype == torch.float16:
        kernel = "linear_q8_h16" if p.bits == 8 else "linear_q4_h16"
    else:
        kernel = "linear_q8" if p.bits == 8 else "linear_q4"
    done = invoke(kernel, x=xs.data_ptr(), codes=p.codes.data_ptr(), scale=p.scale.data_ptr(),
                  minimum=p.minimum.data_ptr(), bias=b.data_ptr() if b is not None else None,
                  out=out.data_ptr(), M=rows, N=n, K=k, group=p.group,
                  nthreads=torch.get_num_threads())
    return out if done else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, float32 on a CPU; one
    call instead of torch's seven small operations, each with its own dispatch and temporary."""
    if (x.is_cuda or x.dtype != torch.float32 or weight.dtype != torch.float32
            or weight.shape != x.shape[-1:] or not x.is_contiguous()
            or not weight.is_contiguous() or x.numel() == 0):
        return None
    if library() is None:
        return None
    n = x.shape[-1]
    out = torch.empty_like(x)
    invoke("rms_norm_rows", x=x.data_ptr(), weight=weight.data_ptr(), y=out.data_ptr(),
           rows=x.numel() // n, n=n, eps=eps, nthreads=torch.get_num_threads())
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor | None:
    """``x cos + (x2, x1) signed_sin`` for ``x [b, s, heads, d]`` and ``cos``/``signed_sin``
    ``[b, s, 1, d]`` (see ``models/llama.py``), float32 on a CPU, all contiguous."""
    if x.dim() != 4 or x.is_cuda or x.dtype != torch.float32:
        return None
    b, s, heads, d = x.shape
    if (d % 2 or cos.shape != (b, s, 1, d) or signed_sin.shape != cos.shape
            or cos.dtype != torch.float32 or signed_sin.dtype != torch.float32
            or not (x.is_contiguous() and cos.is_contiguous() and signed_sin.is_contiguous())):
        return None
    if library() is None:
        return None
    out = torch.empty_like(x)
    invoke("rotary_rows", x=x.data_ptr(), cos=cos.data_ptr(), sin=signed_sin.data_ptr(),
           y=out.data_ptr(), tokens=b * s, heads=heads, d=d, nthreads=torch.get_num_threads())
    return out


MOE_MAX_ROWS = 16  # tokens an expert may take in the experts call (kernels/c/moe_experts.c)


def expert_tables(mats: list, hidden: int):
    """(group, expert width, (codes, scales, minima)) for the experts kernels: three ctypes
    pointer tables over ``mats`` (gate, up and down of each expert, in turn), or None unless
    every matrix is 4-bit codes with float16 factors (``PackedWeight.expert_view``), gate and
    up ``[f, hidden]``, down ``[hidden, f]``, one group of 32 or 64 throughout, and both
    widths whole blocks of 64 (what ``kernels/c/moe_experts.c`` takes)."""
    views = [m.expert_view if isinstance(m, PackedWeight) else None for m in mats]
    if not views or len(views) % 3 or None in views:
        return None
    group, f, h = views[0][:3]
    if (h != hidden or group not in (32, 64) or h % 64 or f % 64
            or {v[:3] for v in views[0::3] + views[1::3]} != {(group, f, h)}
            or {v[:3] for v in views[2::3]} != {(group, h, f)}):
        return None
    n = len(views)
    return group, f, tuple((ctypes.c_void_p * n)(*(v[i] for v in views)) for i in (3, 4, 5))


def moe_experts(x: torch.Tensor, mats: list, first: list[int], tokens, weights
                ) -> torch.Tensor | None:
    """A decode step's routed experts in one compiled call (``kernels/c/moe_experts.c``):
    ``out[t] = sum_u weights * down_u(silu(gate_u x[t]) * up_u x[t])`` over the experts
    ``u`` of each token, added in the order of ``mats`` (gate, up and down of each expert,
    in turn), as the per-expert path adds them. Expert ``u`` takes the tokens
    ``tokens[first[u]:first[u + 1]]`` (ascending, at most ``MOE_MAX_ROWS``) with router
    weights ``weights`` at the same places (tensors or lists). ``x`` is ``[T, H]`` float32
    on a CPU. None when the call cannot take them (a matrix that is not 4-bit codes with
    float16 factors, mixed groups or shapes, too many tokens for an expert, no compiler):
    the caller multiplies expert by expert."""
    n = len(mats)
    if (x.is_cuda or x.dtype != torch.float32 or x.dim() != 2 or not n or n % 3
            or len(first) != n // 3 + 1):
        return None
    if any(not 0 < b - a <= MOE_MAX_ROWS for a, b in zip(first, first[1:])):
        return None
    tables = expert_tables(mats, x.shape[1])
    if tables is None or library() is None:
        return None
    group, f, (codes, scales, minima) = tables
    h = x.shape[1]
    starts = torch.tensor(first, dtype=torch.int64)
    tok = torch.as_tensor(tokens, dtype=torch.int64).contiguous()
    w = torch.as_tensor(weights, dtype=torch.float32).contiguous()
    xs = x.contiguous()
    out = torch.empty(x.shape[0], h, dtype=torch.float32)
    done = invoke("moe_q4_h16", x=xs.data_ptr(), T=x.shape[0], U=n // 3,
                  first=starts.data_ptr(), tok=tok.data_ptr(), wt=w.data_ptr(), codes=codes,
                  scales=scales, minima=minima, out=out.data_ptr(), H=h, F=f, group=group,
                  nthreads=torch.get_num_threads())
    return out if done else None
