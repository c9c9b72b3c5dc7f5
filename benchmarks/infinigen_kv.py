"""Full KV cache versus InfiniGen at growing contexts: KV bytes per token, speed, speculation.

    python benchmarks/infinigen_kv.py                      # CPU: smollm2-135m and dummy opt-125m
    python benchmarks/infinigen_kv.py --paper-setting      # CUDA: OPT-13B shapes, batch 20

The KV cache sits in host memory (``--percent 100 0 0 100 100 0``, the paper's setting), so
every decode step moves it (full) or the selected rows (InfiniGen) to the compute device.
Writes JSON (and a PNG plot when matplotlib is installed) under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flexgen_infinigen import Generation, OffloadedLM, Policy

ROOT = Path(__file__).resolve().parents[1]
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
        policy = Policy.from_percent(args.percent, gpu_batch_size=args.batch)
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
            row["kv_bytes_ratio_vs_full"] = (row["kv_bytes_to_device_per_token"]
                                             / full["kv_bytes_to_device_per_token"])
    return results


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = sorted({r["model"] for r in results["runs"]})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for model in models:
        for kv, style in (("full", "-o"), ("infinigen", "--s")):
            rows = [r for r in results["runs"] if r["model"] == model and r["kv_policy"] == kv]
            ctx = [r["context"] for r in rows]
            axes[0].plot(ctx, [r["kv_bytes_to_device_per_token"] / 1e6 for r in rows], style,
                         label=f"{model} {kv}")
            axes[1].plot(ctx, [r["decode_tokens_per_s"] for r in rows], style,
                         label=f"{model} {kv}")
    axes[0].set(xlabel="context (tokens)", ylabel="KV MB to device per generated token",
                title="KV traffic")
    axes[1].set(xlabel="context (tokens)", ylabel="decode tokens/s", title="decode speed")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"full vs InfiniGen on {results['machine']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    p.add_argument("--out", default=None)
    p.add_argument("--text", default=str(TEXT),
                   help="prompt text, e.g. WikiText-2's raw test split (default: ../shared/data/"
                        "wikitext2_test.txt; without it, synthesized prompts)")
    args = p.parse_args(argv)
    if args.paper_setting:
        args.models, args.contexts, args.gen_len, args.batch = ["opt-13b"], [1920], 128, 20
    default = "infinigen_cuda.json" if torch.cuda.is_available() else "infinigen_cpu.json"
    out = Path(args.out or ROOT / "benchmarks" / "results" / default)
    args.contexts = sorted(set(args.contexts))
    results = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out}")
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
