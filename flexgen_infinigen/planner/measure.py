"""Measuring this machine for the cost model, through the runtime's own code paths.

Copies go through :class:`~flexgen_infinigen.tiers.Tiers` exactly as the engine makes
them, attention through :func:`~flexgen_infinigen.attention.attend`, and the per-layer
overhead is the decode step time of a tiny model run by the real engine, so the
profile measures what the runtime will see rather than what a microbenchmark could
reach.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..attention import attend
from ..compression import compress, decompress
from ..tiers import DEVICE, DISK, HOST, Tiers
from .hardware import HardwareProfile
from .overheads import engine_overheads

MATMUL_ROWS = [1, 4, 16, 64, 256, 1024, 4096]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, repeat: int = 5, warmup: int = 2) -> float:
    """Fastest wall time of ``fn()`` in seconds: on a shared machine the fastest run is the
    one least disturbed by other processes."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - start)
    return min(times)


LINK_CHUNKS = [64 << 10, 1 << 20, 4 << 20, 32 << 20, 256 << 20]


def link_bandwidths(dev: torch.device, nbytes: int) -> dict:
    """Host<->device rates by transfer size, copying chunks the way the engine does.

    Size matters on both kinds of machine: small copies pay a fixed latency on a GPU,
    and on a CPU large fresh buffers pay page faults that small, reused ones do not.
    """
    out: dict = {"h2d_bw_by_size": {}, "d2h_bw_by_size": {}}
    for pinned in (True, False):
        tiers = Tiers(dev, pin_host=pinned)
        suffix = "" if pinned else "_pageable"
        for chunk in (LINK_CHUNKS if pinned else LINK_CHUNKS[-1:]):
            count = max(1, min(MAX_PARTS, nbytes // chunk))
            host = [tiers.empty(HOST, (chunk // 4,), torch.float32).normal_()
                    for _ in range(count)]
            on_dev = [tiers.empty(DEVICE, (chunk // 4,), torch.float32).normal_()
                      for _ in range(count)]
            moved = chunk * count
            # each copy is dropped before the next, as a stage's weights are after use
            h2d = moved / timed(lambda t=tiers, hs=host: _each(t.to_compute, hs, HOST), dev)
            d2h = moved / timed(lambda t=tiers, ds=on_dev: _each(t.to_host, ds, DEVICE), dev)
            if pinned:
                out["h2d_bw_by_size"][chunk], out["d2h_bw_by_size"][chunk] = h2d, d2h
            if chunk == LINK_CHUNKS[-1]:
                out["h2d_bw" + suffix], out["d2h_bw" + suffix] = h2d, d2h
            del host, on_dev
    return out


def _each(copy, tensors, tier) -> None:
    for t in tensors:
        copy(t, tier, "weights")


def _drop_page_cache(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)


def disk_bandwidths(dev: torch.device, offload_dir: str | None, nbytes: int) -> dict[str, float]:
    """Write and read a file in the disk tier's folder the way the engine does (memmap).

    Reads are timed into host memory only; the copy on to the device is the host link's.
    A cold read maps the file afresh after asking the kernel to drop its cached pages.
    """
    tiers = Tiers(dev, offload_dir)
    try:
        n = nbytes // 4
        src = torch.randn(n)
        disk = tiers.empty(DISK, (n,), torch.float32)
        path = str(next(Path(tiers.disk_dir).iterdir()))
        start = time.perf_counter()
        tiers.write(disk, DISK, src, "kv_cache", src_tier=HOST)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        write_bw = nbytes / (time.perf_counter() - start)
        warm = timed(lambda d=disk: tiers.to_host(d, DISK, "kv_cache"), dev)
        del disk
        cold = []
        for _ in range(2):
            if not _drop_page_cache(path):
                break
            mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c", shape=(n,)))
            start = time.perf_counter()
            tiers.to_host(mapped, DISK, "kv_cache")
            cold.append(time.perf_counter() - start)
            del mapped
        return {"disk_write_bw": write_bw,
                "disk_read_bw": nbytes / min(cold) if cold else nbytes / warm}
    finally:
        tiers.close()


def matmul_table(dev: torch.device, dtype: torch.dtype, size: int,
                 working_set: int) -> dict[int, float]:
    """Achieved flop/s by rows m, cycling through enough weight matrices that they stream
    from memory as a model's weights do (one matrix would sit in the CPU's cache)."""
    item = torch.tensor([], dtype=dtype).element_size()
    count = max(1, working_set // (size * size * item))
    ws = [torch.randn(size, size, device=dev).to(dtype) for _ in range(count)]
    table = {}
    for m in MATMUL_ROWS:
        x = torch.randn(m, size, device=dev).to(dtype)
        reps = max(1, min(count, int(4e9 / (2 * m * size * size))))
        t = timed(lambda x=x, r=reps: _run_each([(lambda w=w: x @ w, 0) for w in ws[:r]]), dev,
                  repeat=3) / reps
        table[m] = 2 * m * size * size / t
    return table


RATE_SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
MAX_PARTS = 2048


def _run_each(cases) -> None:
    """Call each case, dropping its result before the next (as the runtime frees a
    temporary after use; keeping them all would time fresh memory instead)."""
    for call, _ in cases:
        call()


def _table(fn, dev: torch.device, working_set: int, sizes=RATE_SIZES) -> dict[int, float]:
    """{size: bytes/s} where ``fn(size)`` returns (callable, bytes it handles).

    Each size cycles through independent cases covering ``working_set`` bytes, so data
    comes from memory rather than from a cache, as it does in a real run.
    """
    out = {}
    for size in sizes:
        cases = [fn(size) for _ in range(max(1, min(MAX_PARTS, working_set // size)))]
        handled = sum(n for _, n in cases)
        out[size] = handled / timed(lambda c=cases: _run_each(c), dev, repeat=3)
        del cases
    return out


def attention_rates(dev: torch.device, dtype: torch.dtype, ws: int) -> dict[int, float]:
    """Decode attention (one query per sequence) through the runtime's own ``attend``."""
    item = torch.tensor([], dtype=dtype).element_size()
    b, kv, group, d = 4, 4, 2, 64

    def case(size):
        t = max(1, size // (2 * b * kv * d * item))
        q = torch.randn(b, 1, kv * group, d, device=dev).to(dtype)
        k = torch.randn(b, t, kv, d, device=dev).to(dtype)
        v = torch.randn_like(k)
        bias = torch.zeros(b, 1, 1, t, device=dev, dtype=dtype)
        return (lambda: attend(q, k, v, bias)), 2 * k.numel() * item

    return _table(case, dev, ws)


def prefill_attention_rates(dev: torch.device, dtype: torch.dtype, ws: int) -> dict[int, float]:
    """Prompt attention (scores, mask, softmax, weighted sum) through ``attend``, by the bytes
    of its float32 scores."""
    from ..attention import mask_bias

    b, heads, d = 2, 8, 64

    def case(size):
        p = max(8, int((size / (4 * b * heads)) ** 0.5))
        q, k, v = (torch.randn(b, p, heads, d, device=dev).to(dtype) for _ in range(3))
        bias = mask_bias(torch.ones(b, p, dtype=torch.bool, device=dev), p, dtype)
        return (lambda: attend(q, k, v, bias)), 4 * b * heads * p * p

    return _table(case, dev, ws)


def dequant_rates(dev: torch.device, dtype: torch.dtype, ws: int) -> dict[int, float]:
    def case(size):
        x = torch.randn(max(1, size // (4 * 1024)), 1024, device=dev).to(dtype)
        packed = compress(x)
        return (lambda: decompress(packed)), x.numel() * x.element_size()

    return _table(case, dev, ws)


def device_copy_rates(dev: torch.device, ws: int) -> dict[int, float]:
    """Joining two segments of a tensor split across tiers (what a split read costs)."""
    def case(size):
        half = torch.randn(max(1, size // 8), device=dev)
        return (lambda: torch.cat([half, half])), 2 * half.numel() * 4

    return _table(case, dev, ws)


def host_gather_rates(ws: int) -> dict[int, float]:
    """A row gather on the host, as a selective KV fetch does before the link."""
    def case(size):
        rows = max(2, size // (4 * 256))
        src = torch.randn(rows, 256)
        index = torch.randperm(rows)[: rows // 2, None].expand(-1, 256).contiguous()
        out = torch.empty(index.shape)
        return (lambda: torch.gather(src, 0, index, out=out)), 2 * out.numel() * 4

    return _table(case, torch.device("cpu"), ws)


def page_cache_rates(dev: torch.device, offload_dir: str | None, ws: int) -> dict[int, float]:
    """Reads of disk-tier data that is still in the page cache (an offloaded file smaller
    than free memory), by read size, through the engine's disk path."""
    tiers = Tiers(dev, offload_dir)
    try:
        n = ws // 4
        disk = tiers.empty(DISK, (n,), torch.float32)
        disk.copy_(torch.randn(n))
        out = {}
        for size in RATE_SIZES:
            step = size // 4
            parts = [disk[i:i + step] for i in range(0, n - step + 1, step)][:MAX_PARTS]
            out[size] = len(parts) * size / timed(
                lambda ps=parts: _each(tiers.to_host, ps, DISK), dev, repeat=3)
        return out
    finally:
        tiers.close()


def op_overhead(dev: torch.device) -> float:
    x = torch.randn(4, 64, device=dev)
    return timed(lambda: [x.add(1.0) for _ in range(200)], dev) / 200


def memory(dev: torch.device, offload_dir: str | None) -> dict[str, float]:
    from ..memory_plan import available
    have = available(dev, offload_dir)
    return {"gpu_mem": float(have["device"]), "cpu_mem": float(have["host"]),
            "disk_mem": float(have["disk"])}


def measure(dev: torch.device, offload_dir: str | None = None, quick: bool = False,
            progress: bool = True) -> HardwareProfile:
    cuda = dev.type == "cuda"
    dtype = torch.float16 if cuda else torch.float32
    # bytes each test cycles through: more than a CPU's last-level cache or a GPU's L2
    size = 256 << 20 if quick else 768 << 20
    cpu = torch.device("cpu")
    got: dict = {"rates": {}}

    def rates(**tables):
        got["rates"].update(tables)
        return {}

    steps = [
        ("memory", lambda: memory(dev, offload_dir)),
        ("links", lambda: link_bandwidths(dev, size)),
        ("disk", lambda: disk_bandwidths(dev, offload_dir, size)),
        ("matmul", lambda: {"matmul_flops": matmul_table(dev, dtype, 8192 if cuda else 2048,
                                                         size)}),
        ("cpu matmul", lambda: {"cpu_matmul_flops": matmul_table(cpu, torch.float32, 2048,
                                                                 size)}),
        ("attention", lambda: rates(attention=attention_rates(dev, dtype, size),
                                    prefill_attention=prefill_attention_rates(dev, dtype, size),
                                    cpu_attention=attention_rates(cpu, torch.float32, size))),
        ("copies", lambda: rates(device_copy=device_copy_rates(dev, size),
                                 host_gather=host_gather_rates(size),
                                 dequant=dequant_rates(dev, dtype, size))),
        ("page cache", lambda: rates(page_cache_read=page_cache_rates(dev, offload_dir, size))),
        ("engine overheads", lambda: {"overhead_s": engine_overheads(dev, dtype)}),
        ("operator overhead", lambda: {"op_overhead_s": op_overhead(dev)}),
    ]
    for _, fn in tqdm(steps, desc="profiling", unit="test", disable=not progress):
        got.update(fn())
    got["rates"]["h2d"] = got.pop("h2d_bw_by_size")
    got["rates"]["d2h"] = got.pop("d2h_bw_by_size")
    got.pop("h2d_bw"), got.pop("d2h_bw")
    name = torch.cuda.get_device_name(dev) if cuda else (platform.processor() or "cpu")
    return HardwareProfile(
        name="measured", device=f"{name} ({os.cpu_count()} CPU cores)" if not cuda else name,
        dtype_bytes=2 if cuda else 4, shared_memory=not cuda, copies_overlap_compute=cuda,
        source=f"measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}"
               + (" (quick)" if quick else ""), **got)


def cache_path() -> Path:
    from ..weights.embedded import default_cache_dir
    return default_cache_dir() / "hw.json"


def cached_profile(progress: bool = True) -> HardwareProfile:
    """This machine's saved profile, measured (quick) and saved first if there is none."""
    from ..loading import resolve_device

    path = cache_path()
    if path.exists():
        try:
            with open(path) as f:
                return HardwareProfile.from_dict(json.load(f))
        except (OSError, ValueError):
            pass  # unreadable or from an older version: measure again
    prof = measure(resolve_device("auto"), quick=True, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp")
    with tmp:
        json.dump(prof.to_dict(), tmp, indent=1)
    shutil.move(tmp.name, path)
    return prof
