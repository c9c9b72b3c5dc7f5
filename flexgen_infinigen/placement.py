"""The placement: where weights, KV cache and activations live, and the batch shape (FlexGen's
"policy"; ``Policy`` stays as an alias of :class:`Placement` for one release)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config import ConfigError


@dataclass(frozen=True)
class Placement:
    """Placement percentages (the disk tier gets what GPU and CPU leave) and schedule switches.

    ``gpu`` in the names means the compute device, which is the CPU on a machine without CUDA.
    """

    gpu_batch_size: int = 1
    num_gpu_batches: int = 1
    w_gpu_percent: float = 100
    w_cpu_percent: float = 0
    cache_gpu_percent: float = 100
    cache_cpu_percent: float = 0
    act_gpu_percent: float = 100
    act_cpu_percent: float = 0
    # a mixture-of-experts model's routed experts on GPU / CPU in percent, disk the rest
    # (--experts-percent); None: they follow the weights' percentages
    expert_gpu_percent: float | None = None
    expert_cpu_percent: float | None = None
    # None: on with CUDA; on a CPU-only machine on when anything is on disk (a reader waits on
    # the disk, not on the cores), else off (a copy thread would compete with compute)
    overlap: bool | None = None
    # attention and MLP as separate schedule stages (FlexGen's --sep-layer): a stage's weights
    # load while the one before computes. None: one stage a layer where nothing loads (every
    # dense weight read in place by a CPU, no routed experts: half the per-stage bookkeeping
    # of a decode step), else separate (memory_plan.one_stage_a_layer)
    sep_layer: bool | None = None
    pin_weight: bool = True
    cpu_cache_compute: bool = False
    # a decode step's routed experts held in CPU memory multiplied there by the CPU, the
    # tokens' rows sent to them (not the experts to the compute device); prompts still fetch
    cpu_expert_compute: bool = False
    compress_weight: bool = False
    compress_cache: bool = False
    direct_io: bool = False  # read the disk tier with O_DIRECT (bypassing the page cache)
    # prompt tokens per chunk through a layer's MLP (and attention's query rows at most);
    # None: the memory plan's choice (memory_plan.prefill_chunk)
    prefill_chunk: int | None = None
    # CPU-only: a KV cache in CPU memory is read where it is (False: copied per step as over
    # a GPU's link, which exercises the transfer path on a machine without one)
    host_in_place: bool = True

    @property
    def split_layers(self) -> bool:
        """Separate attention and MLP stages (what an unresolved ``sep_layer`` plans with)."""
        return self.sep_layer is not False

    @property
    def block_size(self) -> int:
        return self.gpu_batch_size * self.num_gpu_batches

    @staticmethod
    def _split(gpu: float, cpu: float) -> tuple[float, float, float]:
        return gpu / 100, cpu / 100, max(0.0, (100 - gpu - cpu) / 100)

    @property
    def weight_split(self) -> tuple[float, float, float]:
        return self._split(self.w_gpu_percent, self.w_cpu_percent)

    @property
    def expert_split(self) -> tuple[float, float, float]:
        if self.expert_gpu_percent is None:
            return self.weight_split
        return self._split(self.expert_gpu_percent, self.expert_cpu_percent)

    @property
    def cache_split(self) -> tuple[float, float, float]:
        return self._split(self.cache_gpu_percent, self.cache_cpu_percent)

    @property
    def act_split(self) -> tuple[float, float, float]:
        return self._split(self.act_gpu_percent, self.act_cpu_percent)

    @property
    def uses_disk(self) -> bool:
        """Anything (weights, cache, activations) placed on the disk tier."""
        return any(split[2] > 0 for split in (self.weight_split, self.expert_split,
                                              self.cache_split, self.act_split))

    def validate(self) -> "Placement":
        names = ["weights", "cache", "activations"]
        pairs = [(self.w_gpu_percent, self.w_cpu_percent),
                 (self.cache_gpu_percent, self.cache_cpu_percent),
                 (self.act_gpu_percent, self.act_cpu_percent)]
        for what, (g, c) in zip(names, pairs):
            for v in (g, c):
                if not 0 <= v <= 100:
                    raise ConfigError(f"--percent value {v} for {what} is outside 0..100; "
                                      "give six numbers between 0 and 100")
            if g + c > 100:
                raise ConfigError(f"--percent for {what} puts {g}% on GPU and {c}% on CPU, over "
                                  "100 in all; make each GPU+CPU pair sum to at most 100")
        if (self.expert_gpu_percent is None) != (self.expert_cpu_percent is None):
            raise ConfigError("--experts-percent takes two numbers, GPU and CPU")
        if self.expert_gpu_percent is not None:
            g, c = self.expert_gpu_percent, self.expert_cpu_percent
            if not (0 <= g <= 100 and 0 <= c <= 100 and g + c <= 100):
                raise ConfigError(f"--experts-percent {g} {c}: give GPU and CPU percentages "
                                  "between 0 and 100 that sum to at most 100 (disk gets the rest)")
        for flag, v in [("--gpu-batch-size", self.gpu_batch_size),
                        ("--num-gpu-batches", self.num_gpu_batches),
                        ("--prefill-chunk", 1 if self.prefill_chunk is None
                         else self.prefill_chunk)]:
            if v < 1:
                raise ConfigError(f"{flag} must be at least 1 (got {v})")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_percent(cls, percent: list[float], **kw) -> "Placement":
        if len(percent) != 6:
            raise ConfigError(
                f"--percent takes six numbers (wg wc cg cc hg hc), got {len(percent)}")
        wg, wc, cg, cc, hg, hc = percent
        return cls(w_gpu_percent=wg, w_cpu_percent=wc, cache_gpu_percent=cg,
                   cache_cpu_percent=cc, act_gpu_percent=hg, act_cpu_percent=hc, **kw).validate()


Policy = Placement  # the old name, kept for one release
