"""What is run (model, lengths, KV policy), its sizes, and the memory it needs per tier."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .. import memory_plan
from ..compression import GROUP_SIZE, can_compress
from ..config import ConfigError, ModelConfig
from ..engine import build_stages
from ..models import family_of
from ..policy import Policy
from .hardware import HardwareProfile

KV_POLICIES = ("full", "infinigen", "h2o")
FULL_LAYERS = 2  # InfiniGen reads the whole cache in layers 0 and 1


@dataclass(frozen=True)
class Workload:
    """What is run: model, lengths, dtype and the KV policy with its fetched fraction."""

    cfg: ModelConfig
    prompt_len: int
    gen_len: int
    dtype_bytes: int = 2
    kv_policy: str = "full"
    # infinigen: fraction of the context fetched in each speculative layer (its cap, which binds
    # on most layers); h2o: hh + recent ratio kept
    kv_fraction: float = 1.0
    partial_weight_ratio: float = 1.0  # skewed key columns kept for speculation
    speculation_keys: str = "int4"

    def validate(self) -> "Workload":
        if self.kv_policy not in KV_POLICIES:
            raise ConfigError(f"--kv-policy must be one of {', '.join(KV_POLICIES)}")
        if not 0 < self.kv_fraction <= 1:
            raise ConfigError(f"the KV fraction must be in (0, 1] (got {self.kv_fraction})")
        for flag, v in (("--prompt-len", self.prompt_len), ("--gen-len", self.gen_len)):
            if v < 1:
                raise ConfigError(f"{flag} must be at least 1 (got {v})")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return {2: torch.float16, 4: torch.float32}[self.dtype_bytes]

    def fetch_fraction(self) -> float:
        """Average fraction of each layer's cached rows read per decode step."""
        if self.kv_policy == "full":
            return 1.0
        if self.kv_policy == "h2o":
            return self.kv_fraction
        layers = self.cfg.num_layers
        full = min(FULL_LAYERS, layers)
        return (full + (layers - full) * self.kv_fraction) / layers


def _stored(shape, item: int, compress: bool) -> float:
    n = math.prod(shape)
    if compress and can_compress(tuple(shape)):
        return n / GROUP_SIZE * (GROUP_SIZE / 2 + 2 * item)
    return n * item


@dataclass(frozen=True)
class Sizes:
    """Byte and flop counts of one model under one dtype and compression setting."""

    weights_step: float  # weight bytes loaded per step, as stored (the tied embedding twice)
    weight_tensors: tuple  # stored bytes of each tensor loaded per step
    weights_step_raw: float  # the same, decompressed
    layer_params: float  # matmul parameters of one layer
    head_params: float
    kv_token: float  # K+V bytes of one token in one layer, as stored
    kv_token_raw: float
    num_stages: int
    spec_params: float  # speculation projection parameters of one layer (InfiniGen)
    partial_dim: int  # partial key columns per KV head

    @classmethod
    def of(cls, work: Workload, policy: Policy) -> "Sizes":
        return _sizes(work, policy.sep_layer, policy.compress_weight, policy.compress_cache)

    @classmethod
    def compute(cls, work: Workload, policy: Policy) -> "Sizes":
        cfg, item = work.cfg, work.dtype_bytes
        shapes = family_of(cfg).weight_shapes(cfg)
        stages = build_stages(cfg, policy.sep_layer)
        tensors = tuple(_stored(shapes[full], item, policy.compress_weight)
                        for stage in stages for full in stage.weights.values())
        raw = sum(math.prod(shapes[full]) * item
                  for stage in stages for full in stage.weights.values())
        layer = sum(math.prod(s) for n, s in shapes.items()
                    if n.startswith("layers.0.") and len(s) == 2)
        kv_raw = 2 * cfg.kv_dim * item
        kv = kv_raw / (GROUP_SIZE * item) * (GROUP_SIZE / 2 + 2 * item) \
            if policy.compress_cache and cfg.head_dim % GROUP_SIZE == 0 else kv_raw
        r = max(1, round(work.partial_weight_ratio * cfg.head_dim))
        # OPT projects only the partial columns; Llama needs the full rotated query (RoPE)
        spec = (cfg.hidden_size * cfg.num_heads * r if family_of(cfg).SKEW_FOLDS_INTO_WEIGHTS
                else cfg.hidden_size * cfg.q_dim + cfg.num_heads * cfg.head_dim ** 2)
        return cls(sum(tensors), tensors, raw, layer, cfg.vocab_size * cfg.hidden_size, kv, kv_raw,
                   len(stages), spec, r)


@functools.lru_cache(maxsize=256)
def _sizes(work: Workload, sep_layer: bool, compress_weight: bool, compress_cache: bool) -> Sizes:
    return Sizes.compute(work, Policy(sep_layer=sep_layer, compress_weight=compress_weight,
                                      compress_cache=compress_cache))


@functools.lru_cache(maxsize=4096)
def _plan(work: Workload, policy: Policy) -> dict:
    return memory_plan.plan(work.cfg, policy, work.torch_dtype, work.prompt_len, work.gen_len)


def fractions(policy: Policy) -> dict[str, float]:
    return dict(zip(("wg", "wc", "wd", "cg", "cc", "cd", "hg", "hc", "hd"),
                    policy.weight_split + policy.cache_split + policy.act_split))


def mean_context(work: Workload) -> float:
    """Average cached tokens over the decode steps (step i attends to prompt + i - 1)."""
    return work.prompt_len + (work.gen_len - 2) / 2 if work.gen_len > 1 else work.prompt_len


def extra_device_bytes(work: Workload, policy: Policy) -> float:
    """Device memory a KV policy adds to the memory plan (the policy's own count)."""
    kv = _kv_policy(work)
    if kv is None:
        return 0.0
    max_len = work.prompt_len + work.gen_len
    return float(sum(kv.device_bytes(work.cfg, policy, work.dtype_bytes, max_len).values()))


@functools.lru_cache(maxsize=64)
def _kv_policy(work: Workload):
    from ..kv import make_kv_policy
    if work.kv_policy == "infinigen":
        return make_kv_policy("infinigen", speculation_keys=work.speculation_keys,
                              partial_weight_ratio=work.partial_weight_ratio,
                              max_kv_fraction=work.kv_fraction)
    if work.kv_policy == "h2o":
        return make_kv_policy("h2o", hh_ratio=work.kv_fraction / 2,
                              recent_ratio=work.kv_fraction / 2)
    return None


def memory_needs(work: Workload, policy: Policy) -> dict[str, float]:
    """Bytes per tier: the runtime's own memory plan plus what the KV policy adds."""
    total = dict(_plan(work, policy)["total"])
    total["device"] += extra_device_bytes(work, policy)
    return total


def fits(need: dict[str, float], hw: HardwareProfile) -> bool:
    if hw.shared_memory:
        return need["device"] + need["host"] <= hw.gpu_mem and need["disk"] <= hw.disk_mem
    return (need["device"] <= hw.gpu_mem and need["host"] <= hw.cpu_mem
            and need["disk"] <= hw.disk_mem)
