"""The machine a benchmark runs on, and how busy other processes keep it while it measures.

Shared by throughput.py and cost_model.py: ``machine_info`` for the JSON's ``machine``
entry, ``repeat_until_quiet`` to repeat a measurement until no other process disturbed it.
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import Callable

import torch

import flexgen_infinigen


from artifacts import cpu_name  # noqa: E402,F401 - re-exported: older scripts import it here


def machine_info() -> dict:
    import transformers
    cuda = torch.cuda.is_available()
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "flexgen_infinigen_version": flexgen_infinigen.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": "cuda" if cuda else "cpu",
        "device_name": torch.cuda.get_device_name(0) if cuda else cpu_name(),
        # PASSIVE makes every parallel region wake sleeping threads: it halves a decode
        # step's rate here (and llama.cpp's, built with OpenMP), so each result says it
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }


class CpuMeter:
    """Share of the machine's CPU time used by *other* processes while a measurement ran.

    The benchmark shares the machine with whatever else runs; on 2 cores a busy neighbour
    slows torch's threads down by several times, so every row records how busy it was.
    """

    def __init__(self):
        self.wall, self.busy, self.own = time.perf_counter(), self._busy(), self._own()

    @staticmethod
    def _busy() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def others(self) -> float | None:
        """Fraction (0..1) of all cores' time that other processes used since construction."""
        busy = self._busy()
        if busy is None or self.busy is None:
            return None
        wall = time.perf_counter() - self.wall
        other = (busy - self.busy) - (self._own() - self.own)
        return max(0.0, other / max(wall * (os.cpu_count() or 1), 1e-9))


@dataclass
class Retry:
    """How hard to try for measurements that no other process disturbed."""

    repeats: int  # measured runs per configuration (the fastest is reported)
    max_others: float = 0.10  # a run is "quiet" when others used at most this CPU share
    extra: int = 2  # more runs when none of the first ``repeats`` was quiet
    pause_s: float = 5.0  # wait before each extra run, for the neighbour to finish


def repeat_until_quiet(fn: Callable[[], dict], retry: Retry) -> tuple[list[dict], list[dict]]:
    """Call ``fn()`` (which returns a dict) ``retry.repeats`` times, and up to ``retry.extra``
    more times while no run was quiet. Returns (all runs, the quiet ones or else all)."""
    runs: list[dict] = []
    while True:
        meter = CpuMeter()
        run = fn()
        run["other_processes_cpu"] = others = meter.others()
        run["quiet"] = others is None or others <= retry.max_others
        runs.append(run)
        quiet = [r for r in runs if r["quiet"]]
        if len(runs) >= retry.repeats and (quiet or len(runs) >= retry.repeats + retry.extra):
            return runs, quiet or runs
        if len(runs) >= retry.repeats:
            time.sleep(retry.pause_s)
