"""What the cost model knows about a machine: link bandwidths, compute speed, memory per tier.

A profile is either measured on this machine (``python -m flexgen_infinigen.profile``)
or one of the built-in profiles below, assembled from vendors' published figures
derated to what such links and chips typically sustain, so that a plan can be made
for a machine one is not sitting at.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from ..config import ConfigError

GB = 1e9
GIB = 1 << 30


RATES = ("h2d", "d2h", "page_cache_read", "attention", "prefill_attention", "cpu_attention",
         "dequant", "device_copy", "host_gather")
# measured where the machine allows it; a profile without them uses disk_read_bw
OPTIONAL_RATES = ("disk_read", "disk_buffered_read", "mapped_rows")
# the engine's own fixed costs per layer; each KV policy names its own (``overhead_name``)
ENGINE_OVERHEADS = {"layer": 0.25e-3, "kv_offload": 0.02e-3, "weights_offload": 0.05e-3}


def overhead_names() -> tuple[str, ...]:
    """Every fixed cost a profile holds: the engine's and the registered KV policies'."""
    from ..kv import POLICIES
    return tuple(ENGINE_OVERHEADS) + tuple(
        cls.overhead_name for cls in POLICIES.values() if cls.overhead_name)


def default_overheads() -> dict[str, float]:
    """The built-in profiles' fixed costs per layer (seconds)."""
    from ..kv import POLICIES
    return {**ENGINE_OVERHEADS, **{cls.overhead_name: cls.default_overhead_s
                                   for cls in POLICIES.values() if cls.overhead_name}}


@dataclass(frozen=True)
class HardwareProfile:
    """A machine as the cost model sees it. Rates are bytes/s, memory bytes, times seconds."""

    name: str
    device: str  # what computes, in words
    dtype_bytes: int  # the runtime's default dtype on this device (2: fp16, 4: fp32)
    gpu_mem: float  # memory usable by the runtime on each tier
    cpu_mem: float
    disk_mem: float
    # device and host are the same memory (a CPU-only machine): one budget for both
    shared_memory: bool
    # copies run on their own engine (CUDA copy engines); on a CPU they take the same cores
    copies_overlap_compute: bool
    disk_read_bw: float  # cold reads (not in the page cache)
    disk_write_bw: float
    h2d_bw_pageable: float  # for reference: the runtime copies from pinned memory
    d2h_bw_pageable: float
    # achieved matmul flop/s for an [m, k] x [k, n] product, by m (tokens)
    matmul_flops: dict[int, float]
    cpu_matmul_flops: dict[int, float]
    # rates by the size in bytes of one operation, one table per name in RATES:
    #   h2d/d2h: one copy between host and device; page_cache_read: a disk-tier read served
    #   from the page cache (disk_read_bw is for reads that are not); attention: decode
    #   attention, by the
    #   K+V bytes it reads (cpu_attention: the same on the host); dequant: 4-bit
    #   decompression, by output bytes; device_copy: joining a tensor's tier segments;
    #   host_gather: gathering selected KV rows on the host (bytes read + written); and
    #   optionally (OPTIONAL_RATES) disk_read / disk_buffered_read: a cold read from the
    #   disk tier with O_DIRECT / through the page cache, by read size; mapped_rows: a GPU
    #   reading a KV policy's chosen rows from pinned host memory itself (the Triton kernel
    #   of memory.mapped_rows), by the bytes of one layer's rows: no host gather then
    rates: dict[str, dict[int, float]]
    # fixed seconds per layer and GPU batch at decode beyond flops and bytes (operator
    # dispatch, kernel launches), as "<family>/<what>" for what in overhead_names(): "layer"
    # for a layer with everything on the device, and what offloading or a KV policy adds
    overhead_s: dict[str, float]
    op_overhead_s: float = 10e-6  # one small operator
    # memory the OS can use to cache offloaded files; None: the host memory the placement
    # leaves free (a smaller --cpu-mem budget then also shrinks the page cache)
    page_cache_mem: float | None = None
    source: str = ""  # how the numbers were obtained

    def flops(self, m: float, on_cpu: bool = False) -> float:
        """Achieved matmul flop/s at ``m`` rows, interpolated in log-log from the table."""
        # below the table a matmul is bandwidth-bound: flop/s linear in m
        return _interpolate(self.cpu_matmul_flops if on_cpu else self.matmul_flops,
                            max(float(m), 1.0), below="linear")

    def rate(self, name: str, size: float) -> float:
        """Bytes/s of operation ``name`` done on ``size`` bytes at once."""
        return _interpolate(self.rates[name], max(float(size), 1.0), below="clamp")

    def seconds(self, name: str, total: float, pieces: float = 1) -> float:
        """Seconds for ``total`` bytes of operation ``name`` done as ``pieces`` equal parts."""
        if total <= 0:
            return 0.0
        return total / self.rate(name, total / max(pieces, 1))

    def overhead(self, family: str, what: str = "layer") -> float:
        return self.overhead_s.get(f"{family}/{what}", self.overhead_s.get(f"llama/{what}", 0.0))

    def link_peak(self, link: str) -> tuple[str, float]:
        """The fastest bytes/s this profile gives a tier link (one of ``tiers.LINKS``), and
        which of its figures that is: the best copy size's rate for host<->device, the faster
        of cold and page-cache reads for disk->host, and the (flushed) write rate for host->disk.
        """
        if link == "host->disk":
            return "disk_write_bw", self.disk_write_bw
        if link == "disk->host":
            cached = max(self.rates["page_cache_read"].values())
            return (("rates.page_cache_read", cached) if cached >= self.disk_read_bw
                    else ("disk_read_bw", self.disk_read_bw))
        name = {"host->device": "h2d", "device->host": "d2h"}[link]
        return f"rates.{name}", max(self.rates[name].values())

    def with_memory(self, gpu_gb: float | None = None, cpu_gb: float | None = None,
                    disk_gb: float | None = None) -> "HardwareProfile":
        changes = {}
        for key, v in (("gpu_mem", gpu_gb), ("cpu_mem", cpu_gb), ("disk_mem", disk_gb)):
            if v is not None:
                if not v >= 0:
                    raise ConfigError(f"--{key.replace('_', '-')} must be 0 or more GB (got {v})")
                changes[key] = v * GB
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        names = {f.name for f in dataclasses.fields(cls)}
        missing = names - set(d) - {"op_overhead_s", "source", "page_cache_mem"}
        missing |= {f"rates.{r}" for r in RATES if r not in d.get("rates", {})}
        if missing:
            raise ConfigError(f"hardware profile lacks {', '.join(sorted(missing))}; "
                              "re-run `python -m flexgen_infinigen.profile --out FILE`")
        d = {k: v for k, v in d.items() if k in names}
        for key in ("matmul_flops", "cpu_matmul_flops"):
            d[key] = {int(k): float(v) for k, v in d[key].items()}
        d["rates"] = {r: {int(k): float(v) for k, v in t.items()} for r, t in d["rates"].items()}
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)


def _interpolate(table: dict, x: float, below: str) -> float:
    points = sorted((float(k), float(v)) for k, v in table.items())
    if x <= points[0][0]:
        return points[0][1] * (x / points[0][0] if below == "linear" else 1.0)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
    return points[-1][1]


def _gpu(name, device, gpu_gb, link_gbs, tflops, hbm_gbs, cpu_gb, note) -> HardwareProfile:
    """A GPU server from published figures.

    Sustained rates: pinned copies reach ~80% of the PCIe link's theoretical rate, with
    ~10 us per copy, and pageable ones about half of that; dense fp16 matmuls reach ~65% of
    the tensor-core peak at large m and are bound by memory bandwidth at small m (the
    table follows the roofline); decode attention streams the cache at ~70% of memory
    bandwidth. The host: a dual-socket server (~1.5 TFLOP/s fp32 matmul, ~100 GB/s of
    memory, ~20 GB/s for a row gather) and an NVMe SSD (~2 GB/s read, 1.5 write). A layer
    costs ~0.25 ms of kernel launches; speculation ~30 small kernels. Chosen KV rows read by
    the GPU from pinned memory in place move at ~0.6 of the pinned copy rate (rows of a few
    hundred bytes; the first GPU run's OPT-13B InfiniGen step, results page).
    """
    link = link_gbs * GB * 0.8
    peak = tflops * 1e12 * 0.65
    k = n = 8192

    def roofline(m, peak_flops, mem_bw):
        t = max(2 * m * k * n / peak_flops, (m * k + k * n + m * n) * 2 / mem_bw)
        return 2 * m * k * n / t

    def flat(v):
        return {1 << 10: v, 1 << 30: v}

    ms = [1, 4, 16, 64, 256, 1024, 4096, 16384]
    sizes = [64 << 10, 1 << 20, 4 << 20, 32 << 20, 256 << 20]
    by_size = {s: s / (10e-6 + s / link) for s in sizes}
    overheads = default_overheads()
    return HardwareProfile(
        name=name, device=device, dtype_bytes=2,
        gpu_mem=gpu_gb * GB * 0.95, cpu_mem=cpu_gb * GB * 0.9, disk_mem=1500 * GB,
        shared_memory=False, copies_overlap_compute=True,
        disk_read_bw=2.0 * GB, disk_write_bw=1.5 * GB,
        h2d_bw_pageable=link / 2, d2h_bw_pageable=link / 2,
        matmul_flops={m: roofline(m, peak, hbm_gbs * GB * 0.8) for m in ms},
        cpu_matmul_flops={m: roofline(m, 1.5e12, 100 * GB) for m in ms},
        rates={"h2d": by_size, "d2h": dict(by_size), "page_cache_read": flat(8 * GB),
               "attention": flat(hbm_gbs * GB * 0.7),
               "prefill_attention": flat(hbm_gbs * GB * 0.15),
               "cpu_attention": flat(40 * GB), "dequant": flat(hbm_gbs * GB * 0.2),
               "device_copy": flat(hbm_gbs * GB * 0.8), "host_gather": flat(20 * GB),
               "mapped_rows": flat(link * 0.6)},
        overhead_s={f"{fam}/{what}": v for fam in ("opt", "llama")
                    for what, v in overheads.items()},
        op_overhead_s=8e-6, source="built-in, published figures: " + note)


BUILTIN: dict[str, HardwareProfile] = {p.name: p for p in [
    _gpu("a100-pcie4", "NVIDIA A100 40GB, PCIe 4.0 x16", 40, 32, 312, 1555, 256,
         "A100 40GB PCIe: 312 TFLOP/s fp16, 1555 GB/s HBM2; PCIe 4.0 x16 32 GB/s"),
    _gpu("h100-pcie5", "NVIDIA H100 80GB, PCIe 5.0 x16", 80, 64, 756, 2000, 512,
         "H100 PCIe: 756 TFLOP/s fp16 dense, 2.0 TB/s HBM2e; PCIe 5.0 x16 64 GB/s"),
    _gpu("h200-pcie5", "NVIDIA H200 141GB, PCIe 5.0 x16", 141, 64, 989, 4800, 128,
         "H200 SXM: 989 TFLOP/s fp16 dense, 4.8 TB/s HBM3e; PCIe 5.0 x16 64 GB/s; 128 GB of "
         "host memory (the lent machine this project first ran on a GPU)"),
    _gpu("a6000-pcie3", "NVIDIA RTX A6000 48GB, PCIe 3.0 x16", 48, 16, 155, 768, 256,
         "RTX A6000: 155 TFLOP/s fp16 tensor, 768 GB/s GDDR6; PCIe 3.0 x16 16 GB/s "
         "(the InfiniGen paper's machine)"),
    _gpu("t4-pcie3", "NVIDIA T4 16GB, PCIe 3.0 x16", 16, 16, 65, 320, 208,
         "T4: 65 TFLOP/s fp16, 320 GB/s GDDR6; PCIe 3.0 x16; 208 GB DRAM "
         "(the FlexGen paper's machine)"),
]}


def load_profile(spec: str) -> HardwareProfile:
    """A built-in profile name or a JSON file written by the profiler (this machine's own,
    measured or cached: :func:`.measure.cached_profile`)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    try:
        with open(spec) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no hardware profile {spec!r}: give a JSON file written by "
                          "`python -m flexgen_infinigen.profile --out FILE` or one of: "
                          f"{', '.join(BUILTIN)}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read hardware profile {spec}: {e}") from None
    return HardwareProfile.from_dict(data)
