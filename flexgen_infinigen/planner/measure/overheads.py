"""The engine's fixed cost per layer, measured by running a tiny model through it.

A tiny model's decode step has negligible flops and bytes, so its time per layer is what
the runtime spends regardless of size: operator dispatch and kernel launches. Running
it again with the cache offloaded, the weights offloaded, or each registered KV policy that
names a fixed cost of its own (``KVPolicy.overhead_name``, run as its ``overhead_probe``,
spread over its ``overhead_layers``) gives what each of those adds. No policy is named here.
"""
from __future__ import annotations

import statistics

import torch

from ...config import ModelConfig
from ...memory.tiers import Tiers


def tiny_config(family: str) -> ModelConfig:
    """A model of ``family`` small enough that its step is all fixed cost."""
    return ModelConfig(name=f"tiny-{family}", family=family, vocab_size=256, hidden_size=128,
                       intermediate_size=256, num_layers=8, num_heads=4,
                       num_kv_heads=4 if family == "opt" else 2, max_positions=512)


def _tiny_step(dev: torch.device, dtype: torch.dtype, cfg: ModelConfig, percent: list,
               kv_policy=None) -> float:
    """Median decode step time of a tiny model run by the real engine."""
    from ...api import OffloadedLM
    from ...kv import FullPolicy
    from ...placement import Placement
    from ...engine.schedule import Engine
    from ...engine.loading import place_weights
    from ...sampling import Sampler, SamplingConfig
    from ...weights.sources import DummySource

    tiers = Tiers(dev)
    policy = Placement.from_percent(percent, overlap=False)
    try:
        weights = place_weights(cfg, DummySource(cfg), policy, tiers, dtype, progress=False)
        kv_policy = kv_policy or FullPolicy()
        engine = Engine(cfg, weights, policy, tiers, kv_policy, dtype)
        kv_policy.prepare(OffloadedLM(cfg, engine, None, tiers).policy_context())
        ids = torch.randint(3, cfg.vocab_size, (1, 32))
        out = engine.run_block([(ids, torch.ones_like(ids, dtype=torch.bool))], 24,
                               Sampler(SamplingConfig()))
    finally:
        tiers.close()
    return statistics.median(out["times"][2:])


def engine_overheads(dev: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Fixed seconds per layer and GPU batch: on the device, and what each option adds."""
    device, cache_host, weights_host = ([100, 0, 100, 0, 100, 0], [100, 0, 0, 100, 100, 0],
                                        [0, 100, 100, 0, 100, 0])
    from ...kv import POLICIES

    out = {}
    for family in ("opt", "llama"):
        cfg = tiny_config(family)
        layers = cfg.num_layers
        base = _tiny_step(dev, dtype, cfg, device)
        host = _tiny_step(dev, dtype, cfg, cache_host)
        got = {"layer": base / layers,
               "kv_offload": (host - base) / layers,
               "weights_offload": (_tiny_step(dev, dtype, cfg, weights_host) - base) / layers}
        for cls in POLICIES.values():
            if cls.overhead_name:
                probe = cls.overhead_probe()
                got[cls.overhead_name] = (_tiny_step(dev, dtype, cfg, cache_host, probe)
                                          - host) / probe.overhead_layers(cfg)
        out.update({f"{family}/{k}": max(0.0, v) for k, v in got.items()})
    return out
