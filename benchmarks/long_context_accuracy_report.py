"""The long-context accuracy benchmark's outputs: a summary JSON, a markdown table and a plot
(score against relative KV size, one curve per policy, one panel per length), all rebuilt from
the results file the benchmark appends to:

    python benchmarks/long_context_accuracy_report.py --tag qwen_n24

Every score carries a 95% interval: a percentile bootstrap over the prompts (2,000 resamples of
the prompts with replacement, a fixed seed; a prompt's score is the share of its answers found,
so it is not a yes/no outcome that a Wilson interval fits). A policy's difference to the full
cache is bootstrapped over the prompts both ran (paired: the same resample for both).

Each tag's report also becomes one run (replaced when the tag is reported again) of the set
``benchmarks/results/long_context_accuracy.{json,md,png}``: every model's scores side by side,
one row a model and policy, one column a context length.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import artifacts  # noqa: E402

RESULTS = artifacts.RESULTS
SET = "long_context_accuracy"
NAMES = {"smollm2-135m": "SmolLM2-135M", "qwen2.5-coder-0.5b-instruct-awq": "Qwen2.5-Coder-0.5B",
         "qwen2.5-coder-0.5b-instruct": "Qwen2.5-Coder-0.5B"}
RESAMPLES = 2000

# a 4-bit cache's bytes over an fp16 cache's: half a byte per value plus a 2-byte scale and
# minimum per group of 64 (as in accuracy_sweep)
FOUR_BIT = (0.5 + 2 * 2 / 64) / 2


def _kind(label: str) -> str:
    """The curve a label belongs to: ``infinigen@0.1`` -> infinigen; a cap in tokens
    (``infinigen#512``) and another first selecting layer (``:L1``) are curves of their own."""
    base, _, first = label.removesuffix("-w4").partition(":L")
    kind, _, tokens = base.partition("@")[0].partition("#")
    return kind + (" (token cap)" if tokens else "") + (f" from layer {first}" if first else "")


def interval(scores: list[float], seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of ``scores`` (0-100)."""
    if len(scores) < 2:
        return (scores[0], scores[0]) if scores else (float("nan"), float("nan"))
    rng, n = random.Random(seed), len(scores)
    means = sorted(sum(rng.choices(scores, k=n)) / n for _ in range(RESAMPLES))
    return means[int(0.025 * RESAMPLES)], means[int(0.975 * RESAMPLES) - 1]


def summarize(rows: list[dict]) -> dict:
    """{length: {policy: {score, n, relative_kv_size, by_task}}} and the full cache's
    agreement with transformers."""
    cells: dict[int, dict[str, list[dict]]] = {}
    for r in rows:
        cells.setdefault(r["length"], {}).setdefault(r["policy"], []).append(r)
    out: dict = {}
    for length, by_policy in sorted(cells.items()):
        out[length] = {}
        for label, rs in by_policy.items():
            rel = sum(r["relative_kv_size"] for r in rs) / len(rs)
            if _kind(label).endswith("4bit"):
                rel *= FOUR_BIT
            tasks: dict[str, list[float]] = {}
            for r in rs:
                tasks.setdefault(r["task"], []).append(r["score"])
            scores = [100 * r["score"] for r in rs]
            out[length][label] = {
                "score": sum(scores) / len(scores), "n": len(rs),
                "interval95": interval(scores),
                "relative_kv_size": rel if label != "transformers" else 1.0,
                "by_task": {t: 100 * sum(v) / len(v) for t, v in sorted(tasks.items())},
                "seconds_per_prompt": sum(r["seconds"] for r in rs) / len(rs)}
        full = {r["sample"]: r for r in by_policy.get("full", [])}
        for label, rs in by_policy.items():
            paired = [100 * (r["score"] - full[r["sample"]]["score"]) for r in rs
                      if r["sample"] in full]
            if label != "full" and paired:
                out[length][label]["minus_full"] = {
                    "prompts": len(paired), "mean": sum(paired) / len(paired),
                    "interval95": interval(paired)}
        ref = {r["sample"]: r for r in by_policy.get("transformers", [])}
        both = sorted(set(full) & set(ref))
        if both:
            out[length]["full_vs_transformers"] = {
                "prompts": len(both),
                "same_tokens": sum(full[k]["tokens"] == ref[k]["tokens"] for k in both),
                "same_score": sum(full[k]["score"] == ref[k]["score"] for k in both)}
    return out


def _cell(c: dict) -> str:
    lo, hi = c["interval95"]
    return f"{c['score']:.1f} [{lo:.1f}, {hi:.1f}]"


def markdown(summary: dict, settings: dict) -> str:
    lengths = sorted(summary)
    tasks = settings["tasks"]
    lines = [f"# Long-context retrieval: {settings['model']}", "",
             f"Tasks {', '.join(tasks)}; needle depths {settings['depths']}; "
             f"{settings['seeds']} seed(s) (n counts the prompts of each cell); "
             f"filler: {settings['filler']}. "
             "Score: share of the expected answers found in the generated tokens (0-100), "
             "with a 95% interval: percentile bootstrap over the prompts (2,000 resamples). "
             "Minus full: the paired difference to the full cache on the same prompts, with its "
             "bootstrap interval. Relative KV: rows attention read over rows cached, all "
             "layers; 4-bit rows also count their bytes against an fp16 cache.",
             "", "Regenerate from the JSONL: `python benchmarks/long_context_accuracy_report.py "
             f"--tag {settings.get('tag', 'TAG')}`."]
    for n in lengths:
        labels = [k for k in summary[n] if k != "full_vs_transformers"]
        lines += ["", f"## {n} tokens", "",
                  "| policy | n | score [95%] | minus full [95%] | rel. KV | "
                  + " | ".join(tasks) + " |", "|---|---|---|---|---|" + "---|" * len(tasks)]
        for label in labels:
            c = summary[n][label]
            d = c.get("minus_full")
            diff = f"{d['mean']:+.1f} [{d['interval95'][0]:+.1f}, {d['interval95'][1]:+.1f}]" \
                if d else ""
            lines.append(f"| {label} | {c['n']} | {_cell(c)} | {diff} | "
                         f"{c['relative_kv_size']:.3f} | " + " | ".join(
                             f"{c['by_task'][t]:.0f}" if t in c["by_task"] else ""
                             for t in tasks) + " |")
        a = summary[n].get("full_vs_transformers")
        if a:
            lines += ["", f"Full cache against transformers on the same token ids: "
                      f"{a['same_tokens']}/{a['prompts']} same tokens, {a['same_score']}/"
                      f"{a['prompts']} same score."]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(summary)
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        cells = {k: v for k, v in summary[n].items() if k != "full_vs_transformers"}
        curves: dict[str, list] = {}
        for label, c in cells.items():
            curves.setdefault(_kind(label), []).append(
                (c["relative_kv_size"], c["score"], *c.get("interval95", (c["score"],) * 2)))
        for kind, pts in sorted(curves.items()):
            pts.sort()
            style = "--" if kind in ("full", "transformers") else "-o"
            if kind in ("full", "transformers"):
                ax.axhline(pts[0][1], ls=":" if kind == "transformers" else "--",
                           label=f"{kind} ({pts[0][1]:.0f})", color="k" if kind == "full"
                           else "gray")
                continue
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], fmt=style, label=kind,
                        yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                        capsize=3)
        ax.set(xscale="log", xlabel="relative KV size", ylabel="score (0-100)",
               title=f"{n} tokens", ylim=(-5, 105))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_outputs(rows: list[dict], stem: Path, settings: dict) -> str:
    summary = summarize(rows)
    stem.with_suffix(".json").write_text(json.dumps(
        {"settings": settings, "summary": {str(k): v for k, v in summary.items()}}, indent=1))
    text = markdown(summary, settings)
    stem.with_suffix(".md").write_text(text)
    plot(summary, stem.with_suffix(".png"))
    update_set(stem.parent / SET, summary, settings)
    return text


def set_rows(summary: dict, settings: dict) -> list[dict]:
    """One flat row a (length, policy) of a tag's summary, for the combined set."""
    rows = []
    for length, cells in summary.items():
        for label, c in cells.items():
            if label == "full_vs_transformers":
                continue
            d = c.get("minus_full") or {}
            lo, hi = c["interval95"]
            rows.append({"model": NAMES.get(settings["model"], settings["model"]),
                         "tag": settings.get("tag"), "length": int(length), "policy": label,
                         "score": c["score"], "n": c["n"], "score_lo": lo, "score_hi": hi,
                         "minus_full": d.get("mean"),
                         "minus_full_lo": (d.get("interval95") or [None])[0],
                         "minus_full_hi": (d.get("interval95") or [None, None])[1],
                         "relative_kv_size": c["relative_kv_size"],
                         "by_task": c["by_task"]})
    return rows


def update_set(stem: Path, summary: dict, settings: dict, meta: dict | None = None) -> None:
    """Put a tag's summary into the combined set as that tag's run, and rewrite its .md and
    .png. The run keeps its meta while its rows are unchanged."""
    doc = artifacts.load(stem)
    rows = set_rows(summary, settings)
    runs = doc["runs"]
    old = next((i for i, r in enumerate(runs) if r["settings"].get("tag") == settings.get("tag")),
               None)
    if meta is None:
        meta = (runs[old]["meta"] if old is not None and runs[old]["rows"] == rows
                else artifacts.run_meta())
    run = {"meta": meta, "settings": settings, "rows": rows}
    if old is None:
        runs.append(run)
    else:
        runs[old] = run
    doc["benchmark"] = ("long_context_accuracy.py: needle retrieval at long context under "
                        "each KV policy, one run a model (tag)")
    artifacts.save(stem, doc)
    write_set(stem)


def _k(length: int) -> str:
    return f"{round(length / 1024)}K"


def set_markdown(doc: dict) -> str:
    runs = doc["runs"]
    lengths = sorted({r["length"] for run in runs for r in run["rows"]},
                     key=lambda n: round(n / 1024))
    ks = list(dict.fromkeys(_k(n) for n in lengths))
    groups = artifacts.grouped(runs, ["model", "policy"])
    lines = ["# Long-context retrieval under a KV budget", "", artifacts.meta_line(runs), "",
             "| model | policy | rel. KV | " + " | ".join(f"{k} score" for k in ks) + " |",
             "|" + "---|" * (3 + len(ks))]
    for (model, policy), rows in groups.items():
        first = min(r["length"] for r in rows)
        cells = [model, policy, artifacts.spread(
            (r["relative_kv_size"] for r in rows if r["length"] == first), "{:.3f}")]
        cells += [artifacts.spread((r["score"] for r in rows if _k(r["length"]) == k), "{:.1f}")
                  for k in ks]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Score: share of the expected answers found (0-100), the mean over a "
              "length's prompts; each cell: median (min-max, N runs). The runs, with each "
              "score's 95% interval and its paired difference to the full cache:"]
    for run in runs:
        st = run["settings"]
        summary: dict = {}
        for r in run["rows"]:
            c = {"score": r["score"], "n": r["n"], "interval95": [r["score_lo"], r["score_hi"]],
                 "relative_kv_size": r["relative_kv_size"], "by_task": r["by_task"]}
            if r.get("minus_full") is not None:
                c["minus_full"] = {"mean": r["minus_full"],
                                   "interval95": [r["minus_full_lo"], r["minus_full_hi"]]}
            summary.setdefault(r["length"], {})[r["policy"]] = c
        lines += ["", markdown(summary, st).replace("\n## ", "\n### ").replace(
            "# Long-context retrieval: ", "## ").rstrip()]
    return "\n".join(lines) + "\n"


def write_set(stem: Path) -> None:
    """The combined set's .md (every run) and .png (score against relative KV, one panel a
    model and length)."""
    doc = artifacts.load(stem)
    stem.with_suffix(".md").write_text(set_markdown(doc))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = artifacts.grouped(doc["runs"], ["model", "length"])
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, ((model, length), rows) in zip(axes[0], panels.items()):
        curves: dict[str, list] = {}
        for r in rows:
            if r["policy"] in ("full", "transformers"):
                if r["policy"] == "full":
                    ax.axhline(r["score"], ls="--", color="k", label=f"full ({r['score']:.0f})")
                continue
            curves.setdefault(_kind(r["policy"]), []).append(
                (r["relative_kv_size"], r["score"]))
        for kind, pts in sorted(curves.items()):
            ax.plot(*zip(*sorted(pts)), "-o", label=kind)
        ax.set(xscale="log", xlabel="relative KV size", ylabel="score (0-100)",
               title=f"{model}, {length} tokens", ylim=(-5, 105))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=90)
    plt.close(fig)


def load_rows(path: Path) -> list[dict]:
    """The last result of each (policy, prompt) in a benchmark's JSONL."""
    done = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            done[(row["policy"], row["sample"])] = row
    return list(done.values())


def settings_of(rows: list[dict], tag: str, base: dict) -> dict:
    """The report's settings from the rows (and what only the run knew, from ``base``)."""
    order = ("single", "multikey", "multivalue", "vartrack")
    tasks = sorted({r["task"] for r in rows}, key=lambda t: (order + (t,)).index(t))
    return {"model": base.get("model", "?"), "filler": base.get("filler", "?"), "tag": tag,
            "tasks": tasks, "depths": sorted({r["depth"] for r in rows}),
            "seeds": len({r["seed"] for r in rows}),
            "lengths": sorted({r["length"] for r in rows}),
            "policies": sorted({r["policy"] for r in rows}),
            "reference": any(r["policy"] == "transformers" for r in rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tag", required=True, help="the benchmark's --tag (results/..._TAG.jsonl)")
    p.add_argument("--model-name", default=None,
                   help="the model's name in the title (default: the last report's)")
    p.add_argument("--filler", default=None, help="the filler text's name (default: the last "
                   "report's)")
    a = p.parse_args(argv)
    stem = RESULTS / f"long_context_accuracy_{a.tag}"
    path = stem.with_suffix(".jsonl")
    if not path.is_file():
        print(f"error: {path} does not exist; run benchmarks/long_context_accuracy.py "
              f"--tag {a.tag} first", file=sys.stderr)
        return 2
    rows = load_rows(path)
    old = stem.with_suffix(".json")
    base = json.loads(old.read_text()).get("settings", {}) if old.is_file() else {}
    if not base:  # the tag's run in the combined set
        runs = artifacts.load(RESULTS / SET)["runs"]
        base = next((dict(r["settings"]) for r in runs if r["settings"].get("tag") == a.tag), {})
    base.update({k: v for k, v in (("model", a.model_name), ("filler", a.filler)) if v})
    print(write_outputs(rows, stem, settings_of(rows, a.tag, base)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
