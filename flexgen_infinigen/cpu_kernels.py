"""Small CPU kernels compiled on first use: packed speculation keys scored in place, and the
few-row linear layers of a decode step.

InfiniGen's quantized speculation keys are 4 (or 2) bit codes with a per-row minimum and
scale. Scoring them in torch means unpacking every code into a float buffer the size of the
keys and reading it back (about 830 bytes touched per token and KV head where the codes are
40). The kernel here expands a row's codes in registers and dots them with each query of the
group, so a step reads the codes once.

It is plain C (no torch headers), built with the system's C compiler into
``$FLEXGEN_INFINIGEN_CACHE/kernels/<hash>.so`` (about a second, once per machine and source),
loaded with ``ctypes`` and handed raw tensor pointers. Without a compiler, or with
``FLEXGEN_INFINIGEN_KERNELS=0``, callers use their torch path (same scores to rounding;
tested against it).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

_SOURCE = (Path(__file__).with_name("cpu_kernels.c")).read_text()
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared"]
ENV = "FLEXGEN_INFINIGEN_KERNELS"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _build(folder: Path) -> Path | None:
    """The shared library for this source and these flags, compiled if missing."""
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    lib = folder / f"cpu_kernels-{digest}.so"
    if lib.is_file():
        return lib
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / f".cpu_kernels-{digest}-{os.getpid()}.c"
    tmp = folder / f".cpu_kernels-{digest}-{os.getpid()}.so"
    try:
        src.write_text(_SOURCE)
        subprocess.run([cc, *_FLAGS, str(src), "-o", str(tmp), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, lib)  # whole or not at all
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        src.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no compiler, compilation failed, or switched off)."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get(ENV, "1") == "0":
            return None
        from .weights.embedded import default_cache_dir
        path = _build(default_cache_dir() / "kernels")
        if path is None:
            print("note: no C compiler for the speculation kernel; scoring packed keys in "
                  "torch (slower at long context)", file=sys.stderr)
            return None
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            print(f"note: the CPU kernels did not load ({e}); using torch", file=sys.stderr)
            return None
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.score_packed.argtypes = [ptr] * 6 + [i64] * 6
        lib.score_packed.restype = None
        lib.linear_rows.argtypes = [ptr] * 4 + [i64] * 4
        lib.linear_rows.restype = None
        lib.attend_rows.argtypes = [ptr] * 6 + [i64] * 5
        lib.attend_rows.restype = None
        lib.attend_indexed.argtypes = [ptr] * 5 + [i64] + [ptr] * 4 + [i64] * 4
        lib.attend_indexed.restype = None
        lib.select_mass.argtypes = [ptr] * 5 + [i64] * 6
        lib.select_mass.restype = None
        _lib = lib
        return lib


def score_packed(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, q: torch.Tensor,
                 bits: int) -> torch.Tensor | None:
    """Scores ``[C, G, T]`` of float32 queries ``q [C, G, W]`` against packed codes
    ``[T, C, P]`` (float32 ``scale``/``lo`` ``[T, C, 1]``), or None when the kernel is
    unavailable or the inputs are not what it takes (CPU, float32, contiguous)."""
    if codes.is_cuda or q.dtype != torch.float32 or scale.dtype != torch.float32:
        return None
    t, c, p = codes.shape
    g, w = q.shape[1], q.shape[2]
    if w != p * (8 // bits) or w > 256 or not codes.is_contiguous():
        return None
    lib = library()
    if lib is None:
        return None
    per = 8 // bits
    qsum = q.sum(-1).contiguous()
    # the query's columns in the kernel's slot-plane order: column j * per + s -> s * P + j
    q = q.view(c, g, p, per).transpose(-1, -2).contiguous()
    scale, lo = scale.contiguous(), lo.contiguous()
    out = torch.empty(c, g, t, dtype=torch.float32)
    lib.score_packed(codes.data_ptr(), scale.data_ptr(), lo.data_ptr(), q.data_ptr(),
                     qsum.data_ptr(), out.data_ptr(), t, c, p, g, bits,
                     torch.get_num_threads())
    return out


MAX_LINEAR_ROWS = 16  # above this many rows a BLAS matrix product is the better tool


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear`` for the few rows of a decode step on a CPU in float32: each weight row is
    read once (BLAS reads these shapes at a third of the memory's bandwidth on some CPUs);
    anything else, or without the kernel, goes to ``F.linear``."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if (x.is_cuda or x.dtype != torch.float32 or weight.dtype != torch.float32
            or not 0 < rows <= MAX_LINEAR_ROWS or not weight.is_contiguous()
            or (bias is not None and bias.dtype != torch.float32)):
        return torch.nn.functional.linear(x, weight, bias)
    lib = library()
    if lib is None:
        return torch.nn.functional.linear(x, weight, bias)
    xs = x.reshape(rows, x.shape[-1]).contiguous()
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)
    b = bias.contiguous() if bias is not None else None
    lib.linear_rows(xs.data_ptr(), weight.data_ptr(), b.data_ptr() if b is not None else None,
                    out.data_ptr(), rows, weight.shape[0], weight.shape[1],
                    torch.get_num_threads())
    return out


ATTEND_CHUNK = 512  # the kernel's CH
MIN_ATTEND_ROWS = 2048  # below this many cached tokens torch's two products are as fast
MAX_GROUP = 16  # query heads per KV head the kernel's score buffer holds


def attend_rows(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor | None:
    """Decode attention ``[C, G, D]`` of pre-scaled queries ``q [C, G, D]`` over token-major
    rows ``k_rows``/``v_rows`` ``[T, C, D]`` (rows contiguous) with an additive ``bias``
    ``[C, T]``; K and V are each read once. None when the kernel cannot take the inputs."""
    t, c, d = k_rows.shape
    g = q.shape[1]
    if (q.is_cuda or q.dtype != torch.float32 or k_rows.dtype != torch.float32
            or v_rows.dtype != torch.float32 or g > MAX_GROUP or t < MIN_ATTEND_ROWS
            or d % 8 or d > 256
            or k_rows.stride() != (c * d, d, 1) or v_rows.stride() != (c * d, d, 1)):
        return None
    lib = library()
    if lib is None:
        return None
    q, bias = q.contiguous(), bias.float().contiguous()
    out = torch.empty(c, g, d, dtype=torch.float32)
    chunks = -(-t // ATTEND_CHUNK)
    part = torch.empty(c * chunks * g * (d + 2), dtype=torch.float32)
    lib.attend_rows(q.data_ptr(), k_rows.data_ptr(), v_rows.data_ptr(), bias.data_ptr(),
                    out.data_ptr(), part.data_ptr(), t, c, g, d, torch.get_num_threads())
    return out


def attend_indexed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                   counts: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor) -> torch.Tensor | None:
    """Decode attention ``[C, G, D]`` of pre-scaled ``q [C, G, D]`` over rows
    ``index[c, :counts[c]]`` of the token-major caches ``k``/``v`` (``[T, C, D]``, read where
    they are, nothing gathered) plus each column's new token ``k_new``/``v_new [C, D]``.
    None when the kernel cannot take the inputs."""
    c, g, d = q.shape
    if (q.is_cuda or q.dtype != torch.float32 or k.dtype != torch.float32 or g > MAX_GROUP
            or d % 8 or d > 256 or k.stride()[1:] != (d, 1) or v.stride()[1:] != (d, 1)
            or k.stride(0) != c * d or v.stride(0) != c * d):
        return None
    lib = library()
    if lib is None:
        return None
    index = index.reshape(c, -1).to(torch.int64).contiguous()
    counts = counts.reshape(c).to(torch.int64).contiguous()
    n = index.shape[1]
    q, k_new, v_new = (t.float().contiguous() for t in (q, k_new, v_new))
    out = torch.empty(c, g, d, dtype=torch.float32)
    chunks = -(-(n + 1) // ATTEND_CHUNK)
    part = torch.empty(c * chunks * g * (d + 2), dtype=torch.float32)
    lib.attend_indexed(q.data_ptr(), k.data_ptr(), v.data_ptr(), index.data_ptr(),
                       counts.data_ptr(), n, k_new.data_ptr(), v_new.data_ptr(), out.data_ptr(),
                       part.data_ptr(), c, g, d, torch.get_num_threads())
    return out


def select_mass(scores: torch.Tensor, visible: torch.Tensor, caps: torch.Tensor,
                width: int) -> torch.Tensor | None:
    """The ``mass`` selection rule in one pass: ``order [b, KV, width]`` holding, for each KV
    head, the ``caps[b]`` visible tokens with the most softmax mass summed over its query
    heads (in token order; the rest of the row repeats them). ``scores [b, KV, G, T]``
    float32, ``visible [b, T]`` bool. None when the kernel cannot take the inputs."""
    b, kv, g, t = scores.shape
    if scores.is_cuda or scores.dtype != torch.float32 or width < 1:
        return None
    lib = library()
    if lib is None:
        return None
    scores = scores.contiguous()
    vis = visible.to(torch.uint8).contiguous()
    cap = caps.to(torch.int64).repeat_interleave(kv).contiguous()
    order = torch.empty(b, kv, width, dtype=torch.int64)
    work = torch.empty(2 * b * kv * t, dtype=torch.float32)
    lib.select_mass(scores.data_ptr(), vis.data_ptr(), cap.data_ptr(), order.data_ptr(),
                    work.data_ptr(), b * kv, kv, g, t, width, torch.get_num_threads())
    return order
