"""Full KV cache versus InfiniGen at growing contexts: KV bytes per token, speed, speculation.

    python benchmarks/infinigen_kv.py                      # CPU: smollm2-135m and dummy opt-125m
    python benchmarks/infinigen_kv.py --paper-setting      # CUDA: OPT-13B shapes, batch 20

The KV cache sits in host memory (``--percent 100 0 0 100 100 0``, the paper's setting), so
every decode step moves it (full) or the selected rows (InfiniGen) to the compute device.
Each run is appended to the ``runs`` list of ``benchmarks/results/infinigen_cpu.json`` (or
``infinigen_cuda.json``; ``--out`` another stem, ``--fresh`` a new list); the .md table and the
.png plot sum up every run (``--report-only`` rewrites them alone).
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

from flexgen_infinigen import Generation, OffloadedLM, Placement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import artifacts  # noqa: E402

TEXT = ROOT.parent / "shared" / "data" / "wikitext2_test.txt"


def prompt_ids(lm, length: int, text_file: Path | None):
    if lm.tokenizer is not None and text_file is not None and text_file.is_file():
        ids = lm.tokenizer.encode(text_file.read_text(encoding="utf-8")[:length * 8])
        if len(ids) >= length:
            return ids[:length], "natural text"
    gen = torch.Generator().manual_seed(0)
    return torch.randint(10, lm.cfg.vocab_size, (length,), generator=gen).tolist(), "random ids"


def measure_kv_traffic(lm: OffloadedLM, prompts: list[list[int]],
                       gen_len: int) -> tuple[dict, Generation]:
    """Decode speed and KV bytes moved to the device per decode token, after a warm-up;
    also the measured generation (for the greedy agreement with the full cache)."""
    lm.generate(prompts, 2, stop_token_id=None)  # warm-up
    policy = lm.engine.kv_policy
    policy.reset_stats()
    lm.tiers.reset_counters()
    out = lm.generate(prompts, gen_len, stop_token_id=None)
    moved = lm.tiers.bytes_moved
    # the KV traffic of decode steps only: subtract what prefill stored
    kv_in = moved["host->device"]["kv_cache"] + moved["disk->host"]["kv_cache"]
    report = policy.report()
    decode_tokens = len(prompts) * (gen_len - 1)
    row = {"decode_tokens_per_s": decode_tokens / out.decode_latency_s,
           "decode_latency_s": out.decode_latency_s,
           "prefill_latency_s": out.prefill_latency_s,
           "kv_bytes_to_device_per_token": kv_in / decode_tokens,
           "kv_fetch_fraction": report.get("kv_fetch_fraction", 1.0),
           "kv_selected_fraction": report.get("kv_selected_fraction", 1.0)}
    if "speculation_time_s" in report:
        row["speculation_s"] = report["speculation_time_s"]
        row["speculation_share_of_decode"] = report["speculation_time_s"] / out.decode_latency_s
    return row, out


def run(args) -> dict:
    results = {"machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(),
                           "torch": torch.__version__,
                           "device": torch.cuda.get_device_name(0)
                           if torch.cuda.is_available() else "cpu"},
               "settings": vars(args), "runs": []}
    from flexgen_infinigen.config import get_config
    configs = [(m, c) for m in args.models for c in args.contexts
               if c + args.gen_len <= get_config(m).max_positions]
    results["skipped"] = [f"{m} at {c} (over its maximum positions)" for m in args.models
                          for c in args.contexts if (m, c) not in configs]
    for model, context in tqdm(configs, desc="configurations"):
        dummy = model != "smollm2-135m"
        policy = Placement.from_percent(args.percent, gpu_batch_size=args.batch)
        for kv in ("full", "infinigen"):
            lm = OffloadedLM.load(model=model, dummy=dummy, policy=policy, kv_policy=kv,
                                  dtype=args.dtype, progress=False,
                                  max_len_hint=(context, args.gen_len))
            with lm:
                ids, kind = prompt_ids(lm, context, Path(args.text))
                start = time.perf_counter()
                row, out = measure_kv_traffic(lm, [ids] * args.batch, args.gen_len)
                row.update({"model": model, "context": context, "kv_policy": kv,
                            "prompt": kind, "batch": args.batch,
                            "wall_s": time.perf_counter() - start})
                if kv == "full":
                    reference = out.token_ids
                else:
                    agree = [sum(a == b for a, b in zip(x, y)) / len(y)
                             for x, y in zip(out.token_ids, reference)]
                    row["greedy_agreement_with_full"] = sum(agree) / len(agree)
            results["runs"].append(row)
    for row in results["runs"]:
        if row["kv_policy"] == "infinigen":
            full = next(r for r in results["runs"] if r["kv_policy"] == "full"
                        and r["model"] == row["model"] and r["context"] == row["context"])
            row["speedup_vs_full"] = row["decode_tokens_per_s"] / full["decode_tokens_per_s"]
            moved = full["kv_bytes_to_device_per_token"]  # 0 where rows are read in place
            row["kv_bytes_ratio_vs_full"] = (row["kv_bytes_to_device_per_token"] / moved
                                             if moved else None)
    return results


COLUMNS = [("decode tok/s", "decode_tokens_per_s", "{:.1f}"),
           ("KV MB per token", "kv_mb_per_token", "{:.1f}"),
           ("fetched", "kv_fetch_fraction", "{:.2f}"),
           ("speculation share", "speculation_share_of_decode", "{:.2f}"),
           ("vs full", "speedup_vs_full", "{:.2f}")]


def markdown(doc: dict) -> str:
    """One line a (model, context, policy) over every run: median (min-max, N runs)."""
    runs = doc["runs"]
    lines = ["# Full KV cache against InfiniGen at growing contexts", "",
             artifacts.meta_line(runs), "",
             "| model | context | policy | " + " | ".join(h for h, _, _ in COLUMNS) + " |",
             "|" + "---|" * (3 + len(COLUMNS))]
    for key, rows in artifacts.grouped(runs, ["model", "context", "kv_policy"]).items():
        cells = [str(k) for k in key]
        cells += [artifacts.spread((r.get(f) for r in rows), fmt) for _, f, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    plt = artifacts.pyplot()
    if plt is None:
        return
    groups = artifacts.grouped(doc["runs"], ["model", "kv_policy", "context"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for model, kv in dict.fromkeys((m, k) for m, k, _ in groups):
        style = "-o" if kv == "full" else "--s"
        cells = sorted((c, rows) for (m, k, c), rows in groups.items() if (m, k) == (model, kv))
        ctx = [c for c, _ in cells]
        for ax, field in zip(axes, ("kv_mb_per_token", "decode_tokens_per_s")):
            axes_values = [statistics.median(r[field] for r in rows) for _, rows in cells]
            ax.plot(ctx, axes_values, style, label=f"{model} {kv}")
    axes[0].set(xlabel="context (tokens)", ylabel="KV MB to device per generated token",
                title="KV traffic")
    axes[1].set(xlabel="context (tokens)", ylabel="decode tokens/s (median over runs)",
                title="decode speed")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    runs = len(doc["runs"])
    fig.suptitle(f"full vs InfiniGen ({runs} run{'s' if runs != 1 else ''})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(stem: Path) -> None:
    doc = artifacts.load(stem)
    stem.with_suffix(".md").write_text(markdown(doc))
    plot(doc, stem.with_suffix(".png"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "opt-125m"])
    p.add_argument("--contexts", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--percent", nargs=6, type=float, default=[100, 0, 0, 100, 100, 0])
    p.add_argument("--dtype", default=None)
    p.add_argument("--paper-setting", action="store_true",
                   help="OPT-13B shapes, batch 20, prompt 1920, 128 new tokens (needs a GPU)")
    p.add_argument("--out", default=None, help="the artifact stem (default: benchmarks/results/"
                   "infinigen_cpu, or infinigen_cuda with a GPU)")
    p.add_argument("--fresh", action="store_true", help="start the runs list anew")
    p.add_argument("--report-only", action="store_true",
                   help="only rewrite the .md and .png from the runs in the JSON")
    p.add_argument("--text", default=str(TEXT),
                   help="prompt text, e.g. WikiText-2's raw test split (default: ../shared/data/"
                        "wikitext2_test.txt; without it, synthesized prompts)")
    args = p.parse_args(argv)
    if args.paper_setting:
        args.models, args.contexts, args.gen_len, args.batch = ["opt-13b"], [1920], 128, 20
    default = "infinigen_cuda" if torch.cuda.is_available() else "infinigen_cpu"
    stem = Path(args.out).with_suffix("") if args.out else artifacts.RESULTS / default
    if args.report_only:
        write(stem)
        return 0
    args.contexts = sorted(set(args.contexts))
    results = run(args)
    for r in results["runs"]:
        r["kv_mb_per_token"] = r["kv_bytes_to_device_per_token"] / 1e6
    command = ["benchmarks/infinigen_kv.py", *(sys.argv[1:] if argv is None else argv)]
    entry = {"meta": artifacts.run_meta(command, machine=results["machine"]),
             "settings": results["settings"], "skipped": results["skipped"],
             "rows": results["runs"]}
    artifacts.append_run(stem, entry, fresh=args.fresh,
                         benchmark="infinigen_kv.py: full KV cache against InfiniGen at "
                                   "growing contexts, the cache in host memory")
    write(stem)
    print(f"appended a run to {stem}.json; wrote {stem}.md, .png")
    for r in results["runs"]:
        extra = (f"  speculation {100 * r['speculation_share_of_decode']:.1f}% of decode, "
                 f"fetched {r['kv_fetch_fraction']:.2f}, x{r['speedup_vs_full']:.2f} vs full"
                 if r["kv_policy"] == "infinigen" else "")
        print(f"{r['model']:>13} ctx {r['context']:>5} {r['kv_policy']:>9}: "
              f"{r['decode_tokens_per_s']:7.2f} tok/s, "
              f"{r['kv_bytes_to_device_per_token'] / 1e6:8.2f} MB KV/token{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
