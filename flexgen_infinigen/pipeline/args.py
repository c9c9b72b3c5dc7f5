"""The pipeline's command-line flags and their checks (no process group needed)."""
from __future__ import annotations

import argparse

from ..config import ConfigError
from .link import DEFAULT_TIMEOUT_S, launched_world
from .partition import check_stages


def add_pipeline_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline parallelism (start one process per stage with torchrun)")
    g.add_argument("--pipeline-stages", type=int, default=1, metavar="N",
                   help="split the layers over N processes (GPUs or machines), each with its "
                        "own placement, offload folder and KV cache: `torchrun "
                        "--nproc-per-node N -m flexgen_infinigen.run --pipeline-stages N ...`")
    g.add_argument("--pipeline-micro-batches", type=int, default=None, metavar="K",
                   help="micro-batches in flight: the block's GPU batches cut into K groups "
                        "(default: one per GPU batch). Fewer, larger groups share each weight "
                        "load among more GPU batches; at least N keep every stage busy")
    g.add_argument("--pipeline-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="seconds a rank waits for another (a message, the start, the report) "
                        "before it stops with an error naming that rank (default "
                        f"{DEFAULT_TIMEOUT_S:g}); a rank that exits is noticed at once")


def check_pipeline_args(a) -> None:
    if a.pipeline_timeout <= 0:
        raise ConfigError(f"--pipeline-timeout must be positive (got {a.pipeline_timeout})")
    k = a.pipeline_micro_batches
    if k is not None and k < 1:
        raise ConfigError(f"--pipeline-micro-batches must be at least 1 (got {k})")
    world = launched_world()
    if a.pipeline_stages == 1 and (world or 1) > 1:
        raise ConfigError(f"{world} processes were launched but --pipeline-stages is 1; pass "
                          f"--pipeline-stages {world}")
    if a.pipeline_stages > 1 and world is None:
        raise ConfigError(f"--pipeline-stages {a.pipeline_stages} runs one process per stage: "
                          f"start it with `torchrun --nproc-per-node {a.pipeline_stages} -m "
                          f"flexgen_infinigen.run --pipeline-stages {a.pipeline_stages} ...`")
    check_stages(a.pipeline_stages, world=world)
    if a.pipeline_stages > 1 and "auto" in (a.gpu_batch_size, a.num_gpu_batches):
        raise ConfigError("--pipeline-stages needs a fixed --gpu-batch-size and "
                          "--num-gpu-batches (every rank runs the same GPU batches); "
                          "--percent auto plans each rank's placement")
    if a.pipeline_stages > 1:
        from .launch import rank_profiles
        rank_profiles(a.hw, a.pipeline_stages)
