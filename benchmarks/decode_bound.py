"""Decode step time against its memory bound, full cache versus InfiniGen (and H2O), on CPU.

    python benchmarks/decode_bound.py            # SmolLM2, batch 8 x 4,096 tokens, and batch 1
    python benchmarks/decode_bound.py --quick    # batch 2 x 512 tokens, a smoke run

The KV cache lives in CPU memory (``--percent 100 0 0 100 100 0``), so every decode step
copies what attention reads to the compute device, which on a CPU-only machine is the same
RAM. A step's memory bound is the bytes it must touch over this machine's measured copy
bandwidth (bytes read plus bytes written per second by one large ``copy_``):

* each byte moved across the "link" is read once and written once, then read by attention;
* every weight is read once (the tied embedding once, by the output head);
* InfiniGen also reads its speculation keys (all cached tokens, in the selecting layers).

Prompts are natural text (wikitext-2 windows, one per sequence). Each run is appended to the
``runs`` list of ``--out``'s JSON (``--fresh`` starts it anew); the markdown table (medians
over every run) and the PNG are rebuilt from all runs: ``python benchmarks/decode_bound.py
--report-only`` rebuilds them without measuring.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.kv.infinigen.spec_keys import bytes_per_key

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from artifacts import INVESTIGATIONS, append_run, load, meta_line, pyplot, run_meta, table  # noqa: E402,E501

TEXT = ROOT.parent / "shared" / "data" / "wikitext2_test.txt"
OUT = INVESTIGATIONS / "decode_bound_cpu"
POLICIES = {"full": None, "infinigen": None, "h2o": {"hh_ratio": 0.09, "recent_ratio": 0.09}}


def copy_bandwidth(size: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes touched (read + written) per second by one large copy, best of ``repeats``."""
    src = torch.ones(size // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * size / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_decode_step(store, kv: str, prompts: list[list[int]], gen_len: int) -> dict:
    """Median decode step time of one policy with the KV cache in CPU memory, and the bytes
    that step moves and touches."""
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=len(prompts))
    with OffloadedLM.load(path=store, policy=policy, kv_policy=kv, kv_options=POLICIES[kv],
                          progress=False) as lm:
        cfg, item = lm.cfg, lm.engine.dtype.itemsize
        lm.tiers.reset_counters()
        out = lm.generate(prompts, gen_len, stop_token_id=None)
        moved = lm.tiers.bytes_moved
        kv_policy = lm.engine.kv_policy
        report = kv_policy.report()
        weights = sum(n for t in lm.engine.weights.values() for n in t.bytes_by_tier().values())
    steps = gen_len - 1
    b, length = len(prompts), len(prompts[0])
    prompt_kv = 2 * b * length * cfg.num_kv_heads * cfg.head_dim * item * cfg.num_layers
    to_device = sum(moved["host->device"].values()) / steps
    to_host = (sum(moved["device->host"].values()) - prompt_kv) / steps
    context = length + gen_len / 2
    spec = 0.0
    if kv == "infinigen":
        layers = cfg.num_layers - kv_policy.options.first_layer  # the layers that speculate
        spec = layers * b * cfg.num_kv_heads * context * bytes_per_key(
            report["speculation_keys"], round(report["partial_weight_ratio"] * cfg.head_dim),
            item)
    touched = 3 * to_device + 2 * to_host + weights + spec
    step_times = out.step_times[2:] or out.step_times[1:]
    row = {"kv_policy": kv, "batch": b, "context": length, "steps": steps,
           "decode_step_s": statistics.median(step_times),
           "decode_tokens_per_s": b / statistics.median(step_times),
           "bytes_to_device_per_step": to_device, "bytes_to_host_per_step": to_host,
           "weight_bytes": weights, "speculation_key_bytes_per_step": spec,
           "bytes_touched_per_step": touched,
           "relative_kv_size": report.get("relative_kv_size", 1.0)}
    if "speculation_time_s" in report:
        row["speculation_share_of_decode"] = report["speculation_time_s"] / out.decode_latency_s
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default=str(TEXT))
    p.add_argument("--shapes", nargs="+", default=["8x4096", "1x4096"],
                   help="BATCHxCONTEXT runs")
    p.add_argument("--gen-len", type=int, default=8)
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(OUT), help="the artifact's path without suffix")
    p.add_argument("--fresh", action="store_true",
                   help="start the JSON's runs list anew instead of appending this run")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the markdown and the PNG from the JSON's runs; measure nothing")
    a = p.parse_args(argv)
    out = Path(a.out).with_suffix("") if a.out.endswith(".json") else Path(a.out)
    if a.report_only:
        write_outputs(load(out), out)
        return 0
    if not a.fresh:
        try:  # a JSON written before runs were appended stops here, not after the runs
            load(out)
        except ValueError as e:
            p.error(f"{e} (or pass --fresh)")
    if a.quick:
        a.shapes, a.gen_len = ["2x512"], 4
    if not Path(a.text).is_file():
        print(f"error: {a.text} is absent; pass --text (wikitext-2 test split)", file=sys.stderr)
        return 2
    from flexgen_infinigen.config import get_config
    from flexgen_infinigen.text.tokenizer import load_tokenizer
    from flexgen_infinigen.weights.embedded import default_model_store
    store = default_model_store(progress=False)
    ids = load_tokenizer(store, get_config("smollm2-135m")).encode(
        Path(a.text).read_text(encoding="utf-8"))
    bandwidth = copy_bandwidth()
    rows = []
    jobs = [(shape, kv) for shape in a.shapes for kv in a.policies]
    for shape, kv in tqdm(jobs, desc="runs"):
        b, length = map(int, shape.split("x"))
        prompts = [ids[i * length:(i + 1) * length] for i in range(b)]
        row = measure_decode_step(store, kv, prompts, a.gen_len)
        row["memory_bound_s"] = row["bytes_touched_per_step"] / bandwidth
        row["step_over_bound"] = row["decode_step_s"] / row["memory_bound_s"]
        rows.append(row)
        tqdm.write(f"{shape:>8} {kv:>9}: step {row['decode_step_s'] * 1e3:8.1f} ms, bound "
                   f"{row['memory_bound_s'] * 1e3:7.1f} ms (x{row['step_over_bound']:.2f}), "
                   f"{row['decode_tokens_per_s']:.2f} tok/s")
    for row in rows:
        full = next((r for r in rows if r["kv_policy"] == "full" and r["batch"] == row["batch"]
                     and r["context"] == row["context"]), None)
        if full is not None:
            row["speedup_vs_full"] = row["decode_tokens_per_s"] / full["decode_tokens_per_s"]
    settings = {k: v for k, v in vars(a).items() if k not in ("out", "fresh", "report_only")}
    run = {"meta": run_meta(copy_bandwidth_gb_s=bandwidth / 1e9, threads=torch.get_num_threads(),
                            torch=torch.__version__, platform=platform.platform()),
           "settings": settings, "rows": rows}
    doc = append_run(out, run, fresh=a.fresh, benchmark="decode_bound.py: SmolLM2-135M decode "
                     "step against the bytes it must touch over the copy bandwidth, KV cache in "
                     "CPU memory")
    write_outputs(doc, out)
    print(out.with_suffix(".md").read_text())
    return 0


KEYS = ["batch x context", "policy"]
COLUMNS = [("step ms", "step_ms"), ("bound ms", "bound_ms"), ("step / bound", "step_over_bound"),
           ("tokens/s", "decode_tokens_per_s"), ("vs full", "speedup_vs_full"),
           ("relative KV size", "relative_kv_size"), ("speculation share %", "spec_pct")]


def view(rows: list[dict]) -> list[dict]:
    """A run's rows with the table's key fields and milliseconds."""
    out = []
    for r in rows:
        spec = r.get("speculation_share_of_decode")
        out.append({**r, "batch x context": f"{r['batch']} x {r['context']:,}",
                    "policy": r["kv_policy"], "step_ms": 1e3 * r["decode_step_s"],
                    "bound_ms": 1e3 * r["memory_bound_s"],
                    "spec_pct": None if spec is None else 100 * spec})
    return out


def write_outputs(doc: dict, out: Path) -> None:
    """``OUT.md`` (medians over every run) and ``OUT.png`` from the JSON's runs."""
    runs = [{**run, "rows": view(run["rows"])} for run in doc["runs"]]
    lines = ["# Decode step against its memory bound (CPU, KV cache in CPU memory)", "",
             meta_line(doc["runs"]) + ".", "",
             "Each number: median (min-max, N runs). bound: the bytes a step must touch (each "
             "byte moved read and written once and read by attention; every weight once; "
             "InfiniGen's speculation keys) over the copy bandwidth measured in the run.", "",
             table(runs, KEYS, [(h, f) for h, f in COLUMNS  # no column that is empty
                                if any(r.get(f) is not None for run in runs
                                       for r in run["rows"])]).rstrip("\n"), "", "Runs:", ""]
    for i, run in enumerate(doc["runs"], 1):
        m = run["meta"]
        lines.append(f"{i}. {m.get('date')}, commit {m.get('commit')}, {m.get('cpu')}, "
                     f"{m.get('cores')} cores, copy bandwidth "
                     f"{m.get('copy_bandwidth_gb_s', 0):.1f} GB/s touched: `{m.get('command')}`"
                     + (f" ({m['note']})" if m.get("note") else ""))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(out.with_suffix(".png"), [r for run in runs for r in run["rows"]])


def plot(path: Path, rows: list[dict]) -> None:
    """Median step and bound of each line, the step's bar from its min to its max."""
    plt = pyplot()
    if plt is None:
        return
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["batch x context"], r["policy"]), []).append(r)
    labels = [f"{shape}\n{policy}" for shape, policy in groups]
    steps = [[r["step_ms"] for r in g] for g in groups.values()]
    med = [statistics.median(v) for v in steps]
    err = [[m - min(v) for m, v in zip(med, steps)], [max(v) - m for m, v in zip(med, steps)]]
    bound = [statistics.median(r["bound_ms"] for r in g) for g in groups.values()]
    x = range(len(groups))
    fig, ax = plt.subplots(figsize=(max(6, len(groups) * 1.1), 4))
    ax.bar([i - 0.2 for i in x], med, 0.4, yerr=err, capsize=3, label="step")
    ax.bar([i + 0.2 for i in x], bound, 0.4, label="memory bound")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set(ylabel="ms per decode step", title="SmolLM2-135M decode, KV cache in CPU memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
