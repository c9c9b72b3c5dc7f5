"""The model steps of ``gpu_check.py``: each loads what it measures, warms up, and reports the
median of its decode steps (the first steps pay cold allocations)."""
from __future__ import annotations

import dataclasses
import json
import statistics
import time
import traceback
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


def _measured(a, lm, prompts, gen: int, cut: int) -> tuple[object, dict]:
    """A warm-up generation, then the measured one: its decode steps' median and range, and
    the bytes a decode step moves over each link, by kind (the ledger of the measured run
    less that of a prefill-only run of the same prompts: a prefill moves every weight and
    expert it reads, which is not a step's)."""
    if not getattr(lm, "warmed_up", False) or not a.warm_once:
        lm.generate(prompts, WARM_UP_STEPS + 1, stop_token_id=None)
        lm.warmed_up = True
    lm.tiers.reset_counters()
    if lm.tiers.is_cuda:
        torch.cuda.reset_peak_memory_stats()
    out = lm.generate(prompts, gen, stop_token_id=None, cut_gen_len=cut)
    kv_report = lm.engine.kv_policy.report()  # before the prefill-only run starts it afresh
    peak = torch.cuda.max_memory_allocated() if lm.tiers.is_cuda else lm.tiers.peak["device"]
    planned = memory_plan.plan(lm.cfg, lm.engine.policy, lm.engine.dtype, len(prompts[0]),
                               gen, kv=lm.engine.kv_policy)["total"]
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
                 "host_syncs_per_step": syncs,
                 "kv_fetch_fraction": kv_report.get("kv_fetch_fraction"),
                 "relative_kv_size": kv_report.get("relative_kv_size", 1.0),
                 "speculation_time_s": kv_report.get("speculation_time_s"),
                 "peak_device_bytes": peak, "planned_device_bytes": planned["device"],
                 "planned_host_bytes": planned["host"]}


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


def _switch(lm, placement: Placement | None = None, **changes) -> None:
    """Run the next blocks of a loaded model under a changed placement (its weights stay
    where they are): overlap, the cache's tier and format, the GPU batch and where routed
    experts multiply are read when a block starts."""
    placement = dataclasses.replace(placement or lm.engine.policy, **changes)
    lm.engine.policy = placement
    lm.engine.compute.placement = placement


def _time_left(a) -> float:
    return a.until - time.time() if a.until else float("inf")


class _Rows:
    """A step's rows, written to ``<step>.partial.json`` after each one (a step stopped at its
    limit keeps what it measured), and whether the next one fits the time left: each takes
    about as long as the slowest so far."""

    def __init__(self, a, name: str):
        self.a, self.path, self.rows, self.skipped = a, Path(a.out) / f"{name}.partial.json", [], []
        self.slowest = 0.0

    def run(self, label: str, measure) -> None:
        if self.a.only and label not in self.a.only:
            return
        if self.rows and _time_left(self.a) < 1.3 * self.slowest + 15:
            self.skipped.append(label)
            print(f"skipped for time: {label}", flush=True)
            return
        start = time.time()
        try:
            row = {"label": label, **measure()}
        except Exception as e:  # one variant's error is a row; the others still run
            row = {"label": label, "error": repr(e), "traceback": traceback.format_exc()}
        row["seconds"] = time.time() - start
        self.slowest = max(self.slowest, row["seconds"])
        self.rows.append(row)
        self.path.write_text(json.dumps(self.rows, indent=1, default=str))
        print(json.dumps({k: v for k, v in row.items() if k != "bytes_per_step"},
                         default=str)[:600], flush=True)


# the paper's setting: (label, KV policy, its options, placement changes); the first four with
# the copies overlapped, the last four without, the step with no KV transfer between them
PAPER_VARIANTS = [
    ("full", "full", None, {}),
    ("infinigen", "infinigen", None, {}),
    ("no KV transfer (cache on the GPU)", "full", None,
     {"cache_gpu_percent": 100, "cache_cpu_percent": 0}),
    ("h2o 0.2", "h2o", {"hh_ratio": 0.1, "recent_ratio": 0.1}, {}),
    ("4-bit cache", "full", None, {"compress_cache": True}),
    ("full, no overlap", "full", None, {"overlap": False}),
    ("infinigen, no overlap", "infinigen", None, {"overlap": False}),
    ("h2o 0.2, no overlap", "h2o", {"hh_ratio": 0.1, "recent_ratio": 0.1}, {"overlap": False}),
    ("4-bit cache, no overlap", "full", None, {"compress_cache": True, "overlap": False}),
]


def step_paper(a) -> dict:
    """OPT-13B shapes, dummy weights, batch 20, prompt 1,920, 128 new tokens
    (``--cut-gen-len`` of them run), ``--percent 100 0 0 100 100 0``: one load, then each KV
    policy with the copies overlapped and not, and the step with the cache on the GPU."""
    model, b, prompt, gen, cut = (("opt-125m", 2, 64, 32, 3) if a.dry_run
                                  else ("opt-13b", 20, 1920, 128, a.cut_gen_len))
    base = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=b)
    peak, rows = _pinned_peak(a), _Rows(a, "paper")
    with _load(a, model, base) as lm:
        prompts = _prompts(lm, b, prompt)
        loaded = lm.engine.policy
        for label, kv, options, changes in PAPER_VARIANTS:
            def measure(kv=kv, options=options, changes=changes):
                from flexgen_infinigen.kv import make_kv_policy
                _switch(lm, loaded, **changes)
                lm.use_kv_policy(make_kv_policy(kv, **(options or {})))
                _, row = _measured(a, lm, prompts, gen, cut)
                row.update(kv_policy=kv, kv_options=options, placement_changes=changes,
                           pinned_host_exact=lm.tiers.pinned_bytes)
                return _against_link(row, peak)
            rows.run(label, measure)
    return {"model": model, "batch": b, "prompt_len": prompt, "gen_len": gen,
            "cut_gen_len": cut, "percent": "100 0 0 100 100 0", "runs": rows.rows,
            "skipped_for_time": rows.skipped}


def step_long(a) -> dict:
    """Llama-3.1-8B shapes, bf16, weights on the GPU, KV in CPU memory, 32K: full and
    InfiniGen (its defaults) at batch 1, then at batch 4 and 8 while time is left."""
    model, prompt, gen, cut = (("smollm2-135m", 256, 8, 3) if a.dry_run
                               else ("llama-3.1-8b", 32768, 16, 6))
    dtype = "float32" if a.dry_run else "bfloat16"
    base = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=1)
    peak, rows = _pinned_peak(a), _Rows(a, "long")
    with _load(a, model, base, dtype=dtype) as lm:
        from flexgen_infinigen.kv import make_kv_policy
        for b in (1, 4, 8):
            prompts = _prompts(lm, b, prompt)
            for kv in ("full", "infinigen"):
                def measure(b=b, kv=kv, prompts=prompts):
                    _switch(lm, gpu_batch_size=b)
                    lm.use_kv_policy(make_kv_policy(kv))
                    _, row = _measured(a, lm, prompts, gen, cut)
                    row.update(batch=b, kv_policy=kv)
                    return _against_link(row, peak)
                rows.run(f"{kv}, batch {b}", measure)
    return {"model": model, "prompt_len": prompt, "dtype": dtype, "gen_len": gen,
            "cut_gen_len": cut, "runs": rows.rows, "skipped_for_time": rows.skipped}


def _moe_model(a) -> str:
    """Qwen3-30B-A3B's layer shapes in 6 of its 48 layers, the vocabulary cut alike (bf16,
    ~7.5 GB), or a toy MoE for a dry run; registered under its name for ``--dummy`` loading."""
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
    """A MoE on the GPU: decode with every expert on the GPU (the ceiling), and with the
    routed experts in CPU memory, fetched when a token picks them or multiplied there by the
    CPU (``--cpu-expert-compute``: only the tokens' rows cross); attention, the router and the
    KV cache on the GPU in all; batch 1 and 8; expert bytes over the link per step against the
    measured pinned rate. Two loads: experts on the GPU, experts in CPU memory."""
    model = _moe_model(a)
    prompt, gen, cut = (64, 8, 4) if a.dry_run else (4096, 24, 12)
    dtype = "float32" if a.dry_run else "bfloat16"
    peak, rows = _pinned_peak(a), _Rows(a, "moe")
    for home, experts, computed in (("gpu", (100, 0), (False,)),
                                    ("cpu", (0, 100), (True, False))):
        policy = Placement.from_percent([100, 0, 100, 0, 100, 0], gpu_batch_size=1,
                                     expert_gpu_percent=experts[0],
                                     expert_cpu_percent=experts[1])
        with _load(a, model, policy, dtype=dtype) as lm:
            for b in (1, 8):
                prompts = _prompts(lm, b, prompt)
                for on_cpu in computed:
                    where = "gpu" if home == "gpu" else ("cpu-computed" if on_cpu
                                                         else "cpu-fetched")

                    def measure(b=b, on_cpu=on_cpu, prompts=prompts, where=where):
                        _switch(lm, gpu_batch_size=b, cpu_expert_compute=on_cpu)
                        _, row = _measured(a, lm, prompts, gen, cut)
                        per_step = row["bytes_per_step"] or {}
                        row.update(batch=b, experts=where,
                                   expert_bytes_per_step=per_step.get("host->device", {})
                                   .get("experts"),
                                   activation_bytes_to_host_per_step=per_step.get(
                                       "device->host", {}).get("activations"))
                        return _against_link(row, peak)
                    rows.run(f"experts {where}, batch {b}", measure)
    return {"model": model, "prompt_len": prompt, "gen_len": gen, "cut_gen_len": cut,
            "dtype": dtype, "runs": rows.rows, "skipped_for_time": rows.skipped}


def step_profile(a) -> dict:
    """torch.profiler over 3 InfiniGen decode steps (KV in CPU memory): kernels, copies and
    host synchronizations per step, and the ops that take the most device time."""
    from torch.profiler import ProfilerActivity, profile
    model, b, prompt = ("opt-125m", 2, 64) if a.dry_run else ("opt-1.3b", 8, 2040)
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
