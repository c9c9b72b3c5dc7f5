"""Small CPU kernels compiled on first use, for the decode step on a CPU: attention over every
cached row or over chosen rows, read where the cache keeps them (``kernels/c/attention.c``; over
a 4-bit cache ``kernels/c/attention_q4.c``; their shared block in ``kernels/c/attention.h``),
and InfiniGen's speculation: packed speculation keys scored without unpacking them into
floats, and the default selection rule, fused with the scoring (``kernels/c/speculation.c``;
the mass rule itself in ``kernels/c/selection.c``, page-level speculation in
``kernels/c/pages.c``). The layers' own math (few-row linear layers over floats, 4-bit or
8-bit codes in ``kernels/c/linear.c``, the same with float16 scales in
``kernels/c/linear_h16.c``, RMSNorm and rotary embedding in
``kernels/c/pointwise.c``) is called through :mod:`flexgen_infinigen.kernels.layers`.

They are plain C (no torch headers), built with the system's C compiler into
``$FLEXGEN_INFINIGEN_CACHE/kernels/<hash>.so`` (a few seconds, once per machine and source),
loaded with ``ctypes`` and handed raw tensor pointers: every function's arguments are
declared from one table (:mod:`.table`, checked against the C prototypes by a test) and a call
names them (:func:`invoke`). Without a compiler, or with
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

from ..switches import CC, KERNELS
from .table import KERNELS as TABLE, declare

_FOLDER = Path(__file__).with_name("c")
_FILES = sorted(_FOLDER.glob("*.[ch]"))
_SOURCE = "".join(f.read_text() for f in _FILES)
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared"]
ENV = KERNELS.name
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
    cc = CC.get() or shutil.which("gcc") or shutil.which("cc")
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
        if not KERNELS.get():
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
        declare(lib)  # every function's arguments, from the table
        _lib = lib
        return lib


# each kernel's parameter names in the C prototype's order, and as a set to check a call's
_ORDER = {name: (k.names, frozenset(k.names)) for name, k in TABLE.items()}


def _loaded(name: str) -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"{name}: the CPU kernels are not available here")
    return lib


def invoke(name: str, /, **args):
    """Kernel ``name`` of the table (:mod:`.table`) called with its arguments by their C
    parameter names, passed in the prototype's order; what it returns. An unknown kernel, or
    a missing or unknown argument, is a TypeError naming it (nothing is called); the library
    must be loaded (the caller has checked :func:`library`)."""
    if name not in _ORDER:
        raise TypeError(f"no kernel {name!r} in the table (kernels/table.py)")
    order, known = _ORDER[name]
    if args.keys() != known:
        missing = [n for n in order if n not in args]
        unknown = [n for n in args if n not in known]
        raise TypeError(f"{name}(): " + "; ".join(
            ([f"missing argument(s) {', '.join(missing)}"] if missing else [])
            + ([f"unknown argument(s) {', '.join(unknown)}"] if unknown else [])))
    return getattr(_loaded(name), name)(*[args[n] for n in order])


def function_address(name: str) -> int:
    """The address of the library's exported function ``name`` (one of the table's), for a
    function-pointer slot of an argument block (``dl_args.select_step``)."""
    if name not in TABLE:
        raise TypeError(f"no kernel {name!r} in the table (kernels/table.py)")
    return ctypes.cast(getattr(_loaded(name), name), ctypes.c_void_p).value


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
    if library() is None:
        return None
    c, big_l, p = codes.shape
    g = q.shape[1]
    q, qsum = _packed_query(q, bits)
    out = torch.empty(c, g, length, dtype=torch.float32)
    invoke("score_packed", codes=codes.data_ptr(), scale=scale.data_ptr(), lo=lo.data_ptr(),
           q=q.data_ptr(), qsum=qsum.data_ptr(), out=out.data_ptr(), T=length, L=big_l, C=c,
           P=p, G=g, bits=bits, nthreads=torch.get_num_threads())
    return out


def speculate_pages(lo: torch.Tensor, hi: torch.Tensor, q: torch.Tensor,
                    visible: torch.Tensor, caps: torch.Tensor, page: int, width: int):
    """The mass rule over page bounds (see ``kv/infinigen/spec_pages.py``) in one pass per column:
    ``(order [C, width], counts [C])``, or None when the kernel cannot take the inputs.
    ``lo``/``hi``: ``[C, pages, W]`` float32; ``q``: ``[C, G, W]``; ``caps``: ``[b]``."""
    if (lo.is_cuda or lo.dtype != torch.float32 or not lo.is_contiguous()
            or not hi.is_contiguous() or width < 1):
        return None
    if library() is None:
        return None
    c, max_pages, w = lo.shape
    b, t = visible.shape
    g = q.shape[1]
    q = q.float().contiguous()
    vis = visible.to(torch.uint8).contiguous()
    cap = caps.to(torch.int64).repeat_interleave(c // b).contiguous()
    order = torch.empty(c, width, dtype=torch.int64)
    counts = torch.empty(c, dtype=torch.int64)
    invoke("speculate_pages", lo=lo.data_ptr(), hi=hi.data_ptr(), q=q.data_ptr(),
           visible=vis.data_ptr(), cap=cap.data_ptr(), order=order.data_ptr(),
           counts=counts.data_ptr(), T=t, NPmax=max_pages, C=c, KV=c // b, W=w, G=g, P=page,
           width=width, nthreads=torch.get_num_threads())
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
    if library() is None:
        return None
    out = torch.empty(b, kv, n, r, dtype=torch.float32).transpose(1, 2)
    (xsb, xsn, xsk), (osb, osn, osk) = x.stride()[:3], out.stride()[:3]
    invoke("project_heads", x=x.data_ptr(), P=projection.data_ptr(), out=out.data_ptr(), B=b,
           N=n, KV=kv, d=d, r=r, xsb=xsb, xsn=xsn, xsk=xsk, osb=osb, osn=osn, osk=osk,
           psb=projection.stride(0), nthreads=torch.get_num_threads())
    return out


def spec_write(rows: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor,
               start: int, bits: int) -> bool:
    """Projected keys ``rows [n, C, W]`` packed into head-major ``codes [C, L, P]``,
    ``lo``/``scale`` ``[C, L]`` at rows ``start ..`` (as ``SpeculationKeys.write``'s torch
    path); False when the kernel cannot take them."""
    if (rows.is_cuda or lo.dtype != torch.float32 or not codes.is_contiguous()
            or not lo.is_contiguous() or not scale.is_contiguous()):
        return False
    if library() is None:
        return False
    x = rows.float().contiguous()
    n, c, w = x.shape
    invoke("spec_write", x=x.data_ptr(), codes=codes.data_ptr(), lo=lo.data_ptr(),
           scale=scale.data_ptr(), n=n, start=start, L=codes.shape[1], C=c, W=w,
           P=codes.shape[2], bits=bits)
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
    if library() is None:
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
    invoke("speculate_mass", codes=codes.data_ptr(), scale=scale.data_ptr(), lo=lo.data_ptr(),
           q=q.data_ptr(), qsum=qsum.data_ptr(), visible=vis.data_ptr(), cap=cap.data_ptr(),
           order=order.data_ptr(), T=t, L=big_l, C=c, KV=c // b, P=p, G=g, bits=bits,
           width=width, nthreads=torch.get_num_threads())
    return order


MIN_ATTEND_ROWS = 2048  # below this many cached tokens torch's two products are as fast
MAX_GROUP = 16  # query heads per KV head the kernel's score buffer holds


def _row_strides(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int] | None:
    """(token stride, column stride) in floats of caches ``[T, C, D]`` whose rows are
    contiguous (token-major, or head-major viewed as token-major), the same for K and V."""
    if k.stride() != v.stride() or k.stride(2) != 1:
        return None
    return k.stride(0), k.stride(1)


def _sinks_ptr(sinks: torch.Tensor | None, c: int, g: int):
    """The sinks' pointer (None: no sinks); ``sinks``: ``[C * G]`` float32 on the CPU,
    contiguous (``attention.column_sinks``)."""
    if sinks is None:
        return None
    assert sinks.dtype == torch.float32 and sinks.numel() == c * g and sinks.is_contiguous()
    return sinks.data_ptr()


def attend_rows(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                bias: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """Decode attention ``[C, G, D]`` of pre-scaled queries ``q [C, G, D]`` over the rows
    ``k_rows``/``v_rows`` ``[T, C, D]`` (token-major or a head-major cache's view; each row
    contiguous) with an additive ``bias`` ``[C, T]``; K and V are each read once. ``sinks``
    ``[C * G]``: a logit per (column, head) in the normalizer (gpt-oss). None when the
    kernel cannot take the inputs."""
    t, c, d = k_rows.shape
    g = q.shape[1]
    strides = _row_strides(k_rows, v_rows)
    if (q.is_cuda or q.dtype != torch.float32 or k_rows.dtype != torch.float32
            or v_rows.dtype != torch.float32 or g > MAX_GROUP or t < MIN_ATTEND_ROWS
            or d % 8 or d > 256 or strides is None):
        return None
    if library() is None:
        return None
    q, bias = q.contiguous(), bias.float().contiguous()
    out = torch.empty(c, g, d, dtype=torch.float32)
    st, sc = strides
    invoke("attend_rows", q=q.data_ptr(), k=k_rows.data_ptr(), v=v_rows.data_ptr(),
           bias=bias.data_ptr(), out=out.data_ptr(), sinks=_sinks_ptr(sinks, c, g), T=t, C=c,
           G=g, D=d, st=st, sc=sc, nthreads=torch.get_num_threads())
    return out


def attend_rows_q4(q: torch.Tensor, k, v, bias: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor, index: torch.Tensor | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """Decode attention ``[C, G, D]`` of pre-scaled ``q [C, G, D]`` over every row of a 4-bit
    cache (``k``/``v``: :class:`~..memory.codes.Packed` parts ``[T, C, D / 64, ...]``, read
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
    if not ok or library() is None:
        return None
    q, bias = q.contiguous(), bias.float().contiguous()
    k_new, v_new = k_new.float().contiguous(), v_new.float().contiguous()
    out = torch.empty(c, g, d, dtype=torch.float32)
    if index is not None:
        index = index.to(torch.int64).contiguous()
    invoke("attend_rows_q4", q=q.data_ptr(), kc=codes.data_ptr(), ks=scale.data_ptr(),
           km=k.minimum.data_ptr(), vc=v.codes.data_ptr(), vs=v.scale.data_ptr(),
           vm=v.minimum.data_ptr(), bias=bias.data_ptr(),
           index=None if index is None else index.data_ptr(), k_new=k_new.data_ptr(),
           v_new=v_new.data_ptr(), out=out.data_ptr(), sinks=_sinks_ptr(sinks, c, g), T=t,
           C=c, G=g, D=d, cs0=codes.stride(0), cs1=codes.stride(1), ss0=scale.stride(0),
           ss1=scale.stride(1), nthreads=torch.get_num_threads())
    return out


def attend_indexed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                   counts: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                   sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """Decode attention ``[C, G, D]`` of pre-scaled ``q [C, G, D]`` over rows
    ``index[c, :counts[c]]`` of the caches ``k``/``v`` (``[T, C, D]``, token-major or a
    head-major cache's view, read where they are, nothing gathered) plus each column's new
    token ``k_new``/``v_new [C, D]``; ``sinks`` as :func:`attend_rows`'. None when the
    kernel cannot take the inputs."""
    c, g, d = q.shape
    strides = _row_strides(k, v)
    if (q.is_cuda or q.dtype != torch.float32 or k.dtype != torch.float32 or g > MAX_GROUP
            or d % 8 or d > 256 or strides is None):
        return None
    if library() is None:
        return None
    index = index.reshape(c, -1).to(torch.int64).contiguous()
    counts = counts.reshape(c).to(torch.int64).contiguous()
    n = index.shape[1]
    q, k_new, v_new = (t.float().contiguous() for t in (q, k_new, v_new))
    out = torch.empty(c, g, d, dtype=torch.float32)
    st, sc = strides
    invoke("attend_indexed", q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(),
           index=index.data_ptr(), counts=counts.data_ptr(), n=n, k_new=k_new.data_ptr(),
           v_new=v_new.data_ptr(), out=out.data_ptr(), sinks=_sinks_ptr(sinks, c, g), C=c,
           G=g, D=d, st=st, sc=sc, nthreads=torch.get_num_threads())
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
    if library() is None:
        return None
    scores = scores.contiguous()
    vis = visible.to(torch.uint8).contiguous()
    cap = caps.to(torch.int64).repeat_interleave(kv).contiguous()
    order = torch.empty(b, kv, width, dtype=torch.int64)
    invoke("select_mass", scores=scores.data_ptr(), visible=vis.data_ptr(),
           cap=cap.data_ptr(), order=order.data_ptr(), C=b * kv, KV=kv, G=g, T=t, width=width,
           nthreads=torch.get_num_threads())
    return order
