"""Timing helpers every measurement shares: the fastest of repeated runs, rate tables by size."""
from __future__ import annotations

import time

import torch

# operation sizes a rate table is measured at, and the most independent cases per size
RATE_SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
MAX_PARTS = 2048


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, repeat: int = 5, warmup: int = 2) -> float:
    """Fastest wall time of ``fn()`` in seconds: on a shared machine the fastest run is the
    one least disturbed by other processes."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - start)
    return min(times)


def run_each(cases) -> None:
    """Call each case, dropping its result before the next (as the runtime frees a
    temporary after use; keeping them all would time fresh memory instead)."""
    for call, _ in cases:
        call()


def rate_table(fn, dev: torch.device, working_set: int, sizes=RATE_SIZES) -> dict[int, float]:
    """{size: bytes/s} where ``fn(size)`` returns (callable, bytes it handles).

    Each size cycles through independent cases covering ``working_set`` bytes, so data
    comes from memory rather than from a cache, as it does in a real run.
    """
    out = {}
    for size in sizes:
        cases = [fn(size) for _ in range(max(1, min(MAX_PARTS, working_set // size)))]
        handled = sum(n for _, n in cases)
        out[size] = handled / timed(lambda c=cases: run_each(c), dev, repeat=3)
        del cases
    return out
