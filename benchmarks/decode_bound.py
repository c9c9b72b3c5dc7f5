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

Prompts are natural text (wikitext-2 windows, one per sequence). Writes JSON, markdown and
a PNG under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flexgen_infinigen import OffloadedLM, Policy
from flexgen_infinigen.kv.spec_keys import bytes_per_key

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "wikitext2_test.txt"
OUT = ROOT / "benchmarks" / "results" / "decode_bound_cpu"
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
    policy = Policy.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=len(prompts))
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
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
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
        full = next(r for r in rows if r["kv_policy"] == "full" and r["batch"] == row["batch"]
                    and r["context"] == row["context"])
        row["speedup_vs_full"] = row["decode_tokens_per_s"] / full["decode_tokens_per_s"]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__, "copy_bandwidth_bytes_per_s": bandwidth},
              "settings": vars(a), "runs": rows}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"# Decode step against its memory bound (CPU, copy bandwidth "
             f"{bandwidth / 1e9:.1f} GB/s touched)", "",
             "| batch x context | policy | step ms | bound ms | step / bound | tokens/s | "
             "vs full | relative KV size | speculation share |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        spec = r.get("speculation_share_of_decode")
        lines.append(f"| {r['batch']}x{r['context']} | {r['kv_policy']} | "
                     f"{r['decode_step_s'] * 1e3:.1f} | {r['memory_bound_s'] * 1e3:.1f} | "
                     f"{r['step_over_bound']:.2f} | {r['decode_tokens_per_s']:.2f} | "
                     f"{r['speedup_vs_full']:.2f}x | {r['relative_kv_size']:.3f} | "
                     f"{'' if spec is None else f'{100 * spec:.1f}%'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(out.with_suffix(".png"), rows)
    return 0


def plot(path: Path, rows: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{r['batch']}x{r['context']}\n{r['kv_policy']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.1), 4))
    ax.bar([i - 0.2 for i in x], [r["decode_step_s"] * 1e3 for r in rows], 0.4, label="step")
    ax.bar([i + 0.2 for i in x], [r["memory_bound_s"] * 1e3 for r in rows], 0.4,
           label="memory bound")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set(ylabel="ms per decode step", title="SmolLM2-135M decode, KV cache in CPU memory")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
