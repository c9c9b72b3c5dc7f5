"""Small CPU kernels compiled on first use, for the decode step on a CPU: attention over every
cached row or over chosen rows, read where the cache keeps them (``kernels/attention.c``; over
a 4-bit cache ``kernels/attention_q4.c``; their shared block in ``kernels/attention.h``),
and InfiniGen's speculation: packed speculation keys scored without unpacking them into
floats, and the default selection rule, fused with the scoring (``kernels/speculation.c``;
the mass rule itself in ``kernels/selection.c``, page-level speculation in
``kernels/pages.c``). The layers' own math (few-row linear layers over floats, 4-bit or
8-bit codes in ``kernels/linear.c``, the same with float16 scales in
``kernels/linear_h16.c``, RMSNorm and rotary embedding in
``kernels/pointwise.c``) is called through :mod:`.cpu_layers`.

They are plain C (no torch headers), built with the system's C compiler into
``$FLEXGEN_INFINIGEN_CACHE/kernels/<hash>.so`` (a few seconds, once per machine and source),
loaded with ``ctypes`` and handed raw tensor pointers. Without a compiler, or with
``FLEXGEN_INFINIGEN_KERNELS=0``, callers use their torch path (the same results to rounding;
each kernel is tested against it).
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

_FOLDER = Path(__file__).with_name("kernels")
_FILES = sorted(_FOLDER.glob("*.[ch]"))
_SOURCE = "".join(f.read_text() for f in _FILES)
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared"]
ENV = "FLEXGEN_INFINIGEN_KERNELS"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _machine() -> str:
    """What ``-march=native`` compiles for: the CPU's model and instruction-set flags. A cache
    folder shared by machines with different instruction sets (AVX-512 on one, AVX2 only on
    another) must never hand one machine's library to the other, where it would stop on an
    illegal instruction."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    lines = {line.split(":", 1)[0].strip(): line for line in text.splitlines()
             if line.split(":", 1)[0].strip() in wanted}
    return "\n".join(sorted(lines.values()))


def _build(folder: Path) -> Path | None:
    """The shared library for this source, these flags and this machine, compiled if missing."""
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + _machine()).encode()).hexdigest()[:16]
    lib = folder / f"cpu_kernels-{digest}.so"
    if lib.is_file():
        return lib
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".cpu_kernels-{digest}-{os.getpid()}.so"
    sources = [str(f) for f in _FILES if f.suffix == ".c"]
    try:
        subprocess.run([cc, *_FLAGS, "-I", str(_FOLDER), *sources, "-o", str(tmp), "-lm"],
                       check=True, capture_output=True, timeout=300)
        os.replace(tmp, lib)  # whole or not at all
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
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
        from ..config import default_cache_dir
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
        lib.score_packed.argtypes = [ptr] * 6 + [i64] * 7
        lib.score_packed.restype = None
        lib.speculate_mass.argtypes = [ptr] * 8 + [i64] * 9
        lib.speculate_mass.restype = None
        lib.spec_write.argtypes = [ptr] * 4 + [i64] * 7
        lib.spec_write.restype = None
        lib.speculate_pages.argtypes = [ptr] * 7 + [i64] * 9
        lib.speculate_pages.restype = None
        lib.linear_rows.argtypes = [ptr] * 4 + [i64] * 4
        lib.linear_rows.restype = None
        lib.linear_q4.argtypes = [ptr] * 6 + [i64] * 5
        lib.linear_q4.restype = ctypes.c_int
        lib.linear_q8.argtypes = [ptr] * 6 + [i64] * 5
        lib.linear_q8.restype = ctypes.c_int
        lib.linear_q4_h16.argtypes = [ptr] * 6 + [i64] * 5
        lib.linear_q4_h16.restype = ctypes.c_int
        lib.linear_q8_h16.argtypes = [ptr] * 6 + [i64] * 5
        lib.linear_q8_h16.restype = ctypes.c_int
        lib.moe_q4_h16.argtypes = [ptr, i64, i64] + [ptr] * 7 + [i64] * 4
        lib.moe_q4_h16.restype = ctypes.c_int
        lib.moe_layer_q4_h16.argtypes = [ptr, i64, ptr, ctypes.c_float, ptr] + [i64] * 3 \
            + [ptr] * 4 + [i64] * 4
        lib.moe_layer_q4_h16.restype = ctypes.c_int
        lib.h16_widen_rows.argtypes = [ptr] * 2 + [i64]
        lib.h16_widen_rows.restype = None
        lib.attend_rows.argtypes = [ptr] * 5 + [i64] * 7
        lib.attend_rows.restype = None
        lib.attend_indexed.argtypes = [ptr] * 5 + [i64] + [ptr] * 3 + [i64] * 6
        lib.attend_indexed.restype = None
        lib.attend_rows_q4.argtypes = [ptr] * 12 + [i64] * 9
        lib.attend_rows_q4.restype = None
        lib.select_mass.argtypes = [ptr] * 4 + [i64] * 6
        lib.select_mass.restype = None
        lib.rms_norm_rows.argtypes = [ptr] * 3 + [i64] * 2 + [ctypes.c_float, i64]
        lib.rms_norm_rows.restype = None
        lib.rotary_rows.argtypes = [ptr] * 4 + [i64] * 4
        lib.rotary_rows.restype = None
        lib.project_heads.argtypes = [ptr] * 3 + [i64] * 13
        lib.project_heads.restype = None
        _lib = lib
        return lib


def _packed_query(q: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``[C, G, W]`` in the kernels' slot-plane column order (column ``j * per + s``
    at ``s * P + j``), and their sums ``[C, G]``."""
    c, g, w = q.shape
    per = 8 // bits
    qsum = q.sum(-1).contiguous()
    return q.view(c, g, w // per, per).transpose(-1, -2).contiguous(), qsum


def _takes_packed(codes, scale, q, bits) -> bool:
    return (not codes.is_cuda and q.dtype == torch.float32 and scale.dtype == torch.float32
            and codes.is_contiguous() and q.shape[-1] == codes.shape[-1] * (8 // bits)
            and q.shape[-1] <= 256)


def score_packed(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, q: torch.Tensor,
                 bits: int, length: int) -> torch.Tensor | None:
    """Scores ``[C, G, length]`` of float32 queries ``q [C, G, W]`` against the first
    ``length`` rows of head-major packed codes ``[C, L, P]`` (float32 ``scale``/``lo``
    ``[C, L]``), or None when the kernel is unavailable or cannot take the inputs."""
    if not _takes_packed(codes, scale, q, bits):
        return None
    lib = library()
    if lib is None:
        return None
    c, big_l, p = codes.shape
    g = q.shape[1]
    q, qsum = _packed_query(q, bits)
    out = torch.empty(c, g, length, dtype=torch.float32)
    lib.score_packed(codes.data_ptr(), scale.data_ptr(), lo.data_ptr(), q.data_ptr(),
                     qsum.data_ptr(), out.data_ptr(), length, big_l, c, p, g, bits,
                     torch.get_num_threads())
    return out


def speculate_pages(lo: torch.Tensor, hi: torch.Tensor, q: torch.Tensor,
                    visible: torch.Tensor, caps: torch.Tensor, page: int, width: int):
    """The mass rule over page bounds (see ``kv/spec_pages.py``) in one pass per column:
    ``(order [C, width], counts [C])``, or None when the kernel cannot take the inputs.
    ``lo``/``hi``: ``[C, pages, W]`` float32; ``q``: ``[C, G, W]``; ``caps``: ``[b]``."""
    if (lo.is_cuda or lo.dtype != torch.float32 or not lo.is_contiguous()
            or not hi.is_contiguous() or width < 1):
        return None
    lib = library()
    if lib is None:
        return None
    c, max_pages, w = lo.shape
    b, t = visible.shape
    g = q.shape[1]
    q = q.float().contiguous()
    vis = visible.to(torch.uint8).contiguous()
    cap = caps.to(torch.int64).repeat_interleave(c // b).contiguous()
    order = torch.empty(c, width, dtype=torch.int64)
    counts = torch.empty(c, dtype=torch.int64)
    lib.speculate_pages(lo.data_ptr(), hi.data_ptr(), q.data_ptr(), vis.data_ptr(),
                        cap.data_ptr(), order.data_ptr(), counts.data_ptr(), t, max_pages, c,
                        c // b, w, g, page, width, torch.get_num_threads())
    return order, counts


def project_heads(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor | None:
    """``[b, n, KV, r]``: rows ``x [b, n, KV, d]`` (any strides, rows contiguous) times their
    KV head's ``projection [b, KV, d, r]`` (one shared by the batch: stride 0), float32 on a
    CPU, r a multiple of 8 up to 128; None when the kernel cannot take them. The result is
    stored KV-major (``[b, KV, n, r]`` transposed), as the rehearsal's query is wanted."""
    b, n, kv, d = x.shape
    r = projection.shape[-1]
    if (x.is_cuda or x.dtype != torch.float32 or projection.dtype != torch.float32
            or r % 8 or r > 128 or projection.shape != (b, kv, d, r) or x.stride(3) != 1
            or projection.stride()[1:] != (d * r, r, 1) or x.numel() == 0):
        return None
    lib = library()
    if lib is None:
        return None
    out = torch.empty(b, kv, n, r, dtype=torch.float32).transpose(1, 2)
    lib.project_heads(x.data_ptr(), projection.data_ptr(), out.data_ptr(), b, n, kv, d, r,
                      *x.stride()[:3], *out.stride()[:3], projection.stride(0),
                      torch.get_num_threads())
    return out


def spec_write(rows: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor,
               start: int, bits: int) -> bool:
    """Projected keys ``rows [n, C, W]`` packed into head-major ``codes [C, L, P]``,
    ``lo``/``scale`` ``[C, L]`` at rows ``start ..`` (as ``SpeculationKeys.write``'s torch
    path); False when the kernel cannot take them."""
    if (rows.is_cuda or lo.dtype != torch.float32 or not codes.is_contiguous()
            or not lo.is_contiguous() or not scale.is_contiguous()):
        return False
    lib = library()
    if lib is None:
        return False
    x = rows.float().contiguous()
    n, c, w = x.shape
    lib.spec_write(x.data_ptr(), codes.data_ptr(), lo.data_ptr(), scale.data_ptr(), n, start,
                   codes.shape[1], c, w, codes.shape[2], bits)
    return True


def speculate_mass(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor,
                   q: torch.Tensor, bits: int, visible: torch.Tensor, caps: torch.Tensor,
                   width: int) -> torch.Tensor | None:
    """Scoring and the ``mass`` rule in one pass per column (see :func:`score_packed` and
    :func:`select_mass`): ``order [C, width]`` for queries ``q [C, G, W]`` over the first
    ``T = visible.shape[1]`` rows, ``caps [b]`` tokens per KV head (or ``[C]``, one a
    column). None when the kernel is unavailable or cannot take the inputs."""
    if not _takes_packed(codes, scale, q, bits) or width < 1:
        return None
    lib = library()
    if lib is None:
        return None
    c, big_l, p = codes.shape
    b, t = visible.shape
    g = q.shape[1]
    q, qsum = _packed_query(q, bits)
    vis = visible.to(torch.uint8).contiguous()
    cap = caps.to(torch.int64)
    if cap.numel() != c:  # one cap a row: the same for each of its columns
        cap = cap.repeat_interleave(c // b)
    cap = cap.contiguous()
    order = torch.empty(c, width, dtype=torch.int64)
    lib.speculate_mass(codes.data_ptr(), scale.data_ptr(), lo.data_ptr(), q.data_ptr(),
                       qsum.data_ptr(), vis.data_ptr(), cap.data_ptr(), order.data_ptr(), t,
                       big_l, c, c // b, p, g, bits, width, torch.get_num_threads())
    return order


MIN_ATTEND_ROWS = 2048  # below this many cached tokens torch's two products are as fast
MAX_GROUP = 16  # query heads per KV head the kernel's score buffer holds


def _row_strides(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int] | None:
    """(token stride, column stride) in floats of caches ``[T, C, D]`` whose rows are
    contiguous (token-major, or head-major viewed as token-major), the same for K and V."""
    if k.stride() != v.stride() or k.stride(2) != 1:
        return None
    return k.stride(0), k.stride(1)


def attend_rows(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor | None:
    """Decode attention ``[C, G, D]`` of pre-scaled queries ``q [C, G, D]`` over the rows
    ``k_rows``/``v_rows`` ``[T, C, D]`` (token-major or a head-major cache's view; each row
    contiguous) with an additive ``bias`` ``[C, T]``; K and V are each read once. None when
    the kernel cannot take the inputs."""
    t, c, d = k_rows.shape
    g = q.shape[1]
    strides = _row_strides(k_rows, v_rows)
    if (q.is_cuda or q.dtype != torch.float32 or k_rows.dtype != torch.float32
            or v_rows.dtype != torch.float32 or g > MAX_GROUP or t < MIN_ATTEND_ROWS
            or d % 8 or d > 256 or strides is None):
        return None
    lib = library()
    if lib is None:
        return None
    q, bias = q.contiguous(), bias.float().contiguous()
    out = torch.empty(c, g, d, dtype=torch.float32)
    lib.attend_rows(q.data_ptr(), k_rows.data_ptr(), v_rows.data_ptr(), bias.data_ptr(),
                    out.data_ptr(), t, c, g, d, *strides, torch.get_num_threads())
    return out


def attend_rows_q4(q: torch.Tensor, k, v, bias: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor | None:
    """Decode attention ``[C, G, D]`` of pre-scaled ``q [C, G, D]`` over every row of a 4-bit
    cache (``k``/``v``: :class:`~.compression.Packed` parts ``[T, C, D / 64, ...]``, read
    where they are, token-major or head-major) with ``bias [C, T]``, then each column's new
    token ``k_new``/``v_new [C, D]`` (exact). With ``index [C, n]`` the rows are
    ``index[c]`` of column ``c`` (read in place; ``bias [C, n]``). None when the kernel
    cannot take the inputs."""
    c, g, d = q.shape
    codes, scale = k.codes, k.scale
    t = codes.shape[0] if index is None else index.shape[1]
    ok = (not q.is_cuda and q.dtype == torch.float32 and scale.dtype == torch.float32
          and d % 64 == 0 and d <= 256 and g <= MAX_GROUP and codes.shape[-1] == 32
          and all(a.stride() == b.stride() for a, b in zip(k.parts, v.parts))
          and codes.stride()[2:] == (32, 1) and scale.stride()[2:] == (1, 1)
          and k.minimum.stride() == scale.stride())
    lib = library() if ok else None
    if lib is None:
        return None
    q, bias = q.contiguous(), bias.float().contiguous()
    k_new, v_new = k_new.float().contiguous(), v_new.float().contiguous()
    out = torch.empty(c, g, d, dtype=torch.float32)
    if index is not None:
        index = index.to(torch.int64).contiguous()
    lib.attend_rows_q4(q.data_ptr(), codes.data_ptr(), scale.data_ptr(), k.minimum.data_ptr(),
                       v.codes.data_ptr(), v.scale.data_ptr(), v.minimum.data_ptr(),
                       bias.data_ptr(), None if index is None else index.data_ptr(),
                       k_new.data_ptr(), v_new.data_ptr(), out.data_ptr(), t,
                       c, g, d, codes.stride(0), codes.stride(1), scale.stride(0),
                       scale.stride(1), torch.get_num_threads())
    return out


def attend_indexed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                   counts: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor) -> torch.Tensor | None:
    """Decode attention ``[C, G, D]`` of pre-scaled ``q [C, G, D]`` over rows
    ``index[c, :counts[c]]`` of the caches ``k``/``v`` (``[T, C, D]``, token-major or a
    head-major cache's view, read where they are, nothing gathered) plus each column's new
    token ``k_new``/``v_new [C, D]``. None when the kernel cannot take the inputs."""
    c, g, d = q.shape
    strides = _row_strides(k, v)
    if (q.is_cuda or q.dtype != torch.float32 or k.dtype != torch.float32 or g > MAX_GROUP
            or d % 8 or d > 256 or strides is None):
        return None
    lib = library()
    if lib is None:
        return None
    index = index.reshape(c, -1).to(torch.int64).contiguous()
    counts = counts.reshape(c).to(torch.int64).contiguous()
    n = index.shape[1]
    q, k_new, v_new = (t.float().contiguous() for t in (q, k_new, v_new))
    out = torch.empty(c, g, d, dtype=torch.float32)
    lib.attend_indexed(q.data_ptr(), k.data_ptr(), v.data_ptr(), index.data_ptr(),
                       counts.data_ptr(), n, k_new.data_ptr(), v_new.data_ptr(), out.data_ptr(),
                       c, g, d, *strides, torch.get_num_threads())
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
    lib.select_mass(scores.data_ptr(), vis.data_ptr(), cap.data_ptr(), order.data_ptr(),
                    b * kv, kv, g, t, width, torch.get_num_threads())
    return order
