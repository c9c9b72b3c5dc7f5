"""What is run (model, lengths, KV policy), its sizes, and the memory it needs per tier."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..config import ConfigError, ModelConfig
from ..models import family_of
from ..models.moe import is_expert_weight, is_moe_layer
from ..placement import Placement
from ..engine import memory_plan
from ..memory.codes import stored_bytes
from ..kv.recurrent import state_bytes
from ..engine.stages import build_stages
from .hardware import HardwareProfile


@dataclass(frozen=True)
class Workload:
    """What is run: model, lengths, dtype and the KV policy with its fetched fraction."""

    cfg: ModelConfig
    prompt_len: int
    gen_len: int
    dtype_bytes: int = 2
    kv_policy: str = "full"  # a registered name the optimizer can plan (kv.POLICIES)
    # fraction of the context read in each layer that selects (see KVPolicy.planned)
    kv_fraction: float = 1.0
    # times a step reads each weight that is off the device: 1 in one process (every GPU
    # batch of the block shares the load); a pipeline rank reads once per micro-batch
    weight_reads: int = 1

    def validate(self) -> "Workload":
        from ..kv import policy_class
        policy_class(self.kv_policy, plannable=True)
        if self.weight_reads < 1:
            raise ConfigError(f"weight reads per step must be at least 1 (got "
                              f"{self.weight_reads})")
        if not 0 < self.kv_fraction <= 1:
            raise ConfigError(f"the KV fraction must be in (0, 1] (got {self.kv_fraction})")
        for flag, v in (("--prompt-len", self.prompt_len), ("--gen-len", self.gen_len)):
            if v < 1:
                raise ConfigError(f"{flag} must be at least 1 (got {v})")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return {2: torch.float16, 4: torch.float32}[self.dtype_bytes]

    @property
    def kv(self):
        """The KV policy object this workload plans with (one per name and fraction)."""
        return _kv_policy(self.kv_policy, self.kv_fraction)

    def fetch_fraction(self, context: float | None = None) -> float:
        """Average fraction of each layer's cached rows read per decode step (at ``context``
        cached tokens where given)."""
        return self.kv.fetch_fraction(self.cfg, context)


@functools.lru_cache(maxsize=64)
def _kv_policy(name: str, fraction: float):
    from ..kv import policy_class
    return policy_class(name, plannable=True).planned(fraction)


@dataclass(frozen=True)
class Sizes:
    """Byte and flop counts of one model under one dtype and compression setting."""

    weights_step: float  # weight bytes loaded per step, as stored (the tied embedding twice)
    weight_tensors: tuple  # stored bytes of each tensor loaded per step (routed experts apart)
    weights_step_raw: float  # the same, decompressed
    layer_params: float  # matmul parameters of one layer (a MoE layer's router, no expert)
    head_params: float
    kv_token: float  # K+V bytes (the latent alone for MLA) of one token in one layer, as stored
    kv_token_raw: float
    num_stages: int
    # mixture of experts: layers with routed experts, and one expert's three matrices in
    # bytes as stored, decompressed, and in parameters (all 0 for a dense model)
    moe_layers: int = 0
    expert_bytes: float = 0.0
    expert_bytes_raw: float = 0.0
    expert_params: float = 0.0
    # one row's recurrent states over every recurrent layer (a hybrid's), read and written
    # whole at each decode step (0 for a model of attention layers only)
    state_row: float = 0.0

    @classmethod
    def of(cls, work: Workload, policy: Placement) -> "Sizes":
        return _sizes(work, policy.split_layers, policy.compress_weight, policy.compress_cache)

    @classmethod
    def compute(cls, work: Workload, policy: Placement) -> "Sizes":
        cfg, item = work.cfg, work.dtype_bytes
        shapes = family_of(cfg).weight_shapes(cfg)
        stages = build_stages(cfg, policy.split_layers)
        dense = [full for stage in stages for full in stage.weights.values()
                 if not is_expert_weight(full)]
        tensors = tuple(stored_bytes(shapes[full], item, policy.compress_weight)
                        for full in dense)
        raw = sum(math.prod(shapes[full]) * item for full in dense)
        layer = sum(math.prod(s) for n, s in shapes.items()
                    if n.startswith("layers.0.") and len(s) == 2 and not is_expert_weight(n))
        kv_raw = cfg.kv_copies * cfg.kv_dim * item
        # one token's row of the cache, as stored ([tokens, KV heads, head_dim] per K and V,
        # or the one latent row where the values are the keys)
        kv = cfg.kv_copies * stored_bytes((cfg.num_kv_heads, cfg.head_dim), item,
                                          policy.compress_cache)
        # per layer on average: a hybrid's recurrent layers keep no cache, but a state a row
        share = cfg.attention_layers / cfg.num_layers
        kv, kv_raw = kv * share, kv_raw * share
        state = len(cfg.linear_layers) * state_bytes(family_of(cfg).recurrent_state_shapes(cfg))
        moe = [i for i in range(cfg.num_layers) if is_moe_layer(cfg, i)]
        one = [shapes[f"layers.{moe[0]}.experts.0.{m}_proj.weight"]
               for m in ("gate", "up", "down")] if moe else []
        return cls(sum(tensors), tensors, raw, layer, cfg.vocab_size * cfg.hidden_size, kv, kv_raw,
                   len(stages), len(moe),
                   sum(stored_bytes(s, item, policy.compress_weight) for s in one),
                   sum(math.prod(s) for s in one) * item, sum(math.prod(s) for s in one),
                   state)

    def expert_step_bytes(self, cfg: ModelConfig, tokens: float, raw: bool = False) -> float:
        """Routed-expert bytes one step of ``tokens`` tokens reads (the union of their
        experts in each MoE layer, :func:`expert_coverage`), as stored or decompressed."""
        per = self.expert_bytes_raw if raw else self.expert_bytes
        return self.moe_layers * expert_coverage(cfg, tokens) * per


def expert_coverage(cfg: ModelConfig, tokens: float) -> float:
    """Expected distinct experts that ``tokens`` tokens route to in one MoE layer, each
    choosing ``k`` of ``E`` experts: E * (1 - (1 - k/E)^tokens). Exact for routing where
    each token's k experts are a uniform draw: an expert is missed by one token with
    probability 1 - k/E, and by all of them independently. 0 for a dense model."""
    e, k = cfg.num_experts, cfg.experts_per_token
    if e <= 0 or tokens <= 0:
        return 0.0
    return e * (1.0 - (1.0 - k / e) ** tokens)


@functools.lru_cache(maxsize=256)
def _sizes(work: Workload, sep_layer: bool, compress_weight: bool, compress_cache: bool) -> Sizes:
    return Sizes.compute(work, Placement(sep_layer=sep_layer, compress_weight=compress_weight,
                                      compress_cache=compress_cache))


@functools.lru_cache(maxsize=4096)
def _plan(work: Workload, policy: Placement) -> dict:
    return memory_plan.plan(work.cfg, policy, work.torch_dtype, work.prompt_len, work.gen_len)


def fractions(policy: Placement) -> dict[str, float]:
    """Shares on (GPU, CPU, disk) of the weights (w), cache (c), activations (h) and routed
    experts (e: as the weights unless ``--experts-percent`` places them apart)."""
    return dict(zip(("wg", "wc", "wd", "cg", "cc", "cd", "hg", "hc", "hd", "eg", "ec", "ed"),
                    policy.weight_split + policy.cache_split + policy.act_split
                    + policy.expert_split))


def mean_context(work: Workload) -> float:
    """Average cached tokens over the decode steps (step i attends to prompt + i - 1)."""
    return work.prompt_len + (work.gen_len - 2) / 2 if work.gen_len > 1 else work.prompt_len


def extra_device_bytes(work: Workload, policy: Placement) -> float:
    """Device memory a KV policy adds to the memory plan (the policy's own count)."""
    max_len = work.prompt_len + work.gen_len
    return float(sum(work.kv.device_bytes(work.cfg, policy, work.dtype_bytes, max_len).values()))


def memory_needs(work: Workload, policy: Placement) -> dict[str, float]:
    """Bytes per tier: the runtime's own memory plan plus what the KV policy adds."""
    total = dict(_plan(work, policy)["total"])
    total["device"] += extra_device_bytes(work, policy)
    return total


def fits(need: dict[str, float], hw: HardwareProfile) -> bool:
    if hw.shared_memory:
        return need["device"] + need["host"] <= hw.gpu_mem and need["disk"] <= hw.disk_mem
    return (need["device"] <= hw.gpu_mem and need["host"] <= hw.cpu_mem
            and need["disk"] <= hw.disk_mem)
