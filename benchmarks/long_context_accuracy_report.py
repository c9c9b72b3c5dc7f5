"""The long-context accuracy benchmark's outputs: a summary JSON, a markdown table and a plot
(score against relative KV size, one curve per policy, one panel per length)."""
from __future__ import annotations

import json
from pathlib import Path

# a 4-bit cache's bytes over an fp16 cache's: half a byte per value plus a 2-byte scale and
# minimum per group of 64 (as in accuracy_sweep)
FOUR_BIT = (0.5 + 2 * 2 / 64) / 2


def _kind(label: str) -> str:
    """The curve a label belongs to: ``infinigen@0.1`` -> infinigen; a cap in tokens
    (``infinigen#512``) and another first selecting layer (``:L1``) are curves of their own."""
    base, _, first = label.removesuffix("-w4").partition(":L")
    kind, _, tokens = base.partition("@")[0].partition("#")
    return kind + (" (token cap)" if tokens else "") + (f" from layer {first}" if first else "")


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
            out[length][label] = {
                "score": 100 * sum(r["score"] for r in rs) / len(rs), "n": len(rs),
                "relative_kv_size": rel if label != "transformers" else 1.0,
                "by_task": {t: 100 * sum(v) / len(v) for t, v in sorted(tasks.items())},
                "seconds_per_prompt": sum(r["seconds"] for r in rs) / len(rs)}
        full = {r["sample"]: r for r in by_policy.get("full", [])}
        ref = {r["sample"]: r for r in by_policy.get("transformers", [])}
        both = sorted(set(full) & set(ref))
        if both:
            out[length]["full_vs_transformers"] = {
                "prompts": len(both),
                "same_tokens": sum(full[k]["tokens"] == ref[k]["tokens"] for k in both),
                "same_score": sum(full[k]["score"] == ref[k]["score"] for k in both)}
    return out


def markdown(summary: dict, settings: dict) -> str:
    lengths = sorted(summary)
    labels = []
    for n in lengths:
        labels += [k for k in summary[n] if k not in labels and k != "full_vs_transformers"]
    lines = [f"# Long-context retrieval: {settings['model']}", "",
             f"Tasks {', '.join(settings['tasks'])}; needle depths {settings['depths']} (not "
             f"every depth at every length: n counts the prompts); {settings['seeds']} seed(s); "
             f"filler: {settings['filler']}. "
             "Score: share of the expected answers found in the generated tokens (0-100). "
             "Relative KV: rows attention read over rows cached, all layers; 4-bit rows also "
             "count their bytes against an fp16 cache.", "",
             "| policy | " + " | ".join(f"{n} tokens: score (rel. KV)" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for label in labels:
        cells = []
        for n in lengths:
            c = summary[n].get(label)
            cells.append(f"{c['score']:.1f} ({c['relative_kv_size']:.3f}), n={c['n']}"
                         if c else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "By task (score):", "",
              "| policy | length | " + " | ".join(settings["tasks"]) + " |",
              "|---|---|" + "---|" * len(settings["tasks"])]
    for label in labels:
        for n in lengths:
            c = summary[n].get(label)
            if c:
                lines.append(f"| {label} | {n} | " + " | ".join(
                    f"{c['by_task'][t]:.0f}" if t in c["by_task"] else ""
                    for t in settings["tasks"]) + " |")
    agree = [(n, summary[n]["full_vs_transformers"]) for n in lengths
             if "full_vs_transformers" in summary[n]]
    if agree:
        lines += ["", "Full cache against transformers on the same token ids: " + "; ".join(
            f"{n}: {a['same_tokens']}/{a['prompts']} same tokens, {a['same_score']}/"
            f"{a['prompts']} same score" for n, a in agree) + "."]
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
            curves.setdefault(_kind(label), []).append((c["relative_kv_size"], c["score"]))
        for kind, pts in sorted(curves.items()):
            pts.sort()
            style = "--" if kind in ("full", "transformers") else "-o"
            if kind in ("full", "transformers"):
                ax.axhline(pts[0][1], ls=":" if kind == "transformers" else "--",
                           label=f"{kind} ({pts[0][1]:.0f})", color="k" if kind == "full"
                           else "gray")
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=kind)
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
    return text
