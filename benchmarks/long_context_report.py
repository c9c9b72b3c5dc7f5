"""The long-context benchmark's outputs: JSON, a markdown table and a plot."""
from __future__ import annotations

import json
from pathlib import Path


def _spread(result: dict) -> str:
    """When rows come from runs that measured different bandwidths (``--update``)."""
    seen = sorted({r["bandwidth"] for r in result["rows"] if "bandwidth" in r})
    if len(seen) < 2:
        return ""
    return (f" in the latest run; the rows come from runs that measured "
            f"{seen[0] / 1e9:.1f}-{seen[-1] / 1e9:.1f} GB/s, and each row's bound uses its own")


def _plan(r: dict) -> str:
    """The memory plan's prediction plus the process's baseline (Python, torch, libraries:
    measured before loading), and how far the peak RSS is from it."""
    if "planned_bytes" not in r:
        return ""
    want = r["planned_bytes"] + r.get("baseline_rss_bytes", 0)
    return f"{want / 1e9:.2f} ({100 * (r['peak_rss_bytes'] / want - 1):+.0f}%)"


def markdown(result: dict) -> str:
    bw = result["read_bandwidth_bytes_s"] / 1e9
    m = result["machine"]
    lines = [f"# Long context, KV cache in CPU memory ({m['cpu']}, {m['torch_threads']} threads)",
             "", f"Read bandwidth (1 GiB `sum`, all threads): {bw:.1f} GB/s{_spread(result)}. "
             "A step's bound is the bytes it must read (weights once, the KV rows and "
             "speculation keys the policy reads) over that bandwidth. \"plan + base\": the "
             "memory plan's bytes plus the process's baseline RSS before loading, and the "
             "peak's distance from it. Each context and batch "
             "is prefilled once, by its first policy; the others decode from that prefill "
             "(\"shared\"; H2O, which scores the prompt's attention, prefills itself).", "",
             "| model | policy | context | batch | prefill tok/s | decode tok/s | step ms | "
             "bound ms | step/bound | must-read GB (w + kv) | spec share | KV read | "
             "peak RSS GB | plan + base GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        name = r.get("model_name", Path(r["model"]).stem)
        if "error" in r:
            lines.append(f"| {name} | {r['policy']} | {r['context']} | {r['batch']} | "
                         f"error: {r['error']} |||||||||||")
            continue
        bound = r.get("bound_s")
        read = r.get("must_read_bytes")
        prefill = "shared" if r.get("prefill_shared") else (
            f"{r['prefill_tokens_s']:.0f}" if "prefill_tokens_s" in r else "")
        cells = [name, r["policy"], r["context"], r["batch"], prefill,
                 f"{r['decode_tokens_s']:.2f}", f"{1e3 * r['decode_step_s']:.0f}",
                 f"{1e3 * bound:.0f}" if bound else "",
                 f"{r['step_over_bound']:.2f}x" if bound else "",
                 f"{read['weights'] / 1e9:.2f} + {read['kv'] / 1e9:.2f}" if read else "",
                 f"{100 * r['speculation_share']:.0f}%" if bound else "",
                 f"{r['kv_fetch_fraction']:.2f}" if bound else "",
                 f"{r['peak_rss_bytes'] / 1e9:.2f}" if "peak_rss_bytes" in r else "",
                 _plan(r)]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    ours = [r for r in result["rows"] if r.get("measured_in_run") and "error" not in r]
    for command in dict.fromkeys(r["command"] for r in ours):  # one note per llama-bench run
        r = next(r for r in ours if r["command"] == command)
        lines += ["", "llama.cpp rows at " + ", ".join(
                      str(x["context"]) for x in ours if x["command"] == command)
                  + f": measured in the same run by its llama-bench ({r['threads']} threads, one "
                  f"stream, weights {r['weights']}, KV cache {r['kv_cache']}; prefill: "
                  f"{r.get('prefill_tokens', 0)} prompt tokens timed after the context's "
                  f"tokens; `{command}`)."]
    ref = result.get("llama_cpp_separately_measured")
    if ref:
        when = ("in an earlier session, when this machine read memory faster: compare the rows "
                "above instead" if ours else "separately, not in this run")
        lines += ["", "llama.cpp on this machine (llama-bench, 2 threads, 4/5-bit weights, f16 KV; "
                  f"measured {when}): decode tokens/s by depth "
                  + ", ".join(f"{d}: {v}" for d, v in ref["decode"].items())
                  + "; prefill tokens/s by depth "
                  + ", ".join(f"{d}: {v}" for d, v in ref["prefill"].items()) + "."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "error" not in r]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.2), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            mine = sorted((r for r in rows if r["batch"] == b and r["policy"] == policy),
                          key=lambda r: r["context"])
            if not mine:
                continue
            ctx = [r["context"] for r in mine]
            line, = ax.plot(ctx, [r["decode_tokens_s"] for r in mine], "o-", label=policy)
            if all("bound_s" in r for r in mine):
                ax.plot(ctx, [b / r["bound_s"] for r in mine], "--", color=line.get_color(),
                        alpha=0.6, label=f"{policy} bound")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s (all sequences)")
        ax.set_title(f"batch {b}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_outputs(result: dict, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result))
    try:
        plot(result, stem.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
    print(f"written {stem}.json, .md, .png")
