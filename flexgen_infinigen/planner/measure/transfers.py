"""Copies between tiers, through :class:`~flexgen_infinigen.tiers.Tiers` as the engine makes
them: host<->device links by copy size, the disk (cold reads, writes) and page-cache reads."""
from __future__ import annotations

import os
import time

import torch

from ...memory.tiers import DEVICE, DISK, HOST, Tiers
from .timing import MAX_PARTS, RATE_SIZES, timed

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
    """Ask the kernel to forget a file's cached pages (after writing them back)."""
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


DISK_SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]


def disk_bandwidths(dev: torch.device, offload_dir: str | None, nbytes: int) -> dict:
    """Write a file in the disk tier's folder and read it back cold, the way the engine
    does (``pwrite``; ``preadv`` in large requests), by read size: with O_DIRECT where the
    folder's filesystem allows it (``disk_read``), and through the page cache
    (``disk_buffered_read``). Reads land in host memory; the copy on is the host link's."""
    out = {"rates": {}}
    for direct, name in ((True, "disk_read"), (False, "disk_buffered_read")):
        tiers = Tiers(dev, offload_dir, direct_io=direct)
        try:
            n = nbytes // 4
            disk = tiers.empty(DISK, (n,), torch.float32)
            path = tiers.disk.locate(disk)[0].path
            start = time.perf_counter()
            tiers.write(disk, DISK, torch.randn(n), "kv_cache", src_tier=HOST)
            _sync_file(path)
            if direct:
                out["disk_write_bw"] = nbytes / (time.perf_counter() - start)
            table = {}
            for size in [s for s in DISK_SIZES if s <= nbytes]:
                step = size // 4
                parts = [disk[i:i + step] for i in range(0, n - step + 1, step)]
                if not _drop_page_cache(path):
                    break
                start = time.perf_counter()
                for part in parts:
                    tiers.to_host(part, DISK, "weights")
                table[size] = len(parts) * size / (time.perf_counter() - start)
            if table:
                out["rates"][name] = table
        finally:
            tiers.close()
    cold = out["rates"].get("disk_read") or out["rates"].get("disk_buffered_read") or {0: 0.0}
    out["disk_read_bw"] = max(cold.values())
    return out


def _sync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def page_cache_rates(dev: torch.device, offload_dir: str | None, ws: int) -> dict[int, float]:
    """Reads of disk-tier data that is still in the page cache (an offloaded file smaller
    than free memory), by read size, through the engine's buffered disk path."""
    tiers = Tiers(dev, offload_dir, direct_io=False)
    try:
        n = ws // 4
        disk = tiers.empty(DISK, (n,), torch.float32)
        tiers.write(disk, DISK, torch.randn(n), "kv_cache", src_tier=HOST)
        out = {}
        for size in RATE_SIZES:
            step = size // 4
            parts = [disk[i:i + step] for i in range(0, n - step + 1, step)][:MAX_PARTS]
            out[size] = len(parts) * size / timed(
                lambda ps=parts: _each(tiers.to_host, ps, DISK), dev, repeat=3)
        return out
    finally:
        tiers.close()
