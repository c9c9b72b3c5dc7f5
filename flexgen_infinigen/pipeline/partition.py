"""Which layers each pipeline rank runs: contiguous slices balanced by the cost model.

A rank's predicted time is its layers' time plus the embedding (first rank) or the output
head (last rank). The per-layer time and the two ends come from the cost model
(:mod:`..planner.cost`) for the run's placement, dtype and lengths: the model's predicted
block time with all its layers and with half of them gives the time per layer and the rest
(the ends, split between embedding and head in proportion to their weight bytes). The
split then minimizes the slowest rank's time, each rank keeping at least one layer.
"""
from __future__ import annotations

import dataclasses
import math

from ..config import ConfigError, ModelConfig
from ..models import family_of
from ..placement import Placement
from ..engine.stages import LayerSlice


def check_stages(stages: int, cfg: ModelConfig | None = None, world: int | None = None) -> None:
    """Refuse a pipeline that cannot run, before anything is loaded."""
    if stages < 1:
        raise ConfigError(f"--pipeline-stages must be at least 1 (got {stages})")
    if world is not None and world != stages:
        raise ConfigError(
            f"--pipeline-stages {stages} but {world} process(es) were launched: start one "
            f"process per stage, e.g. `torchrun --nproc-per-node {stages} -m "
            f"flexgen_infinigen.run --pipeline-stages {stages} ...`")
    if cfg is not None and stages > cfg.num_layers:
        raise ConfigError(f"--pipeline-stages {stages} is more than {cfg.name}'s "
                          f"{cfg.num_layers} layers; every stage needs at least one layer")


def stage_costs(cfg: ModelConfig, policy: Placement, prompt_len: int, gen_len: int,
                dtype_bytes: int, hw) -> tuple[float, float, float]:
    """(seconds per layer, seconds of the embedding, seconds of the head) of one block, as
    the cost model predicts them on profile ``hw``."""
    from ..planner.cost import predict
    from ..planner.workload import Workload

    def total(layers: int) -> float:
        c = dataclasses.replace(cfg, num_layers=layers)
        return predict(Workload(c, prompt_len, gen_len, dtype_bytes), policy, hw)["total_s"]

    full = cfg.num_layers
    half = max(1, full // 2)
    per_layer = (total(full) - total(half)) / (full - half) if full > half else total(full)
    ends = max(total(full) - per_layer * full, 0.0)
    names = family_of(cfg).stage_weights(cfg)
    shapes = family_of(cfg).weight_shapes(cfg)
    size = {end: sum(math.prod(shapes[n]) for n in names[end]) for end in ("embed", "head")}
    share = size["embed"] / max(size["embed"] + size["head"], 1)
    return per_layer, ends * share, ends * (1 - share)


def split_layers(num_layers: int, stages: int, per_layer: float | list[float] = 1.0,
                 embed: float = 0.0, head: float = 0.0) -> list[LayerSlice]:
    """Contiguous slices, one per stage, that minimize the slowest stage's time; a layer
    takes ``per_layer`` seconds, or ``per_layer[r]`` on rank r (machines that differ)."""
    if not 1 <= stages <= num_layers:
        raise ConfigError(f"cannot split {num_layers} layers over {stages} stages")
    rates = list(per_layer) if isinstance(per_layer, (list, tuple)) else [per_layer] * stages

    def cost(rank: int, layers: int) -> float:
        return rates[rank] * layers + (embed if rank == 0 else 0.0) + \
            (head if rank == stages - 1 else 0.0)

    # best[r][n]: the least slowest-stage time for the first n layers on ranks 0..r
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(stages)]
    cut = [[0] * (num_layers + 1) for _ in range(stages)]
    for n in range(1, num_layers + 1):
        best[0][n] = cost(0, n)
    for r in range(1, stages):
        for n in range(r + 1, num_layers + 1):
            for m in range(r, n):  # ranks 0..r-1 take m layers, rank r the rest
                t = max(best[r - 1][m], cost(r, n - m))
                if t < best[r][n] - 1e-12:
                    best[r][n], cut[r][n] = t, m
    bounds, n = [num_layers], num_layers
    for r in range(stages - 1, 0, -1):
        n = cut[r][n]
        bounds.append(n)
    bounds.append(0)
    bounds.reverse()
    return [LayerSlice(bounds[r], bounds[r + 1], embed=r == 0, head=r == stages - 1)
            for r in range(stages)]


def plan_slices(cfg: ModelConfig, stages: int, policy: Placement, prompt_len: int, gen_len: int,
                dtype_bytes: int, hw) -> list[LayerSlice]:
    """The balanced split of ``cfg`` over ``stages`` ranks for this run, on one hardware
    profile ``hw`` for all, or a list of one per rank."""
    check_stages(stages, cfg)
    if stages == 1:
        return [LayerSlice.whole(cfg)]
    profiles = hw if isinstance(hw, (list, tuple)) else [hw] * stages
    costs = [stage_costs(cfg, policy, prompt_len, gen_len, dtype_bytes, p) for p in profiles]
    return split_layers(cfg.num_layers, stages, [c[0] for c in costs], costs[0][1],
                        costs[-1][2])
