"""The markdown tables and the bar chart of a throughput.py result (see benchmarks/README.md
for what each column means)."""
from __future__ import annotations

from pathlib import Path

from flexgen_infinigen.runtime.tiers import LINKS


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f}"


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _busy(r: dict) -> str:
    x = r.get("other_processes_cpu")
    return ("-" if x is None else f"{100 * x:.0f}%") + ("" if r.get("quiet", True) else " (!)")


SHORT = {"disk->host": "disk>h", "host->device": "h>d", "device->host": "d>h",
         "host->disk": "h>disk"}


def _links(bpt: dict, kind: str) -> str:
    """MB per step of one kind, by link, e.g. 'h>d 48.5, d>h 1.5' ('0' when nothing moved)."""
    parts = [f"{SHORT[link]} {_mb(bpt[link][kind])}" for link in LINKS if bpt[link][kind]]
    return ", ".join(parts) or "0"


def markdown(result: dict) -> str:
    """One table per model: our policies and the transformers reference."""
    m = result["machine"]
    lines = [f"# Decode throughput on {m['device_name']} ({m['cpu_count']} CPUs, "
             f"torch {m['torch_version']}, transformers {m['transformers_version']})", ""]
    for model, entry in result["models"].items():
        s = entry["settings"]
        lines += [f"## {model}", "",
                  f"batch {s['batch']}, prompt {s['prompt_len']} tokens, generate "
                  f"{s['gen_len']} tokens, {s['dtype']}; model {_mb(entry['model_bytes'])} MB. "
                  "Bytes are per generation step (one new token for each of the "
                  f"{s['batch']} prompts), averaged over all {s['gen_len']} steps "
                  f"(prefill included). Times are the best of {s['repeats']} "
                  f"run{'s' if s['repeats'] > 1 else ''} (more when another process was "
                  "busy). (!) marks a time measured while other processes used more than "
                  f"{100 * result['settings']['max_others']:.0f}% of the CPU: unreliable.", ""]
        if s.get("reduced"):
            lines += [f"Lengths reduced from the defaults: {s['reduced']}", ""]
        lines += ["| policy | percent | decode tok/s | prefill s | vs HF | "
                  "weights MB/step | KV cache MB/step | activations MB/step | "
                  "peak device GB | peak host GB | peak disk GB | others' CPU |",
                  "|---|---|---:|---:|---:|---|---|---|---:|---:|---:|---:|"]
        for r in entry["rows"]:
            bpt = r["bytes_per_token"]
            pk = r["peak_memory_bytes"]
            pct = " ".join(f"{p:g}" for p in r["percent"]) + (" +4bit" if r["compress_weight"]
                                                             else "")
            lines.append(f"| {r['policy']} | {pct} | {r['decode_tokens_per_s']:.2f} | "
                         f"{r['prefill_s']:.2f} | {_num(r['ratio_vs_transformers'])} | "
                         f"{_links(bpt, 'weights')} | {_links(bpt, 'kv_cache')} | "
                         f"{_links(bpt, 'activations')} | {_gb(pk['device'])} | "
                         f"{_gb(pk['host'])} | {_gb(pk['disk'])} | "
                         f"{_busy(r)} |")
        hf = entry["transformers"]
        if hf is not None:
            lines.append(f"| transformers generate | - | {hf['decode_tokens_per_s']:.2f} | "
                         f"{hf['prefill_s']:.2f} | 1.00 | - | - | - | - | - | - | "
                         f"{_busy(hf)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def bar_chart(result: dict, path: Path) -> bool:
    """Decode tokens/s per policy, one panel per model, saved to ``path``; False when
    matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(result["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        entry = result["models"][model]
        names = [r["policy"] for r in entry["rows"]]
        values = [r["decode_tokens_per_s"] for r in entry["rows"]]
        colors = ["tab:blue"] * len(entry["rows"])
        if entry["transformers"] is not None:
            names.append("transformers generate")
            values.append(entry["transformers"]["decode_tokens_per_s"])
            colors.append("tab:gray")
        ax.bar(range(len(names)), values, color=colors)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        s = entry["settings"]
        ax.set_title(f"{model} (batch {s['batch']}, prompt {s['prompt_len']}, "
                     f"gen {s['gen_len']})", fontsize=10)
        ax.set_ylabel("decode tokens/s")
    fig.suptitle(f"Decode throughput, {result['machine']['device_name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
