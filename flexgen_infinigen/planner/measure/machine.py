"""The whole measurement: every test in turn, assembled into a :class:`HardwareProfile`."""
from __future__ import annotations

import os
import platform
import time

import torch
from tqdm.auto import tqdm

from ..hardware import HardwareProfile
from .compute import (
    attention_rates,
    dequant_rates,
    device_copy_rates,
    host_gather_rates,
    matmul_table,
    op_overhead,
    prefill_attention_rates,
)
from .overheads import engine_overheads
from .transfers import disk_bandwidths, link_bandwidths, page_cache_rates


def memory(dev: torch.device, offload_dir: str | None) -> dict[str, float]:
    """Bytes the runtime may use on each tier now."""
    from ...engine.memory_plan import available
    have = available(dev, offload_dir)
    return {"gpu_mem": float(have["device"]), "cpu_mem": float(have["host"]),
            "disk_mem": float(have["disk"])}


def measure_hardware(dev: torch.device, offload_dir: str | None = None, quick: bool = False,
                     progress: bool = True) -> HardwareProfile:
    """Measure this machine computing on ``dev`` (disk: the ``offload_dir`` folder's)."""
    cuda = dev.type == "cuda"
    dtype = torch.float16 if cuda else torch.float32
    # bytes each test cycles through: more than a CPU's last-level cache or a GPU's L2
    size = 256 << 20 if quick else 768 << 20
    cpu = torch.device("cpu")
    got: dict = {"rates": {}}

    def rates(**tables):
        got["rates"].update(tables)
        return {}

    def disk() -> dict:
        found = disk_bandwidths(dev, offload_dir, size)
        rates(**found.pop("rates"))
        return found

    steps = [
        ("memory", lambda: memory(dev, offload_dir)),
        ("links", lambda: link_bandwidths(dev, size)),
        ("disk", disk),
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
