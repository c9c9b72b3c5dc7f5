"""The long-context benchmark's outputs, rebuilt from every run in its JSON: a markdown table
of medians over the runs (``artifacts.table``) and a plot.

    python benchmarks/long_context_report.py                       # results/long_context
    python benchmarks/long_context_report.py benchmarks/results/long_context_qwen

Each run (``long_context.py``, appended to ``runs``) holds its rows, one per model, context,
batch and policy; a row measured in several runs is one line of the table, each number
``median (min-max, N runs)``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from artifacts import RESULTS, load, meta_line, table  # noqa: E402

# the order of the table's lines within a model and shape; other labels follow as they come
ORDER = ["full", "full-w4", "full-4bit", "infinigen", "infinigen-w4", "infinigen@0.1",
         "infinigen@0.1-w4", "infinigen-own-w4", "infinigen-own@0.1-w4", "infinigen-input@0.1",
         "infinigen-input@0.1-w4", "infinigen-input-half@0.1-w4", "h2o", "transformers",
         "llama.cpp"]
# a model's file or registry name -> the name the table shows
NAMES = {"smollm2-135m": "SmolLM2-135M", "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B"}
KEYS = ["model", "batch x context", "policy"]
COLUMNS = [("prefill tok/s", "prefill_tokens_s"), ("decode tok/s", "decode_tokens_s"),
           ("step / bound", "step_over_bound"), ("peak RSS GB", "peak_rss_gb")]


def model_label(row: dict) -> str:
    """``SmolLM2-135M`` for ``smollm2-135m`` or ``path/to/SmolLM2-135M-Instruct.Q4_1.gguf``."""
    name = str(row.get("model_name") or Path(str(row["model"])).name)
    low = name.lower()
    for prefix, label in NAMES.items():
        if low.startswith(prefix):
            return label
    return name.removesuffix(".gguf")


def view(row: dict) -> dict:
    """A measured row with the table's key fields and the peak RSS in GB."""
    rss = row.get("peak_rss_bytes")
    return {**row, "model": model_label(row),
            "batch x context": f"{row['batch']} x {row['context']:,}",
            "peak_rss_gb": None if rss is None else rss / 1e9}


def ordered_rows(runs: list[dict]) -> list[dict]:
    """Every run's measured rows (errors left out), as ``view``s, sorted for the table."""
    rows = [view(r) for run in runs for r in run["rows"] if "error" not in r]
    models = [*NAMES.values(), *dict.fromkeys(r["model"] for r in rows)]
    extra = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] not in ORDER))
    rank = {p: i for i, p in enumerate(ORDER + extra)}
    return sorted(rows, key=lambda r: (models.index(r["model"]), r["context"], -r["batch"],
                                       rank[r["policy"]]))


def markdown(doc: dict) -> str:
    runs = doc["runs"]
    lines = ["# Long context, KV cache in CPU memory", "", meta_line(runs) + ".", "",
             "Each number: median (min-max, N runs) over the runs that measured the line. "
             "step / bound: the decode step over the bytes it must read (weights once, the KV "
             "rows and speculation keys the policy reads) at the read bandwidth measured just "
             "before the row. Prefill is empty where the row decoded from a prefill an earlier "
             "row kept; llama.cpp's is its `pp` test (512 prompt tokens after the context).", "",
             table([{"rows": ordered_rows(runs)}], KEYS, COLUMNS).rstrip("\n"), "", "Runs:", ""]
    for i, run in enumerate(runs, 1):
        m = run.get("meta", {})
        bw = m.get("bandwidth_gb_s")
        lines.append(f"{i}. {m.get('date')}, commit {m.get('commit')}, {m.get('cpu')}, "
                     f"{m.get('cores')} cores"
                     + (f", read bandwidth {bw:.1f} GB/s" if bw else "")
                     + f": `{m.get('command')}`" + (f" ({m['note']})" if m.get("note") else ""))
    errors = [r for run in runs[-1:] for r in run["rows"] if "error" in r]
    if errors:
        lines += ["", "Errors in the latest run:", ""]
        lines += [f"- {r['policy']}, {r['batch']} x {r['context']}: {r['error']}" for r in errors]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    """Decode tokens/s of each line (median, the bar from min to max), a panel per model and
    context."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ordered_rows(doc["runs"])
    batches: dict[tuple, set] = {}
    for r in rows:
        batches.setdefault((r["model"], r["context"]), set()).add(r["batch"])
    groups: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        panel = (r["model"], r["context"])
        name = r["policy"] + (f", batch {r['batch']}" if len(batches[panel]) > 1 else "")
        groups.setdefault(panel, {}).setdefault(name, []).append(r["decode_tokens_s"])
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 4.4), squeeze=False)
    for ax, ((model, context), lines) in zip(axes[0], groups.items()):
        names = list(lines)
        med = [statistics.median(v) for v in lines.values()]
        err = [[m - min(v) for m, v in zip(med, lines.values())],
               [max(v) - m for m, v in zip(med, lines.values())]]
        colors = ["tab:gray" if n in ("llama.cpp", "transformers") else "tab:blue"
                  for n in names]
        ax.barh(range(len(names)), med, xerr=err, color=colors, capsize=3)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("decode tokens/s (all sequences)")
        ax.set_title(f"{model}, {context:,} tokens"
                     + "".join(f", batch {b}" for b in batches[(model, context)]
                               if len(batches[(model, context)]) == 1), fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(doc: dict, stem: Path) -> None:
    """``STEM.md`` and ``STEM.png`` from every run of ``doc`` (the JSON is ``append_run``'s)."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(markdown(doc))
    try:
        plot(doc, stem.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
    print(f"written {stem}.json, .md, .png ({len(doc['runs'])} runs)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stem", nargs="?", default=str(RESULTS / "long_context"),
                   help="the artifact without its suffix (default: results/long_context)")
    a = p.parse_args(argv)
    stem = Path(a.stem).with_suffix("") if a.stem.endswith(".json") else Path(a.stem)
    write_outputs(load(stem), stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
