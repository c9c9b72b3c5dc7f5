"""Perplexity against relative KV size for full, InfiniGen, H2O and the 4-bit cache.

    python benchmarks/accuracy_sweep.py                 # SmolLM2 on wikitext-2, 2,048-token windows
    python benchmarks/accuracy_sweep.py --quick         # a short smoke run

Every number comes from the real decode path (teacher forcing, ``metrics.teacher_forced_nll``)
with the policy active. Writes JSON, a markdown table and a PNG under benchmarks/results/.
A dummy opt-125m row (random weights, random tokens) exercises the OPT path of every policy:
its perplexity means nothing, its equality with full at budget 1.0 does.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flexgen_infinigen import OffloadedLM, Policy
from flexgen_infinigen.kv import InfiniGenOptions
from flexgen_infinigen.metrics import perplexity, teacher_forced_nll

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT.parent / "shared" / "data" / "wikitext2_test.txt"


def methods(budgets):
    rows = [("full", "full", {}, None)]
    for cap in budgets:
        rows.append((f"infinigen cap {cap}", "infinigen",
                     {"options": InfiniGenOptions(max_kv_fraction=cap)}, None))
    for cap in budgets:  # H2O at the same relative KV size: half heavy hitters, half recent
        rows.append((f"h2o {cap}", "h2o", {"hh_ratio": cap / 2, "recent_ratio": cap / 2}, None))
    rows.append(("4-bit cache", "full", {}, "compress"))
    rows.append(("infinigen keep-all", "infinigen",
                 {"options": InfiniGenOptions(alpha=math.inf, max_kv_fraction=1.0)}, None))
    rows.append(("h2o keep-all", "h2o", {"hh_ratio": 0.5, "recent_ratio": 0.5}, None))
    return rows


def score(model, dummy, windows, prefill, name, kv, kw, extra):
    policy = Policy.from_percent([100, 0, 0, 100, 100, 0], compress_cache=extra == "compress")
    with OffloadedLM.load(model=model, dummy=dummy, policy=policy, kv_policy=kv,
                          kv_options=kw or None, progress=False) as lm:
        nll, fractions = [], []
        for w in windows:
            nll.append(teacher_forced_nll(lm, [w[:prefill]], [w[prefill:]])[0])
            report = lm.engine.kv_policy.report()
            fractions.append(report.get("kv_fetch_fraction", 1.0))
            item = lm.engine.dtype.itemsize
    all_nll = torch.cat(nll)
    size = sum(fractions) / len(fractions)
    if extra == "compress":  # every row is read, as 4-bit codes plus a scale and min per 64
        size = (0.5 + 2 * item / 64) / item
    report.pop("kv_fetch_fraction_per_layer", None)
    return {"method": name, "perplexity": perplexity(all_nll), "relative_kv_size": size,
            "kv_report": report,
            "tokens": int(all_nll.numel()), "nll": all_nll}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--budgets", nargs="+", type=float, default=[0.1, 0.2, 0.4])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "accuracy_sweep"))
    a = p.parse_args(argv)
    if a.quick:
        a.seq_len, a.prefill_len, a.budgets = 256, 128, [0.2]
    if not TEXT.is_file():
        print(f"error: {TEXT} is absent; the sweep needs ../shared/data", file=sys.stderr)
        return 2
    results = {"settings": vars(a), "models": {}}
    from flexgen_infinigen.tokenizer import load_tokenizer
    from flexgen_infinigen.weights.embedded import default_model_store
    store = default_model_store(progress=False)
    from flexgen_infinigen.config import get_config
    tok = load_tokenizer(store, get_config("smollm2-135m"))
    ids = tok.encode(TEXT.read_text(encoding="utf-8")[: a.seq_len * a.windows * 8])
    windows = [ids[i * a.seq_len:(i + 1) * a.seq_len] for i in range(a.windows)]
    gen = torch.Generator().manual_seed(0)
    opt_windows = [torch.randint(10, 50272, (512,), generator=gen).tolist()]
    plans = [("smollm2-135m", False, windows, a.prefill_len),
             ("opt-125m (dummy)", True, opt_windows, 256)]
    jobs = [(m, d, w, pf, *row) for m, d, w, pf in plans for row in methods(a.budgets)]
    for model, dummy, wins, prefill, name, kv, kw, extra in tqdm(jobs, desc="sweep"):
        row = score(model.split()[0], dummy, wins, prefill, name, kv, kw, extra)
        results["models"].setdefault(model, []).append(row)
    for rows in results["models"].values():
        full = rows[0]
        for row in rows:
            row["vs_full"] = row["perplexity"] / full["perplexity"] - 1
            row["max_nll_diff_vs_full"] = (row.pop("nll") - full["nll"]).abs().max().item() \
                if row is not full else 0.0
        full.pop("nll", None)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    lines = []
    for model, rows in results["models"].items():
        lines += [f"## {model}", "", f"windows of {a.seq_len if 'smollm2' in model else 512} "
                  f"tokens, prefill {a.prefill_len if 'smollm2' in model else 256}, "
                  f"{rows[0]['tokens']} tokens scored", "",
                  "| method | relative KV size | perplexity | vs full | max NLL diff vs full |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['method']} | {r['relative_kv_size']:.3f} | {r['perplexity']:.3f} | "
                  f"{100 * r['vs_full']:+.2f}% | {r['max_nll_diff_vs_full']:.2e} |" for r in rows]
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        rows = results["models"]["smollm2-135m"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for prefix, style in (("infinigen cap", "-o"), ("h2o 0", "-s")):
            pts = sorted((r["relative_kv_size"], r["perplexity"]) for r in rows
                         if r["method"].startswith(prefix))
            ax.plot(*zip(*pts), style, label=prefix.split()[0])
        q = next(r for r in rows if r["method"] == "4-bit cache")
        ax.plot([q["relative_kv_size"]], [q["perplexity"]], "^", label="4-bit cache")
        ax.axhline(rows[0]["perplexity"], color="gray", ls="--", label="full")
        ax.set(xlabel="relative KV size (fetched / full)", ylabel="perplexity",
               title="SmolLM2-135M, wikitext-2, decode path")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    except ImportError:
        pass
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
