"""Glue between the command lines and the optimizer: build the workload, pick the profile,
search, and render the result as a ``run`` command."""
from __future__ import annotations

import dataclasses
import shlex

from ..config import ConfigError, ModelConfig
from ..kv import policy_class
from ..placement import Placement
from .hardware import GB, HardwareProfile, load_profile
from .lp import BATCH_SIZES, NUM_BATCHES, Plan, optimize
from .workload import Workload


def default_kv_fraction(kv_policy: str) -> float:
    """The fraction a plannable policy reads at its default settings."""
    return policy_class(kv_policy, plannable=True)().kv_fraction


def check_possible(cfg: ModelConfig, prompt_len: int, gen_len: int, item: int,
                   offload_dir: str | None = None, gpu_mem: float | None = None,
                   cpu_mem: float | None = None, disk_mem: float | None = None) -> None:
    """One error, before any profiling, when even the leanest placement (batch 1, weights
    and cache on disk) cannot fit in this machine's free memory and disk together."""
    import torch

    from ..placement import Placement
    from ..engine.loading import resolve_device
    from ..engine.memory_plan import GIB, available, plan

    dtype = {2: torch.float16, 4: torch.float32}.get(item, torch.float16)
    lean = Placement.from_percent([0, 0, 0, 0, 100, 0])
    need = sum(plan(cfg, lean, dtype, prompt_len, gen_len)["total"].values())
    dev = resolve_device("auto")
    have = available(dev, offload_dir)
    given = [None if v is None else v * GB for v in (gpu_mem, cpu_mem, disk_mem)]  # GB flags
    free = [given[0] if given[0] is not None else have["device"] if dev.type == "cuda" else 0,
            given[1] if given[1] is not None else have["host"],
            given[2] if given[2] is not None else have["disk"]]
    if need > sum(free):
        raise ConfigError(
            f"{cfg.name} at prompt {prompt_len} + gen {gen_len} needs at least "
            f"{need / GIB:.1f} GiB (weights and KV cache at batch 1), but GPU, CPU memory and "
            f"disk have {sum(free) / GIB:.1f} GiB free together; free disk space under "
            "--offload-dir or pick a smaller model")


def profile_for(hw: str | None, gpu_mem: float | None = None, cpu_mem: float | None = None,
                disk_mem: float | None = None, offload_dir: str | None = None) -> HardwareProfile:
    """The named or saved profile; for this machine's own profile, memory as free right now."""
    if hw is None:  # this machine: its saved profile, else measured now (the quick profile)
        from .measure import cached_profile
        prof = cached_profile()
    else:
        prof = load_profile(hw)
    if hw is None:
        from ..engine.loading import resolve_device
        from ..engine.memory_plan import available
        dev = resolve_device("auto")
        have = available(dev, offload_dir)
        prof = dataclasses.replace(prof, gpu_mem=float(have["device"]),
                                   cpu_mem=float(have["host"]), disk_mem=float(have["disk"]))
    return prof.with_memory(gpu_mem, cpu_mem, disk_mem)


def search(cfg: ModelConfig, prompt_len: int, gen_len: int, hw: HardwareProfile,
           base: Placement, kv_policy: str = "full", kv_fraction: float | None = None,
           gpu_batch_size: int | None = None, num_gpu_batches: int | None = None,
           dtype_bytes: int | None = None, progress: bool = True,
           fixed_placement: bool = False, weight_reads: int = 1) -> tuple[Plan, list[Plan]]:
    """Best plan with the batch shape searched where ``gpu_batch_size``/``num_gpu_batches``
    are None and fixed where given; the placement is ``base``'s with ``fixed_placement``,
    else chosen by the linear program. ``weight_reads``: times a step reads each offloaded
    weight (a pipeline rank: once per micro-batch)."""
    if kv_fraction is None:
        kv_fraction = default_kv_fraction(kv_policy)
    work = Workload(cfg, prompt_len, gen_len, dtype_bytes or hw.dtype_bytes, kv_policy,
                    kv_fraction, weight_reads).validate()
    for flag, v in (("--gpu-batch-size", gpu_batch_size), ("--num-gpu-batches", num_gpu_batches)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be at least 1 or auto (got {v})")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        def bar(shapes):
            return tqdm(shapes, desc="optimizing", unit="shape", leave=False)
    return optimize(work, hw, base,
                    batch_sizes=(gpu_batch_size,) if gpu_batch_size else BATCH_SIZES,
                    num_batches=(num_gpu_batches,) if num_gpu_batches else NUM_BATCHES,
                    fixed_placement=fixed_placement, progress=bar)


def run_command(plan: Plan, model: str, prompt_len: int, gen_len: int, kv_policy: str) -> str:
    p = plan.policy
    args = ["python", "-m", "flexgen_infinigen.run", "--model", model,
            "--percent", *map(str, plan.percent()),
            "--gpu-batch-size", str(p.gpu_batch_size), "--num-gpu-batches", str(p.num_gpu_batches),
            "--prompt-len", str(prompt_len), "--gen-len", str(gen_len)]
    if plan.experts_percent() is not None:
        args += ["--experts-percent", *map(str, plan.experts_percent())]
    for flag, on in (("--cpu-cache-compute", p.cpu_cache_compute),
                     ("--cpu-expert-compute", p.cpu_expert_compute),
                     ("--compress-weight", p.compress_weight),
                     ("--compress-cache", p.compress_cache)):
        if on:
            args.append(flag)
    if kv_policy != "full":
        args += ["--kv-policy", kv_policy]  # at its default settings
    return " ".join(shlex.quote(a) for a in args)


def summary(plan: Plan) -> dict:
    pred, p = plan.prediction, plan.policy
    return {"percent": plan.percent(), "experts_percent": plan.experts_percent(),
            "experts": pred.get("experts"), "gpu_batch_size": p.gpu_batch_size,
            "num_gpu_batches": p.num_gpu_batches, "cpu_cache_compute": p.cpu_cache_compute,
            "cpu_expert_compute": p.cpu_expert_compute,
            "compress_weight": p.compress_weight, "compress_cache": p.compress_cache,
            "predicted_throughput": pred["throughput"],
            "predicted_decode_throughput": pred["decode_throughput"],
            "predicted_prefill_s": pred["prefill_s"], "predicted_decode_step_s":
                pred["decode_step_s"], "predicted_total_s": pred["total_s"],
            "memory_bytes": pred["memory_bytes"], "decode_terms_s": pred["decode_terms_s"],
            "lp_fractions": plan.lp_fractions}


def describe(plan: Plan, hw: HardwareProfile) -> str:
    pred, p = plan.prediction, plan.policy
    mem = pred["memory_bytes"]
    limits = {"device": hw.gpu_mem, "host": hw.cpu_mem, "disk": hw.disk_mem}
    experts = plan.experts_percent()
    lines = [f"  --percent {' '.join(map(str, plan.percent()))}"
             + (f"  --experts-percent {' '.join(map(str, experts))}" if experts else "")
             + f"  --gpu-batch-size {p.gpu_batch_size}  --num-gpu-batches {p.num_gpu_batches}"
             + ("  --cpu-cache-compute" if p.cpu_cache_compute else "")
             + ("  --cpu-expert-compute" if p.cpu_expert_compute else ""),
             f"  predicted: {pred['throughput']:.2f} tokens/s overall, "
             f"{pred['decode_throughput']:.2f} tokens/s decoding; "
             f"prefill {pred['prefill_s']:.2f} s, decode step {pred['decode_step_s'] * 1e3:.1f} ms",
             "  memory: " + ", ".join(f"{t} {mem[t] / GB:.2f} of {limits[t] / GB:.1f} GB"
                                      for t in ("device", "host", "disk"))
             + (" (device and host share one memory)" if hw.shared_memory else ""),
             "  decode step by resource: " + ", ".join(
                 f"{k} {v * 1e3:.1f} ms" for k, v in pred["decode_terms_s"].items() if v > 0)
             + (" (overlapped: the largest counts)" if pred["overlapped"] else " (summed)")]
    if pred.get("experts"):
        e = pred["experts"]
        lines.append(f"  experts per decode step: {e['coverage_per_step']:.1f} per MoE layer "
                     f"({e['bytes_per_step'] / GB:.2f} GB, "
                     f"{e['off_device_bytes_per_step'] / GB:.2f} GB off the device); "
                     f"the CPU would multiply them where they are in "
                     f"{e['cpu_compute_s'] * 1e3:.1f} ms (the runtime fetches them)")
    return "\n".join(lines)
