"""``run --pipeline-stages N`` on one rank: join the group, load this rank's layers, run the
prompts rank 0 chose, and gather every rank's figures into rank 0's report.

Any error on a rank ends that rank at once (exit status 1, or 2 for a bad argument) after
its own clean-up, with one line naming the rank; the others notice within
``--pipeline-timeout`` (at once when the failed rank's process is gone).
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

from ..switches import LOCAL_RANK
from ..config import DEFAULT_MODEL, ConfigError
from ..guards import Terminated
from ..engine.loading import resolve_device, resolve_dtype
from .engine import micro_batches, rank_engine
from .link import Link
from .partition import check_stages, plan_slices
from .report import combine_reports, rank_summary


def model_config(a):
    """The model's configuration without reading any weight (the store's own, for --path)."""
    if a.path:
        from ..engine.loading import find_weights
        return find_weights(a.model, a.path, False, progress=False)[0]
    from ..engine.loading import model_config as config_of
    return config_of(a.model, shapes_only=a.dummy)


def run_pipeline(a, texts: list[str]) -> int:
    cfg = model_config(a)
    check_stages(a.pipeline_stages, cfg)  # more stages than layers: refused before joining
    device = resolve_device(a.device)
    if device.type == "cuda":
        local = LOCAL_RANK.get() or 0
        if local >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local} needs GPU {local} but this machine shows "
                              f"{torch.cuda.device_count()}; start at most that many processes "
                              "per machine (--nproc-per-node)")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    link = Link(device, a.pipeline_timeout)
    code = 1
    try:
        code = _run_rank(a, texts, cfg, link)
    except BaseException as e:  # noqa: BLE001 - every failure ends this rank the same way
        link.record_failure(e)
        code = _explain(e, link.rank)
    if code != 0:
        # the process group may still wait on ranks that are gone: leave without it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    link.close()
    return 0


def _explain(error: BaseException, rank: int) -> int:
    if isinstance(error, ConfigError):
        print(f"error: [rank {rank}] {error}", file=sys.stderr)
        return 2
    if isinstance(error, (KeyboardInterrupt, Terminated)):
        print(f"[rank {rank}] stopped (signal); temporary files removed", file=sys.stderr)
        return 130 if isinstance(error, KeyboardInterrupt) else 143
    import traceback
    if not isinstance(error, RuntimeError) or "pipeline rank" not in str(error):
        traceback.print_exc()
    print(f"error: [rank {rank}] {error}", file=sys.stderr)
    return 1


def _run_rank(a, texts: list[str], cfg, link: Link) -> int:
    from ..api import OffloadedLM
    from ..cli.args import policy_from_args, wants_plan, write_json
    from ..cli.prompts import make_prompts
    from ..cli.report import print_report
    from ..kv import kv_policy_from_args
    from ..placement import Placement
    from ..engine.loading import find_weights
    from ..sampling import SamplingConfig

    kv = kv_policy_from_args(a)
    sampling = SamplingConfig(a.temperature, a.top_p, a.seed, a.repetition_penalty).validate()
    model = a.model if (a.model or a.path) else DEFAULT_MODEL
    first = LOCAL_RANK.get() if LOCAL_RANK.is_set() else link.rank
    if first == 0:  # one rank per machine converts
        find_weights(model, a.path, a.dummy, a.seed, progress=True)  # the default model
    link.barrier("waiting for each machine's first rank to find the weights")
    item = resolve_dtype(a.dtype, link.device).itemsize
    lengths = (a.prompt_len, a.gen_len)
    base, _ = policy_from_args(a) if not wants_plan(a) else (None, None)
    specs = rank_profiles(a.hw, link.world)
    parts = None
    if link.is_first:  # one split for all: the ranks' saved profiles may differ
        parts = plan_slices(cfg, link.world, base or Placement(), *lengths, item, _profiles(specs))
    part = link.broadcast(parts, "receiving rank 0's split of the layers")[link.rank]
    plan = None
    if wants_plan(a):  # each rank plans its own layers, on its own machine's profile
        if a.hw is None:
            raise ConfigError("--percent auto with --pipeline-stages needs --hw (a profile "
                              "from `python -m flexgen_infinigen.profile --out FILE`, or a "
                              "built-in name; one for all ranks, or one per rank separated "
                              "by commas)")
        a.hw = specs[link.rank]
        mine = dataclasses.replace(cfg, num_layers=len(part.layers))
        groups = micro_batches(a.num_gpu_batches or 1, a.pipeline_micro_batches)
        base, plan = policy_from_args(a, mine, lengths, weight_reads=len(groups))
    lm = OffloadedLM.load(model=model, path=a.path, dummy=a.dummy, policy=base,
                          device=str(link.device.type), dtype=a.dtype, kv_policy=kv,
                          offload_dir=a.offload_dir, seed=a.seed,
                          max_len_hint=None if texts else lengths, part=part,
                          make_engine=rank_engine(link), progress=link.is_first)
    with lm:
        lm.engine.micro_batches = a.pipeline_micro_batches
        shape = (lm.policy.gpu_batch_size, lm.policy.num_gpu_batches, a.pipeline_micro_batches)
        prompts, first = link.broadcast((make_prompts(lm, a, texts), shape) if link.is_first
                                        else None, "receiving rank 0's prompts")
        if first != shape:
            raise ConfigError(f"rank {link.rank} runs GPU batches of {shape[0]} x {shape[1]} "
                              f"(micro-batches {shape[2]}) but rank 0 runs {first[0]} x "
                              f"{first[1]} ({first[2]}): give every rank the same "
                              "--gpu-batch-size, --num-gpu-batches and "
                              "--pipeline-micro-batches")
        gen = lm.generate(prompts, a.gen_len, sampling, stop_token_id=None if a.no_stop else -1,
                          cut_gen_len=a.cut_gen_len, progress=link.is_first)
        summaries = link.gather(rank_summary(lm, gen, link, plan))
        report = combine_reports(lm, gen, summaries) if link.is_first else None
    if report is not None:
        print_report(report)
        write_json(a.json, report)
    return 0


def rank_profiles(hw: str | None, world: int) -> list[str | None]:
    """``--hw`` per rank: one profile for every rank, or one per rank separated by commas."""
    specs = hw.split(",") if hw else [None]
    if len(specs) == 1:
        return specs * world
    if len(specs) != world:
        raise ConfigError(f"--hw names {len(specs)} profiles for {world} ranks; give one for "
                          "every rank, or one per rank in rank order separated by commas")
    return specs


def _profiles(specs: list[str | None]):
    """The hardware profiles the layers are balanced with: each rank's ``--hw``, else this
    machine's saved profile, else a built-in one (only the ratio of a layer's time to the
    ends' matters then)."""
    from ..planner.hardware import BUILTIN, load_profile
    from ..planner.measure import saved_profile

    fallback = None
    out = []
    for spec in specs:
        if spec:
            out.append(load_profile(spec))
            continue
        fallback = fallback or saved_profile() or BUILTIN["t4-pcie3"]
        out.append(fallback)
    return out
