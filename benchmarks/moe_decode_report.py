"""The artifact set of ``moe_decode.py``: ``OUT.json`` holds a ``runs`` list (one entry per
invocation, ``artifacts.py``), and ``OUT.md`` and ``OUT.png`` are made from all of its runs:
each cell the median, min and max over the runs that measured that row.

    python benchmarks/moe_decode_report.py benchmarks/results/moe_decode   # md and png again
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import artifacts  # noqa: E402

NAMES = {"qwen3-30b-a3b": "Qwen3-30B-A3B", "olmoe-1b-7b": "OLMoE-1B-7B"}
# the order of a table's rows within a model and context
POLICY_ORDER = ["full", "infinigen", "infinigen-half", "infinigen-own@0.1",
                "infinigen-pages@0.1", "llama.cpp"]
KEYS = ["model", "context x batch", "policy"]
COLUMNS = [("decode tok/s", "decode_tokens_s"), ("step ms", "step_ms"),
           ("step / bound", "step_over_bound"), ("x full cache, same run", "over_full")]
EXPLAIN = ("Step / bound: the decode step's time over what it must read (dense weights, the "
           "routed experts, the KV rows; InfiniGen: its speculation keys and chosen rows) at "
           "the read bandwidth measured just before the row; none where experts are read from "
           "disk. A cut keeps some of the model's layers and the same share of its "
           "vocabulary: the whole model's rate is the cut's times kept / all layers.")


def disk_percent(row: dict) -> float:
    """The share of the routed experts placed on disk (0: every expert in memory)."""
    placed = row.get("experts_percent")
    return 0.0 if not placed else max(0.0, 100.0 - sum(placed))


def model_label(row: dict) -> str:
    """The model, the layers kept where it is a cut, the experts on disk where any are."""
    label = NAMES.get(row["model"], row["model"])
    layers, whole = row.get("layers"), row.get("model_layers")
    if layers and whole and layers < whole:
        label += f", {layers} of {whole} layers"
    disk = disk_percent(row)
    if disk:
        label += f", {disk:g}% of experts on disk"
    return label


def _order(row: dict, label: dict) -> tuple:
    policy = label["policy"]
    model = list(NAMES).index(row["model"]) if row["model"] in NAMES else len(NAMES)
    return (model, row["model"], -(row.get("layers") or 0), disk_percent(row), row["context"],
            row["batch"], POLICY_ORDER.index(policy) if policy in POLICY_ORDER else 99, policy)


def table_rows(runs: list[dict]) -> list[dict]:
    """Every run's measured rows as the table's fields, in the table's order: the key fields,
    tokens/s, step ms, step over bound, and (InfiniGen) tokens/s over the same run's full
    cache at the same model, context and batch."""
    out = []
    for run in runs:
        rows = [r for r in run["rows"] if "decode_tokens_s" in r]
        full = {(model_label(r), r["context"], r["batch"]): r["decode_tokens_s"]
                for r in rows if r["policy"] == "full"}
        for r in rows:
            key = (model_label(r), r["context"], r["batch"])
            fields = {"model": key[0], "context x batch": f"{r['context']} x {r['batch']}",
                      "policy": r["policy"], "decode_tokens_s": r["decode_tokens_s"],
                      "step_ms": 1e3 * r["decode_step_s"] if "decode_step_s" in r else None,
                      "step_over_bound": None if disk_percent(r) else r.get("step_over_bound"),
                      "over_full": (r["decode_tokens_s"] / full[key]
                                    if r["policy"] not in ("full", "llama.cpp") and key in full
                                    else None)}
            out.append((_order(r, fields), fields))
    return [f for _, f in sorted(out, key=lambda x: x[0])]


class _Figures:
    """``artifacts.spread``'s number format: three significant figures, never an exponent
    (a step of 13.9 s reads 13,908 ms, not 1.39e+04)."""

    @staticmethod
    def format(x: float) -> str:
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def table(runs: list[dict]) -> str:
    """The markdown table: one line per model, context x batch and policy, each cell
    ``median (min-max, N runs)``. Rows are passed to ``artifacts.table`` as one list, sorted
    (its lines follow the first appearance of each key); each run holds at most one row a
    key, so a cell's count is its runs."""
    return artifacts.table([{"rows": table_rows(runs)}], KEYS, COLUMNS, fmt=_Figures())


def bandwidths(runs: list[dict]) -> list[float]:
    """The read bandwidths (GB/s) measured before each row of ``runs``."""
    return [r["bandwidth"] / 1e9 for run in runs for r in run["rows"] if r.get("bandwidth")]


def _range(xs: list[float]) -> str:
    lo, hi = f"{min(xs):.0f}", f"{max(xs):.0f}"
    return lo if lo == hi else f"{lo}-{hi}"


def markdown(doc: dict) -> str:
    runs = doc["runs"]
    bw = bandwidths(runs)
    lines = [f"# {doc.get('title', 'Mixture-of-experts decode')}", "",
             artifacts.meta_line(runs) + (f"; read bandwidth {_range(bw)} GB/s measured "
                                          "before the rows" if bw else ""), "",
             doc.get("weights", ""), "", EXPLAIN, "", table(runs)]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    """Each table line's median tokens/s, the bar's whisker from the min to the max run."""
    plt = artifacts.pyplot()
    if plt is None:
        return
    groups = artifacts.grouped([{"rows": table_rows(doc["runs"])}], KEYS)
    if not groups:
        return
    labels, med, lo, hi, colors = [], [], [], [], []
    palette = {"full": "tab:blue", "llama.cpp": "tab:gray", "infinigen": "tab:orange",
               "infinigen-half": "tab:green"}
    for (model, ctx, policy), rows in groups.items():
        xs = [r["decode_tokens_s"] for r in rows]
        m = statistics.median(xs)
        wrapped = model.replace(", ", ",\n")
        labels.append(f"{wrapped}\n{ctx}, {policy}\n({len(xs)} run{'s' if len(xs) > 1 else ''})")
        med.append(m)
        lo.append(m - min(xs))
        hi.append(max(xs) - m)
        colors.append(palette.get(policy, "tab:purple"))
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(labels)), 4.5))
    ax.bar(range(len(med)), med, 0.6, yerr=[lo, hi], capsize=4, color=colors)
    ax.set_xticks(list(range(len(med))), labels, fontsize=6)
    ax.set_ylabel("decode tokens/s (median; whiskers: min-max)")
    ax.set_title(doc.get("title", "Mixture-of-experts decode"))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(doc: dict, out: Path) -> None:
    """``OUT.md`` and ``OUT.png`` from every run of ``doc`` (its JSON is written by the
    caller, through ``artifacts``)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(doc)
    out.with_suffix(".md").write_text(text)
    plot(doc, out.with_suffix(".png"))
    print(text)


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description="md and png of a moe_decode JSON, from its runs")
    p.add_argument("out", nargs="+", help="results paths, without the suffix")
    a = p.parse_args(argv)
    for out in a.out:
        write_outputs(artifacts.load(Path(out)), Path(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
