"""One-call GPU check: the CUDA tests, host-to-device bandwidth, how much copy time hides
under compute, planned against actual peak memory, and the paper's OPT-13B setting.

    scripts/gpu_check.sh                      # on a GPU machine, well under 10 minutes
    scripts/gpu_check.sh --dry-run --out DIR  # on a CPU: every step at toy sizes

Each step writes ``<step>.json`` under ``--out`` (default ``benchmarks/results/gpu_check``)
with the machine (device name, driver, torch version); a step that fails records its error
and the next one still runs. Needs torch and numpy only (no pulp, no gguf: dummy weights).
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flexgen_infinigen import OffloadedLM, Policy  # noqa: E402
from flexgen_infinigen.kv import make_kv_policy  # noqa: E402
from flexgen_infinigen.runtime import memory_plan  # noqa: E402

GB = 1e9


def machine() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30)
            info["driver"] = out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info["device"], info["driver"] = "cpu (dry run)", None
    return info


# ---- steps -----------------------------------------------------------------------------------
def step_tests(a) -> dict:
    args = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/test_cuda.py"]
    if a.dry_run:
        args.append("--collect-only")
    start = time.perf_counter()
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=a.test_timeout)
    return {"command": " ".join(args[1:]), "returncode": out.returncode,
            "seconds": time.perf_counter() - start, "tail": out.stdout[-4000:]}


def step_bandwidth(a) -> dict:
    size = (16 if a.dry_run else 1024) << 20
    dev = a.device
    results = {}
    for pinned in (True, False):
        src = torch.empty(size, dtype=torch.uint8, pin_memory=pinned and dev.type == "cuda")
        dst = torch.empty(size, dtype=torch.uint8, device=dev)
        times = []
        for _ in range(5):
            _sync(dev)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=pinned)
            _sync(dev)
            times.append(time.perf_counter() - start)
        results["pinned" if pinned else "pageable"] = {"bytes": size,
                                                       "gb_per_s": size / min(times) / GB}
    return results


def step_overlap(a) -> dict:
    """Share of host-to-device copy time that runs while a compute kernel runs."""
    from torch.profiler import ProfilerActivity, profile
    model, b, prompt, steps = ("opt-125m", 2, 32, 3) if a.dry_run else ("opt-1.3b", 8, 512, 8)
    policy = Policy.from_percent([0, 100, 100, 0, 100, 0], gpu_batch_size=b)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.cuda else [])
    with _load(a, model, policy) as lm:
        prompts = _prompts(lm, b, prompt)
        lm.generate(prompts, 2, stop_token_id=None)  # warm-up
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
            "decode_latency_s": gen.decode_latency_s,
            "note": "CUDA kernels and Memcpy HtoD from the profiler" if a.cuda else
            "dry run: CPU ops only (no streams), so the share means nothing here"}


def step_memory(a) -> dict:
    """Planned against actual peak device memory and pinned host bytes, three policies."""
    model, b, prompt, gen = ("opt-125m", 2, 32, 4) if a.dry_run else ("opt-1.3b", 8, 512, 8)
    rows = []
    for name, percent, kv in [("all on GPU, full", [100, 0, 100, 0, 100, 0], "full"),
                              ("weights + cache on CPU, full", [0, 100, 0, 100, 100, 0], "full"),
                              ("cache on CPU, InfiniGen", [100, 0, 0, 100, 100, 0], "infinigen")]:
        policy = Policy.from_percent(percent, gpu_batch_size=b)
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


def step_paper(a, bandwidth: dict | None) -> dict:
    """OPT-13B shapes, dummy weights, batch 20, prompt 1,920, KV cache in CPU memory."""
    model, b, prompt, gen, cut = (("opt-125m", 2, 64, 32, 3) if a.dry_run
                                  else ("opt-13b", 20, 1920, 128, a.cut_gen_len))
    policy = Policy.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=b)
    rows = []
    with _load(a, model, policy, "full") as lm:
        prompts = _prompts(lm, b, prompt)
        for kv in ("full", "infinigen"):
            if kv != "full":  # same weights: swap the KV policy rather than load 26 GB again
                lm.use_kv_policy(make_kv_policy(kv))
            lm.tiers.reset_counters()
            out = lm.generate(prompts, gen, stop_token_id=None, cut_gen_len=cut)
            steps = len(out.step_times) - 1
            decode_s = sum(out.step_times[1:])
            h2d = sum(lm.tiers.bytes_moved["host->device"].values())
            report = lm.engine.kv_policy.report()
            rows.append({"kv_policy": kv, "decode_steps_run": steps,
                         "decode_tokens_per_s": b * steps / decode_s,
                         "prefill_s": out.step_times[0],
                         "host_to_device_gb_per_s": h2d / decode_s / GB if steps else None,
                         "relative_kv_size": report.get("relative_kv_size", 1.0),
                         "speculation_time_s": report.get("speculation_time_s"),
                         "host_syncs_per_step": lm.engine.debug["host_syncs_per_step"]})
    peak = (bandwidth or {}).get("pinned", {}).get("gb_per_s")
    for r in rows:
        r["share_of_measured_pinned_peak"] = (r["host_to_device_gb_per_s"] / peak
                                              if peak and r["host_to_device_gb_per_s"] else None)
    speedup = rows[1]["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
    return {"model": model, "batch": b, "prompt_len": prompt, "gen_len": gen,
            "cut_gen_len": cut, "percent": "100 0 0 100 100 0", "runs": rows,
            "infinigen_over_full": speedup}


# ---- helpers ---------------------------------------------------------------------------------
def _load(a, model: str, policy: Policy, kv: str = "full") -> OffloadedLM:
    return OffloadedLM.load(model=model, dummy=True, policy=policy, device=str(a.device),
                            kv_policy=kv, progress=not a.dry_run)


def _prompts(lm, b: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(10, lm.cfg.vocab_size, (b, length), generator=gen).tolist()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


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


STEPS = ("tests", "bandwidth", "overlap", "memory", "paper")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="on a CPU, run every step at toy sizes (proves the script reaches them)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check"))
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    p.add_argument("--cut-gen-len", type=int, default=8,
                   help="decode steps run in the OPT-13B setting (projected to 128)")
    p.add_argument("--test-timeout", type=int, default=240)
    a = p.parse_args(argv)
    a.cuda = torch.cuda.is_available() and not a.dry_run
    if not a.cuda and not a.dry_run:
        print("error: no CUDA device is visible; run with --dry-run on a CPU", file=sys.stderr)
        return 2
    a.device = torch.device("cuda" if a.cuda else "cpu")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info, results, failed = machine(), {}, []
    for name in a.steps:
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            fn = globals()[f"step_{name}"]
            result = fn(a, results.get("bandwidth")) if name == "paper" else fn(a)
            status = "ok"
        except Exception as e:  # one failing step must not hide the others
            result, status = {"error": repr(e), "traceback": traceback.format_exc()}, "error"
            failed.append(name)
        results[name] = result
        record = {"step": name, "status": status, "dry_run": a.dry_run, "machine": info,
                  "seconds": time.perf_counter() - start, "result": result}
        (out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
        print(json.dumps({k: v for k, v in record.items() if k != "machine"}, default=str)[:1500],
              flush=True)
    print(f"steps failed: {', '.join(failed) or 'none'}; JSON under {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
