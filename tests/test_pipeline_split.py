"""The layer split of a pipeline and each rank's share of the memory plan (no processes)."""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from flexgen_infinigen.config import ConfigError, get_config
from flexgen_infinigen.models import family_of
from flexgen_infinigen.pipeline.partition import plan_slices, split_layers
from flexgen_infinigen.planner.hardware import BUILTIN
from flexgen_infinigen.placement import Placement
from flexgen_infinigen.engine import memory_plan
from flexgen_infinigen.engine.stages import LayerSlice, build_stages


def brute_force(layers, stages, per_layer, embed, head) -> float:
    """The least slowest-stage time over every split into contiguous non-empty slices."""
    best = math.inf
    rates = per_layer if isinstance(per_layer, list) else [per_layer] * stages
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        sizes = [b - a for a, b in zip((0, *cuts), (*cuts, layers))]
        times = [rate * n for rate, n in zip(rates, sizes)]
        times[0] += embed
        times[-1] += head
        best = min(best, max(times))
    return best


def test_split_is_contiguous_and_as_balanced_as_any_split():
    rng = random.Random(0)
    for _ in range(60):
        layers, stages = rng.randint(1, 9), rng.randint(1, 4)
        if stages > layers:
            with pytest.raises(ConfigError):
                split_layers(layers, stages)
            continue
        per_layer, embed, head = rng.uniform(0.1, 2), rng.uniform(0, 5), rng.uniform(0, 5)
        if rng.random() < 0.5:  # machines that differ: a layer's time per rank
            per_layer = [rng.uniform(0.1, 2) for _ in range(stages)]
        parts = split_layers(layers, stages, per_layer, embed, head)
        rates = per_layer if isinstance(per_layer, list) else [per_layer] * stages
        assert [p.start for p in parts] == [0] + [p.stop for p in parts[:-1]]
        assert parts[-1].stop == layers and all(len(p.layers) >= 1 for p in parts)
        assert [p.embed for p in parts] == [True] + [False] * (stages - 1)
        assert [p.head for p in parts] == [False] * (stages - 1) + [True]
        times = [rate * len(p.layers) + embed * p.embed + head * p.head
                 for rate, p in zip(rates, parts)]
        assert max(times) == pytest.approx(brute_force(layers, stages, per_layer, embed, head))


def test_heavy_ends_take_layers_away_from_the_end_ranks():
    cfg = get_config("smollm2-135m")
    parts = plan_slices(cfg, 3, Placement.from_percent([30, 70, 20, 80, 100, 0]), 40, 8, 4,
                        BUILTIN["t4-pcie3"])
    sizes = [len(p.layers) for p in parts]
    assert sum(sizes) == cfg.num_layers and sizes[1] > max(sizes[0], sizes[2])


def test_a_slower_machine_gets_fewer_layers():
    cfg = get_config("opt-1.3b")
    policy = Placement.from_percent([0, 100, 0, 100, 100, 0])
    fast, slow = BUILTIN["a100-pcie4"], BUILTIN["t4-pcie3"]
    parts = plan_slices(cfg, 2, policy, 64, 16, 2, [slow, fast])
    assert len(parts[0].layers) < len(parts[1].layers)
    assert len(plan_slices(cfg, 2, policy, 64, 16, 2, [fast, slow])[0].layers) > \
        cfg.num_layers // 2


def test_stages_cover_every_weight_once_except_the_tied_embedding():
    cfg = get_config("smollm2-135m")  # tied: the head reads the embedding
    parts = split_layers(cfg.num_layers, 3)
    names = [p.weight_names(cfg) for p in parts]
    everything = set().union(*names)
    assert everything == set(family_of(cfg).weight_shapes(cfg))
    shared = [n for n in everything if sum(n in s for s in names) > 1]
    assert shared == ["embed.weight"]
    whole = build_stages(cfg, True)
    sliced = [s for p in parts for s in build_stages(cfg, True, p)]
    assert [(s.kind, s.layer) for s in sliced] == [(s.kind, s.layer) for s in whole]


def test_each_rank_plans_its_own_weights_and_cache():
    cfg = get_config("opt-125m")
    policy = Placement.from_percent([40, 30, 50, 50, 100, 0], num_gpu_batches=2)
    whole = memory_plan.plan(cfg, policy, torch.float32, 64, 16)
    parts = split_layers(cfg.num_layers, 2)
    plans = [memory_plan.plan(cfg, policy, torch.float32, 64, 16, part=p) for p in parts]
    shapes = family_of(cfg).weight_shapes(cfg)
    embed = math.prod(shapes["embed.weight"]) * 4  # tied: on both ends
    for tier in ("device", "host", "disk"):
        total = sum(p["kv_cache"][tier] for p in plans)
        assert total == whole["kv_cache"][tier]
    got = sum(sum(p["weights"].values()) for p in plans)
    assert got == sum(whole["weights"].values()) + embed
    assert LayerSlice.whole(cfg) == LayerSlice(0, cfg.num_layers)


def test_a_rank_that_rereads_weights_per_micro_batch_pays_for_it_and_plans_for_it():
    """A pipeline rank reads each offloaded weight once per micro-batch: the cost model
    charges that (``Workload.weight_reads``) and the optimizer keeps more weights on the GPU
    for it."""
    import dataclasses

    from flexgen_infinigen.planner import cost
    from flexgen_infinigen.planner.auto import search
    from flexgen_infinigen.planner.workload import Sizes, Workload

    cfg = dataclasses.replace(get_config("opt-30b"), num_layers=12)  # one rank's share
    hw = BUILTIN["t4-pcie3"]
    policy = Placement.from_percent([20, 80, 0, 100, 100, 0], gpu_batch_size=8, num_gpu_batches=4)
    once, per_batch = (cost.predict(Workload(cfg, 256, 32, 2, weight_reads=r), policy, hw)
                       for r in (1, 4))
    offloaded = 0.8 * cost._weights_time(hw, Sizes.of(Workload(cfg, 256, 32, 2), policy))
    grew = per_batch["decode_terms_s"]["h2d"] - once["decode_terms_s"]["h2d"]
    assert grew == pytest.approx(3 * offloaded) and offloaded > 0
    assert per_batch["decode_step_s"] > once["decode_step_s"]
    # with the T4's 15.2 GB both plans are capped by memory (80% of the weights); with a
    # little more the single-read plan stops short of that, the rereading one does not
    roomy = dataclasses.replace(hw, gpu_mem=16e9)
    plans = [search(cfg, 256, 32, roomy, Placement(), "full", None, 8, 4, 2, progress=False,
                    weight_reads=r)[0] for r in (1, 4)]
    assert plans[1].policy.w_gpu_percent > plans[0].policy.w_gpu_percent
    assert plans[1].prediction["decode_step_s"] >= plans[0].prediction["decode_step_s"]
