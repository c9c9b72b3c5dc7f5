"""The markdown table and the bar chart of throughput.py's results, rebuilt from every run in
its JSON (see benchmarks/README.md for what each column means).

    python benchmarks/throughput_report.py                  # results/throughput_cpu.json
    python benchmarks/throughput_report.py path/to/throughput.json

Each run holds one row per model and policy (and the transformers reference); a row measured
in several runs is one line of the table, each number ``median (min-max, N runs)``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from artifacts import RESULTS, load, meta_line, pyplot, table  # noqa: E402

KEYS = ["model", "batch x prompt + generated", "policy"]
COLUMNS = [("decode tok/s", "decode_tokens_per_s"), ("prefill s", "prefill_s"),
           ("vs transformers", "ratio_vs_transformers"),
           ("weights GB/step", "weights_gb_step"), ("KV cache MB/step", "kv_mb_step"),
           ("peak device GB", "peak_device_gb"), ("peak host GB", "peak_host_gb"),
           ("peak disk GB", "peak_disk_gb")]


def _moved_mb(row: dict, kind: str) -> float | None:
    """MB of one kind a generation step moves, summed over the links it crosses."""
    per = row.get("bytes_per_token")
    if per is None:
        return None
    return sum(links[kind] for links in per.values()) / 1e6


def _moved_gb(row: dict, kind: str) -> float | None:
    mb = _moved_mb(row, kind)
    return None if mb is None else mb / 1e3


def view(row: dict) -> dict:
    """A row with the table's key fields, MB moved a step and peak GB by tier."""
    peak = row.get("peak_memory_bytes") or {}
    out = {**row, "batch x prompt + generated":
           f"{row['batch']} x {row['prompt_len']} + {row['gen_len']}",
           "weights_gb_step": _moved_gb(row, "weights"), "kv_mb_step": _moved_mb(row, "kv_cache")}
    for tier in ("device", "host", "disk"):
        out[f"peak_{tier}_gb"] = peak[tier] / 1e9 if tier in peak else None
    if row["policy"] == "transformers generate":
        out["ratio_vs_transformers"] = 1.0
    return out


def rows_of(runs: list[dict]) -> list[dict]:
    return [view(r) for run in runs for r in run["rows"]]


def markdown(doc: dict) -> str:
    runs = doc["runs"]
    lines = [f"# Decode throughput and bytes moved, {doc.get('device', 'CPU')}", "",
             meta_line(runs) + ".", "",
             "Each number: median (min-max, N runs); a run's time is the fastest quiet one of "
             "its repeats. GB/step, MB/step: bytes a generation step (one token for each "
             "prompt) moves, by kind, summed over the links it crosses.", "",
             table([{"rows": rows_of(runs)}], KEYS, COLUMNS).rstrip("\n"), "", "Runs:", ""]
    for i, run in enumerate(runs, 1):
        m = run["meta"]
        lines.append(f"{i}. {m.get('date')}, commit {m.get('commit')}, {m.get('cpu')}, "
                     f"{m.get('cores')} cores: `{m.get('command')}`"
                     + (f" ({m['note']})" if m.get("note") else ""))
    loud = [r for r in runs[-1]["rows"] if not r.get("quiet", True)] if runs else []
    if loud:
        lines += ["", "Measured while other processes used more than "
                  f"{100 * runs[-1]['settings']['max_others']:.0f}% of the CPU (unreliable) in "
                  "the latest run: " + ", ".join(f"{r['model']} / {r['policy']}" for r in loud)]
    return "\n".join(lines) + "\n"


def bar_chart(doc: dict, path: Path) -> bool:
    """Median decode tokens/s per policy (the bar from min to max), one panel per model and
    lengths, saved to ``path``; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    panels: dict[tuple, dict[str, list[float]]] = {}
    for r in rows_of(doc["runs"]):
        panels.setdefault((r["model"], r["batch x prompt + generated"]), {}).setdefault(
            r["policy"], []).append(r["decode_tokens_per_s"])
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, ((model, shape), bars) in zip(axes[0], panels.items()):
        names = list(bars)
        med = [statistics.median(v) for v in bars.values()]
        err = [[m - min(v) for m, v in zip(med, bars.values())],
               [max(v) - m for m, v in zip(med, bars.values())]]
        colors = ["tab:gray" if n == "transformers generate" else "tab:blue" for n in names]
        ax.bar(range(len(names)), med, yerr=err, capsize=3, color=colors)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_title(f"{model} (batch x prompt + generated: {shape})", fontsize=10)
        ax.set_ylabel("decode tokens/s")
    fig.suptitle(f"Decode throughput, {doc.get('device', 'CPU')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(doc: dict, json_path: Path) -> list[Path]:
    """The ``.md`` and ``.png`` beside ``json_path`` from every run of ``doc``."""
    md = Path(json_path).with_suffix(".md")
    md.write_text(markdown(doc))
    png = Path(json_path).with_suffix(".png")
    return [md, png] if bar_chart(doc, png) else [md]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="?", default=str(RESULTS / "throughput_cpu.json"))
    a = p.parse_args(argv)
    path = Path(a.json).with_suffix(".json")
    written = write_outputs(load(path), path)
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
