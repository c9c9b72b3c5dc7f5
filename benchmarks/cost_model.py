"""Predicted against measured time per policy, and the optimizer's pick against a grid.

Part 1 (validation set): for each policy, load the model, warm up, measure prefill and
mean decode step time (the fastest quiet run), and put the cost model's prediction for
the same model, lengths and policy beside it.

Part 2 (optimizer): under a memory budget (``--budget-gb``, device and host together
on a CPU-only machine), measure every policy of a grid of placements and batch sizes
that fits the budget, then run the optimizer with the same budget and measure its pick.

    python benchmarks/cost_model.py                    # profile, validation set, grid
    python benchmarks/cost_model.py --quick            # smoke run: 3 policies, a small grid
    python benchmarks/cost_model.py --hw hw.json       # a saved profile instead of measuring

Appends the run to benchmarks/results/cost_model_<device>.json's ``runs`` (``--fresh`` starts
them anew) and rewrites cost_model_<device>.md (median, min-max over the runs) and .png from all
of them; ``--report-only`` only rewrites those two.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import artifacts  # noqa: E402
from machine import Retry, machine_info, repeat_until_quiet  # noqa: E402

from flexgen_infinigen import OffloadedLM, Placement  # noqa: E402
from flexgen_infinigen.config import get_config  # noqa: E402
from flexgen_infinigen.kv import make_kv_policy  # noqa: E402
from flexgen_infinigen.planner.cost import predict  # noqa: E402
from flexgen_infinigen.planner.hardware import load_profile  # noqa: E402
from flexgen_infinigen.planner.lp import optimize  # noqa: E402
from flexgen_infinigen.planner.workload import Workload, fits, memory_needs  # noqa: E402
from flexgen_infinigen.run import synthesize_prompts  # noqa: E402

SMOL = {"model": "smollm2-135m"}
OPT = {"model": "opt-125m", "dummy": True}
# name -> (how to load, percent, Placement switches, kv policy, kv options)
VALIDATION = {
    "all on device": (SMOL, [100, 0, 100, 0, 100, 0], {}, "full", {}),
    "weights in CPU memory": (SMOL, [0, 100, 100, 0, 100, 0], {}, "full", {}),
    "weights half in CPU memory": (SMOL, [50, 50, 100, 0, 100, 0], {}, "full", {}),
    "weights 30% on disk": (SMOL, [70, 0, 100, 0, 100, 0], {}, "full", {}),
    "KV in CPU memory": (SMOL, [100, 0, 0, 100, 100, 0], {}, "full", {}),
    "weights + KV in CPU memory": (SMOL, [0, 100, 0, 100, 100, 0], {}, "full", {}),
    "KV on disk": (SMOL, [100, 0, 0, 0, 100, 0], {}, "full", {}),
    "activations in CPU memory": (SMOL, [100, 0, 100, 0, 0, 100], {}, "full", {}),
    "cpu-cache-compute, KV in CPU memory": (SMOL, [100, 0, 0, 100, 100, 0],
                                            {"cpu_cache_compute": True}, "full", {}),
    "4-bit weights": (SMOL, [100, 0, 100, 0, 100, 0], {"compress_weight": True}, "full", {}),
    "4-bit KV in CPU memory": (SMOL, [100, 0, 0, 100, 100, 0], {"compress_cache": True},
                               "full", {}),
    "2 GPU batches, weights in CPU memory": (SMOL, [0, 100, 100, 0, 100, 0],
                                             {"num_gpu_batches": 2}, "full", {}),
    "infinigen, KV in CPU memory": (SMOL, [100, 0, 0, 100, 100, 0], {}, "infinigen",
                                    {"max_kv_fraction": 0.2}),
    "h2o 0.2, KV in CPU memory": (SMOL, [100, 0, 0, 100, 100, 0], {}, "h2o",
                                  {"hh_ratio": 0.1, "recent_ratio": 0.1}),
    "opt-125m all on device": (OPT, [100, 0, 100, 0, 100, 0], {}, "full", {}),
    "opt-125m weights in CPU memory": (OPT, [0, 100, 100, 0, 100, 0], {}, "full", {}),
    "opt-125m KV in CPU memory": (OPT, [100, 0, 0, 100, 100, 0], {}, "full", {}),
}
QUICK = ["all on device", "weights in CPU memory", "KV in CPU memory"]


def profile_in_child(quick: bool):
    """Measure this machine in a separate process. The profile allocates and frees large
    buffers; done in this process it leaves the allocator in a state that makes the runtime's
    later host copies up to a third faster than in a fresh process, which is not what a user
    of `run` sees."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/hw.json"
        cmd = [sys.executable, "-m", "flexgen_infinigen.profile", "--out", path]
        subprocess.run(cmd + (["--quick"] if quick else []), check=True, stdout=subprocess.DEVNULL)
        return load_profile(path)


def measure_policy(load: dict, policy: Placement, kv: str, opts: dict, prompt_len: int,
                   gen_len: int, retry: Retry) -> dict:
    lm = OffloadedLM.load(policy=policy, progress=False, kv_policy=make_kv_policy(kv, **opts),
                          max_len_hint=(prompt_len, gen_len), **load)
    with lm:
        prompts = synthesize_prompts(lm, prompt_len, policy.block_size, 0)
        lm.generate(prompts, gen_len=2, stop_token_id=None)

        def one() -> dict:
            gen = lm.generate(prompts, gen_len=gen_len, stop_token_id=None)
            return {"prefill_s": gen.prefill_latency_s,
                    "decode_step_s": gen.decode_latency_s / (gen_len - 1)}

        _, usable = repeat_until_quiet(one, retry)
        best = min(usable, key=lambda r: r["decode_step_s"])
        report = lm.engine.kv_policy.report()
    gc.collect()
    return {**best, "kv_fetch_fraction": report.get("kv_fetch_fraction")}


def validation(hw, names, prompt_len, gen_len, batch, retry) -> list[dict]:
    rows = []
    for name in tqdm(names, desc="validation", unit="policy"):
        load, pct, switches, kv, opts = VALIDATION[name]
        policy = Placement.from_percent(pct, gpu_batch_size=batch, **switches)
        if policy.overlap is None:
            policy = dataclasses.replace(policy, overlap=hw.copies_overlap_compute)
        got = measure_policy(load, policy, kv, opts, prompt_len, gen_len, retry)
        work = Workload(get_config(load["model"]), prompt_len, gen_len, hw.dtype_bytes, kv,
                        make_kv_policy(kv, **opts).kv_fraction)
        pred = predict(work, policy, hw)
        rows.append({
            "name": name, "model": load["model"], "percent": pct, "switches": switches,
            "kv_policy": kv, "kv_options": opts, "measured": got,
            "predicted": {"prefill_s": pred["prefill_s"], "decode_step_s": pred["decode_step_s"],
                          "decode_terms_s": pred["decode_terms_s"]},
            "decode_error": pred["decode_step_s"] / got["decode_step_s"] - 1,
            "prefill_error": pred["prefill_s"] / got["prefill_s"] - 1})
    return rows


GRID_PERCENTS = {
    "all in memory": [100, 0, 100, 0, 100, 0],
    "weights 50% host": [50, 50, 100, 0, 100, 0],
    "KV on disk": [100, 0, 0, 0, 100, 0],
    "weights 50% disk": [50, 0, 100, 0, 100, 0],
    "weights 75% disk": [25, 0, 100, 0, 100, 0],
    "weights on disk, KV on disk": [0, 0, 0, 0, 100, 0],
}


def grid(hw, budget_gb, prompt_len, gen_len, batches, retry) -> dict:
    """Measured grid under a memory budget, against the optimizer's measured pick."""
    # the budget limits what the runtime places; the OS still caches offloaded files in the
    # machine's free memory, as it would for a user who sets --cpu-mem to leave room for
    # other work
    limited = dataclasses.replace(hw.with_memory(gpu_gb=budget_gb, cpu_gb=budget_gb),
                                  page_cache_mem=hw.cpu_mem)
    work = Workload(get_config("smollm2-135m"), prompt_len, gen_len, hw.dtype_bytes)
    cells = []
    for b in batches:
        for name, pct in GRID_PERCENTS.items():
            policy = Placement.from_percent(pct, gpu_batch_size=b,
                                         overlap=hw.copies_overlap_compute)
            if fits(memory_needs(work, policy), limited):
                cells.append((f"{name}, batch {b}", policy))
    best, _ = optimize(work, limited, Placement(overlap=hw.copies_overlap_compute),
                       batch_sizes=batches, num_batches=(1, 2))
    cells.append(("optimizer's pick", best.policy))
    rows = []
    for name, policy in tqdm(cells, desc="grid", unit="policy"):
        got = measure_policy(SMOL, policy, "full", {}, prompt_len, gen_len, retry)
        total = got["prefill_s"] + got["decode_step_s"] * (gen_len - 1)
        pred = predict(work, policy, limited)
        rows.append({"name": name, "policy": policy.to_dict(),
                     "measured_throughput": policy.block_size * gen_len / total,
                     "predicted_throughput": pred["throughput"], "measured": got})
    grid_best = max(rows[:-1], key=lambda r: r["measured_throughput"])
    pick = rows[-1]
    return {"budget_gb": budget_gb, "rows": rows, "grid_best": grid_best["name"],
            "pick_vs_grid_best": pick["measured_throughput"] / grid_best["measured_throughput"]}


def paper_setting() -> dict:
    """Predictions only: OPT-13B, batch 20, prompt 1920, 128 tokens, A6000 / PCIe 3 profile."""
    hw = load_profile("a6000-pcie3")
    cfg = get_config("opt-13b")
    paper = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=20)
    out = {"profile": "a6000-pcie3", "model": "opt-13b", "prompt_len": 1920, "gen_len": 128}
    for kv, fraction in (("full", 1.0), ("infinigen", 0.2)):
        work = Workload(cfg, 1920, 128, 2, kv, fraction)
        fixed = predict(work, paper, hw)
        at_20, _ = optimize(work, hw, batch_sizes=(20,), num_batches=(1,))
        free, _ = optimize(work, hw)
        out[kv] = {
            "paper_policy": {"percent": [100, 0, 0, 100, 100, 0], "gpu_batch_size": 20,
                             "throughput": fixed["throughput"],
                             "decode_step_s": fixed["decode_step_s"],
                             "decode_terms_s": fixed["decode_terms_s"]},
            "optimized_batch_20": {"percent": at_20.percent(),
                                   "cpu_cache_compute": at_20.policy.cpu_cache_compute,
                                   "throughput": at_20.prediction["throughput"],
                                   "decode_step_s": at_20.prediction["decode_step_s"]},
            "optimized_free": {"percent": free.percent(),
                               "gpu_batch_size": free.policy.gpu_batch_size,
                               "num_gpu_batches": free.policy.num_gpu_batches,
                               "cpu_cache_compute": free.policy.cpu_cache_compute,
                               "throughput": free.prediction["throughput"]}}
    for key in ("paper_policy", "optimized_batch_20", "optimized_free"):
        out[f"speedup_{key}"] = out["infinigen"][key]["throughput"] / out["full"][key]["throughput"]
    out["speedup_paper_policy_decode"] = (out["full"]["paper_policy"]["decode_step_s"]
                                          / out["infinigen"]["paper_policy"]["decode_step_s"])
    return out


def flat(row: dict) -> dict:
    """A validation row with the table's numbers at its top level (the nested dicts stay)."""
    m, p = row["measured"], row["predicted"]
    return {**row, "policy": row["name"], "measured_decode_ms": m["decode_step_s"] * 1e3,
            "predicted_decode_ms": p["decode_step_s"] * 1e3,
            "decode_error_pct": row["decode_error"] * 100,
            "measured_prefill_s": m["prefill_s"], "predicted_prefill_s": p["prefill_s"],
            "prefill_error_pct": row["prefill_error"] * 100}


COLUMNS = [("measured decode ms/step", "measured_decode_ms", "{:.1f}"),
           ("predicted", "predicted_decode_ms", "{:.1f}"),
           ("error", "decode_error_pct", "{:+.0f}%"),
           ("measured prefill s", "measured_prefill_s", "{:.2f}"),
           ("predicted", "predicted_prefill_s", "{:.2f}"),
           ("error", "prefill_error_pct", "{:+.0f}%")]
GRID_COLUMNS = [("measured tok/s", "measured_throughput", "{:.1f}"),
                ("predicted tok/s", "predicted_throughput", "{:.1f}")]


def table(runs: list[dict], keys: list[str], columns: list[tuple[str, str, str]]) -> str:
    """``artifacts.table`` with a format per column."""
    lines = ["| " + " | ".join([*keys, *(h for h, _, _ in columns)]) + " |",
             "|" + "---|" * (len(keys) + len(columns))]
    for key, rows in artifacts.grouped(runs, keys).items():
        cells = [str(k) for k in key]
        cells += [artifacts.spread((r.get(f) for r in rows), fmt) for _, f, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(doc: dict) -> str:
    runs = doc["runs"]
    lines = ["# Cost model against the runtime", "", artifacts.meta_line(runs), "",
             "Predicted against measured, each run with its own profile of the machine. "
             "Each cell: median (min-max, N runs).", "",
             table(runs, ["policy"], COLUMNS)]
    grids = [{"rows": r["grid"]["rows"], "meta": r["meta"]} for r in runs if r.get("grid")]
    if grids:
        budgets = ", ".join(dict.fromkeys(f"{r['grid']['budget_gb']:g}" for r in runs
                                          if r.get("grid")))
        picks = artifacts.spread((r["grid"]["pick_vs_grid_best"] for r in runs
                                  if r.get("grid")), "{:.3f}")
        lines += ["", f"## Optimizer's pick under a {budgets} GB budget", "",
                  table(grids, ["name"], GRID_COLUMNS),
                  f"Pick / best of the grid, measured: {picks}."]
    ps = runs[-1]["paper_setting"]
    lines += ["", "## InfiniGen's setting on the A6000 profile (predicted, the latest run)", "",
              "OPT-13B, prompt 1920, 128 tokens. Throughput in tokens/s.", "",
              "| policy | full | infinigen (fraction 0.2) | ratio |", "|---|---:|---:|---:|"]
    for key, label in (("paper_policy", "the paper's: 100 0 0 100 100 0, batch 20"),
                       ("optimized_batch_20", "optimizer's, batch 20"),
                       ("optimized_free", "optimizer's, any batch shape")):
        f, i = ps["full"][key], ps["infinigen"][key]
        picks = "" if key == "paper_policy" else \
            f" (full: {f['percent']}{' ccc' if f['cpu_cache_compute'] else ''}; " \
            f"infinigen: {i['percent']})"
        lines.append(f"| {label}{picks} | {f['throughput']:.2f} | {i['throughput']:.2f} | "
                     f"{ps['speedup_' + key]:.2f}x |")
    return "\n".join(lines) + "\n"


def write_outputs(doc: dict, out: Path) -> None:
    """The markdown and the plot of every run in ``doc``."""
    out.with_suffix(".md").write_text(markdown(doc))
    plt = artifacts.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5.5, 5))
    groups = artifacts.grouped(doc["runs"], ["policy"])
    meas, pred = [], []
    for rows in groups.values():
        m = [r["measured_decode_ms"] for r in rows]
        q = [r["predicted_decode_ms"] for r in rows]
        meas.append(statistics.median(m))
        pred.append(statistics.median(q))
        ax.errorbar(meas[-1], pred[-1], fmt="o", color="tab:blue", capsize=2,
                    xerr=[[meas[-1] - min(m)], [max(m) - meas[-1]]],
                    yerr=[[pred[-1] - min(q)], [max(q) - pred[-1]]])
    top = max(meas + pred) * 1.1
    ax.plot([0, top], [0, top], "k-", lw=0.8)
    ax.fill_between([0, top], [0, top * 0.8], [0, top * 1.2], color="0.9", label="±20%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured decode step (ms; median, min-max over runs)")
    ax.set_ylabel("predicted decode step (ms)")
    ax.set_title(f"cost model vs runtime, {len(doc['runs'])} run(s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hw", default=None, help="profile JSON or built-in name (default: measure)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--budget-gb", type=float, default=0.7,
                   help="memory budget for the optimizer part (device + host on a CPU)")
    p.add_argument("--no-grid", action="store_true")
    p.add_argument("--out", default=None,
                   help="STEM (default results/cost_model_<device>): this run is appended to "
                        "STEM.json's runs; STEM.md and STEM.png are rewritten from all of them")
    p.add_argument("--fresh", action="store_true", help="start STEM.json's runs anew")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: rewrite STEM.md and STEM.png from STEM.json")
    a = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(a.out) if a.out else HERE / "results" / f"cost_model_{dev.type}"
    out = out.with_suffix("") if out.suffix == ".json" else out
    if a.report_only:
        write_outputs(artifacts.load(out), out)
        print(out.with_suffix(".md").read_text())
        return 0
    hw = load_profile(a.hw) if a.hw else profile_in_child(a.quick)
    retry = Retry(repeats=1 if a.quick else 2)
    names = QUICK if a.quick else list(VALIDATION)
    start = time.time()
    rows = [flat(r) for r in validation(hw, names, a.prompt_len, a.gen_len, a.batch, retry)]
    result = {"meta": artifacts.run_meta(["benchmarks/cost_model.py", *(argv or sys.argv[1:])],
                                         machine_info=machine_info()),
              "rows": rows, "profile": hw.to_dict(),
              "settings": {"prompt_len": a.prompt_len, "gen_len": a.gen_len, "batch": a.batch,
                           "quick": a.quick}}
    if not a.no_grid:
        batches = (1, 4) if a.quick else (1, 4, 8, 16)
        result["grid"] = grid(hw, a.budget_gb, a.prompt_len, a.gen_len, batches, retry)
    result["paper_setting"] = paper_setting()
    result["wall_s"] = time.time() - start
    errors = [abs(r["decode_error"]) for r in rows]
    result["summary"] = {"max_abs_decode_error": max(errors),
                         "within_20_percent": sum(e <= 0.2 for e in errors),
                         "policies": len(errors)}
    doc = artifacts.append_run(out, result, fresh=a.fresh, benchmark=__doc__.split("\n")[0])
    write_outputs(doc, out)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
