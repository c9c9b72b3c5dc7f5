"""The model steps of ``gpu_check.py``: each loads what it measures, warms up, and reports the
median of its decode steps (the first steps pay cold allocations)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.engine import memory_plan

GB = 1e9
WARM_UP_STEPS = 3  # decode steps run once, not measured: pinned staging, allocator, autotuning


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _load(a, model: str, policy: Placement, kv: str = "full", dtype: str | None = None,
          kv_options: dict | None = None) -> OffloadedLM:
    return OffloadedLM.load(model=model, dummy=True, policy=policy, device=str(a.device),
                            kv_policy=kv, kv_options=kv_options, dtype=dtype,
                            progress=not a.dry_run)


def _prompts(lm, b: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(10, lm.cfg.vocab_size, (b, length), generator=gen).tolist()


def _measured(lm, prompts, gen: int, cut: int) -> tuple[object, dict]:
    """A warm-up generation, then the measured one: its decode steps' median and range, and
    the bytes a decode step moves over each link, by kind (the ledger of the measured run
    less that of a prefill-only run of the same prompts: a prefill moves every weight and
    expert it reads, which is not a step's)."""
    lm.generate(prompts, WARM_UP_STEPS + 1, stop_token_id=None)
    lm.tiers.reset_counters()
    out = lm.generate(prompts, gen, stop_token_id=None, cut_gen_len=cut)
    whole = {link: dict(kinds) for link, kinds in lm.tiers.bytes_moved.items()}
    syncs = lm.engine.debug["host_syncs_per_step"][1:]
    lm.tiers.reset_counters()
    lm.generate(prompts, 1, stop_token_id=None)
    prefill = lm.tiers.bytes_moved
    steps = out.step_times[1:]
    b = len(prompts)
    median = statistics.median(steps) if steps else None
    per_step = {link: {kind: (n - prefill[link][kind]) / len(steps) for kind, n in kinds.items()}
                for link, kinds in whole.items()} if steps else None
    return out, {"decode_steps_run": len(steps), "decode_step_median_s": median,
                 "decode_step_range_s": [min(steps), max(steps)] if steps else None,
                 "decode_tokens_per_s": b / median if median else None,
                 "prefill_s": out.step_times[0],
                 "host_to_device_bytes_per_step":
                     sum(per_step["host->device"].values()) if steps else None,
                 "bytes_per_step": per_step,
                 "host_syncs_per_step": syncs}


def _pinned_peak(a) -> float | None:
    """The bandwidth step's pinned host-to-device rate, when it ran earlier into ``--out``."""
    path = Path(a.out) / "bandwidth.json"
    try:
        return json.loads(path.read_text())["result"]["pinned"]["gb_per_s"]
    except (OSError, KeyError, ValueError, TypeError):
        return None


def _against_link(row: dict, peak: float | None) -> dict:
    """The step's transfer-bound time (its bytes at the measured pinned rate) and how far the
    measured step is from it."""
    bytes_ = row.get("host_to_device_bytes_per_step")
    if peak and bytes_ is not None and row.get("decode_step_median_s"):
        bound = bytes_ / (peak * GB)
        row.update(link_bound_s=bound, step_over_link_bound=row["decode_step_median_s"] / bound
                   if bound else None)
    row["pinned_gb_per_s"] = peak
    return row


# ---- steps -----------------------------------------------------------------------------------
def step_bandwidth(a) -> dict:
    size = (16 if a.dry_run else 1024) << 20
    dev = a.device
    results = {}
    for pinned in (True, False):
        src = torch.empty(size, dtype=torch.uint8, pin_memory=pinned and dev.type == "cuda")
        dst = torch.empty(size, dtype=torch.uint8, device=dev)
        dst.copy_(src, non_blocking=pinned)  # warm-up
        times = []
        for _ in range(7):
            _sync(dev)
            t0 = _now()
            dst.copy_(src, non_blocking=pinned)
            _sync(dev)
            times.append(_now() - t0)
        median = statistics.median(times)
        results["pinned" if pinned else "pageable"] = {"bytes": size, "gb_per_s": size / median
                                                       / GB, "best_gb_per_s": size / min(times)
                                                       / GB}
    return results


def _now() -> float:
    import time
    return time.perf_counter()


def step_overlap(a) -> dict:
    """Share of host-to-device copy time that runs while a compute kernel runs."""
    from torch.profiler import ProfilerActivity, profile
    model, b, prompt, steps = ("opt-125m", 2, 32, 3) if a.dry_run else ("opt-1.3b", 8, 512, 8)
    policy = Placement.from_percent([0, 100, 100, 0, 100, 0], gpu_batch_size=b)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.cuda else [])
    with _load(a, model, policy) as lm:
        prompts = _prompts(lm, b, prompt)
        lm.generate(prompts, WARM_UP_STEPS, stop_token_id=None)
        with profile(activities=activities) as prof:
            gen = lm.generate(prompts, steps, stop_token_id=None)
    copies, kernels = [], []
    for e in prof.events():
        if a.cuda and e.device_type.name != "CUDA":
            continue
        span = (e.time_range.start, e.time_range.end)
        if "memcpy" in e.name.lower() and "htod" in e.name.lower().replace(" ", ""):
            copies.append(span)
        elif not a.cuda and e.name.startswith("aten::copy_"):
            copies.append(span)
        elif "memcpy" not in e.name.lower() and "memset" not in e.name.lower():
            kernels.append(span)
    busy = _union(kernels)
    copy_total = sum(end - start for start, end in copies)
    hidden = sum(_overlap(c, busy) for c in copies)
    return {"model": model, "policy": "--percent 0 100 100 0 100 0", "batch": b,
            "prompt_len": prompt, "steps": steps, "copy_us": copy_total, "hidden_us": hidden,
            "hidden_share": hidden / copy_total if copy_total else None,
            "decode_step_median_s": statistics.median(gen.step_times[1:]),
            "note": "CUDA kernels and Memcpy HtoD from the profiler" if a.cuda else
            "dry run: CPU ops only (no streams), so the share means nothing here"}


def step_memory(a) -> dict:
    """Planned against actual peak device memory and pinned host bytes, three policies."""
    model, b, prompt, gen = ("opt-125m", 2, 32, 4) if a.dry_run else ("opt-1.3b", 8, 512, 8)
    rows = []
    for name, percent, kv in [("all on GPU, full", [100, 0, 100, 0, 100, 0], "full"),
                              ("weights + cache on CPU, full", [0, 100, 0, 100, 100, 0], "full"),
                              ("cache on CPU, InfiniGen", [100, 0, 0, 100, 100, 0], "infinigen")]:
        policy = Placement.from_percent(percent, gpu_batch_size=b)
        with _load(a, model, policy, kv) as lm:
            planned = memory_plan.plan(lm.cfg, lm.policy, lm.engine.dtype, prompt, gen,
                                       kv=lm.engine.kv_policy)
            lm.generate(_prompts(lm, b, prompt), gen, stop_token_id=None)
            peak = (torch.cuda.max_memory_allocated() if a.cuda else lm.tiers.peak["device"])
            rows.append({"policy": name, "planned_device": planned["total"]["device"],
                         "actual_peak_device": peak,
                         "planned_host": planned["total"]["host"],
                         "pinned_host_exact": lm.tiers.pinned_bytes,
                         "held_host": lm.tiers.peak["host"],
                         "within_plan": peak <= planned["total"]["device"]})
    return {"model": model, "batch": b, "prompt_len": prompt, "gen_len": gen, "runs": rows}


def _paper_run(a, kv: str, percent: list[int]) -> dict:
    """OPT-13B shapes, dummy weights, batch 20, prompt 1,920 (128 new tokens, ``--cut-gen-len``
    of them run); one load per call, so that each fits a 10-minute call."""
    model, b, prompt, gen, cut = (("opt-125m", 2, 64, 32, 3) if a.dry_run
                                  else ("opt-13b", 20, 1920, 128, a.cut_gen_len))
    policy = Placement.from_percent(percent, gpu_batch_size=b)
    with _load(a, model, policy, kv) as lm:
        _, row = _measured(lm, _prompts(lm, b, prompt), gen, cut)
        report = lm.engine.kv_policy.report()
        row.update(kv_policy=kv, relative_kv_size=report.get("relative_kv_size", 1.0),
                   kv_fetch_fraction=report.get("kv_fetch_fraction"),
                   speculation_time_s=report.get("speculation_time_s"),
                   pinned_host_exact=lm.tiers.pinned_bytes)
    return {"model": model, "batch": b, "prompt_len": prompt, "gen_len": gen,
            "cut_gen_len": cut, "percent": " ".join(map(str, percent)),
            "run": _against_link(row, _pinned_peak(a))}


def paper(kv: str):
    def step(a) -> dict:
        return _paper_run(a, kv, [100, 0, 0, 100, 100, 0])
    step.__doc__ = f"the paper's setting, KV cache in CPU memory, {kv}"
    return step


def paper_no_kv(a) -> dict:
    """The paper's setting with the KV cache on the GPU: the step with no KV transfer, which
    InfiniGen's step is compared against (the goal: within 1.3x of it)."""
    return _paper_run(a, "full", [100, 0, 100, 0, 100, 0])


def long_context(kv: str):
    def step(a) -> dict:
        """Llama-3.1-8B shapes, bf16, weights on the GPU, KV in CPU memory, 32K, batch 1."""
        model, b, prompt, gen, cut = (("smollm2-135m", 1, 256, 8, 3) if a.dry_run
                                      else ("llama-3.1-8b", 1, 32768, 16, 6))
        dtype = "float32" if a.dry_run else "bfloat16"
        policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=b)
        options = {"max_kv_fraction": 0.18, "first_layer": 2} if kv == "infinigen" else None
        with _load(a, model, policy, kv, dtype=dtype, kv_options=options) as lm:
            _, row = _measured(lm, _prompts(lm, b, prompt), gen, cut)
            row["kv_policy"] = kv
            row["kv_fetch_fraction"] = lm.engine.kv_policy.report().get("kv_fetch_fraction")
        return {"model": model, "batch": b, "prompt_len": prompt, "dtype": dtype,
                "run": _against_link(row, _pinned_peak(a))}
    return step


def _moe_model(a) -> str:
    """Qwen3-30B-A3B's layer shapes in 6 of its 48 layers, the vocabulary cut alike (bf16,
    ~7.5 GB: four loads of it fit one step's time limit), or a toy MoE for a dry run;
    registered under its name for ``--dummy`` loading."""
    import dataclasses

    from flexgen_infinigen.config import KNOWN_MODELS, get_config
    full = get_config("qwen3-30b-a3b")
    if a.dry_run:
        cfg = dataclasses.replace(full, name="gpu-check-toy-moe", vocab_size=1024,
                                  hidden_size=256, intermediate_size=512, num_layers=2,
                                  num_heads=4, num_kv_heads=2, attn_head_dim=64,
                                  num_experts=16, experts_per_token=4,
                                  expert_intermediate_size=128)
    else:
        layers = 6
        cfg = dataclasses.replace(full, name=f"qwen3-30b-a3b-{layers}-of-48-layers",
                                  num_layers=layers,
                                  vocab_size=round(full.vocab_size * layers / 48 / 64) * 64)
    KNOWN_MODELS[cfg.name] = cfg
    return cfg.name


def step_moe(a) -> dict:
    """A MoE on the GPU (MoE issue): decode with every expert on the GPU (the ceiling) and
    with the routed experts in CPU memory, fetched when a token picks them (attention, the
    router and the KV cache on the GPU in both), at batch 1 and 8; expert bytes over the link
    per step against the measured pinned rate; and with those experts multiplied in CPU memory
    by the CPU (``--cpu-expert-compute``: only the tokens' rows cross)."""
    model = _moe_model(a)
    prompt, gen, cut = (64, 8, 4) if a.dry_run else (4096, 24, 12)
    dtype = "float32" if a.dry_run else "bfloat16"
    peak, rows = _pinned_peak(a), []
    for b in (1, 8):
        for where, experts, on_cpu in (("gpu", (100, 0), False),
                                       ("cpu-fetched", (0, 100), False),
                                       ("cpu-computed", (0, 100), True)):
            policy = Placement.from_percent([100, 0, 100, 0, 100, 0], gpu_batch_size=b,
                                         expert_gpu_percent=experts[0],
                                         expert_cpu_percent=experts[1],
                                         cpu_expert_compute=on_cpu)
            with _load(a, model, policy, dtype=dtype) as lm:
                prompts = _prompts(lm, b, prompt)
                _, row = _measured(lm, prompts, gen, cut)
                per_step = row["bytes_per_step"] or {}
                row.update(batch=b, experts=where,
                           expert_bytes_per_step=per_step.get("host->device", {}).get("experts"),
                           activation_bytes_to_host_per_step=per_step.get(
                               "device->host", {}).get("activations"))
            rows.append(_against_link(row, peak))
    return {"model": model, "prompt_len": prompt, "gen_len": gen, "cut_gen_len": cut,
            "dtype": dtype, "runs": rows}


def step_profile(a) -> dict:
    """torch.profiler over 3 InfiniGen decode steps (KV in CPU memory): kernels, copies and
    host synchronizations per step, and the ops that take the most device time."""
    from torch.profiler import ProfilerActivity, profile
    model, b, prompt = ("opt-125m", 2, 64) if a.dry_run else ("opt-1.3b", 8, 2048)
    steps = 3
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=b)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.cuda else [])
    with _load(a, model, policy, "infinigen") as lm:
        prompts = _prompts(lm, b, prompt)
        lm.generate(prompts, WARM_UP_STEPS + 1, stop_token_id=None)
        counts = []
        for tokens in (1, steps + 1):  # the prefill alone, then with the steps: the difference
            with profile(activities=activities) as prof:
                gen = lm.generate(prompts, tokens, stop_token_id=None)
            counts.append(_profile_counts(prof, a.cuda))
    per_step = {k: (counts[1][k] - counts[0][k]) / steps for k in counts[0]}
    sort = "cuda_time_total" if a.cuda else "cpu_time_total"
    return {"model": model, "batch": b, "prompt_len": prompt, "profiled_decode_steps": steps,
            "per_step": per_step, "decode_step_median_s": statistics.median(gen.step_times[1:]),
            "table (prefill and the steps)": prof.key_averages().table(sort_by=sort,
                                                                       row_limit=25)}


def _profile_counts(prof, cuda: bool) -> dict:
    """Device kernels, copies each way, host synchronizations and aten ops in a profile."""
    names = [e.name.lower() for e in prof.events() if cuda and e.device_type.name == "CUDA"]
    host = [e.name for e in prof.events()]
    return {
        "kernels": sum("memcpy" not in n and "memset" not in n for n in names),
        "memcpy_htod": sum("memcpy" in n and "htod" in n.replace(" ", "") for n in names),
        "memcpy_dtoh": sum("memcpy" in n and "dtoh" in n.replace(" ", "") for n in names),
        "host_syncs": sum(n in ("cudaStreamSynchronize", "cudaEventSynchronize",
                                "cudaDeviceSynchronize") for n in host),
        "aten_ops": sum(n.startswith("aten::") for n in host),
    }


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [tuple(s) for s in out]


def _overlap(span: tuple[float, float], busy: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(span[1], e) - max(span[0], s)) for s, e in busy)
