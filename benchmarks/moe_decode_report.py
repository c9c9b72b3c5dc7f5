"""The JSON, markdown table and plot of ``moe_decode.py``."""
from __future__ import annotations

import json
from pathlib import Path

GB = 1e9


def _line(r: dict) -> str:
    head = f"| {r['model']} ({r['layers']} of {r['model_layers']} layers) | {r['policy']} | " \
           f"{r['context']} | {r['batch']} |"
    if "error" in r:
        return head + f" error: {r['error']} |" + " |" * 6
    if r["policy"] == "llama.cpp":
        return head + f" {r['decode_tokens_s']:.2f} | {r['full_model_tokens_s']:.2f} |" \
                      f" | | | {r.get('weights', '')} |"
    m = r["must_read_bytes"]
    return (head + f" {r['decode_tokens_s']:.2f} | {r['full_model_tokens_s']:.2f} | "
            f"{r['bound_s'] * 1e3:.0f} / {r['decode_step_s'] * 1e3:.0f} | "
            f"{r['step_over_bound']:.2f}x | {r['active_experts_per_layer']:.1f} | "
            f"{m['dense_weights'] / GB:.2f} + {m['experts'] / GB:.2f} + {m['kv'] / GB:.2f} |")


def markdown(result: dict) -> str:
    gguf = any(r.get("gguf") for r in result["rows"])
    weights = ("random Q4_0 weights from the GGUF llama.cpp reads" if gguf
               else "dummy 4-bit weights")
    lines = [f"# Mixture-of-experts decode ({weights}, KV cache float32 in CPU memory)",
             "", "Each model keeps its real layer shapes, with all or fewer layers (the "
             "vocabulary cut in the same ratio); 'full model' is the measured rate times "
             "layers kept / all layers. Bound: must-read bytes (dense weights + routed "
             "experts + KV) over the read bandwidth measured just before the row. llama.cpp: "
             "llama-bench on a GGUF of the same shapes with random Q4_0 codes, in the same "
             "run.", "",
             "| model | policy | context | batch | decode tok/s | full model tok/s | "
             "bound / step ms | step/bound | experts read per layer | must-read GB "
             "(dense + experts + KV) |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_line(r) for r in result["rows"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in result["rows"] if "decode_tokens_s" in r]
    if not rows:
        return
    labels = [f"{r['model'].split('-')[0]} {r['policy'].split('@')[0]}\n"
              f"{r['context'] // 1024}K b{r['batch']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    ax.bar([i - 0.2 for i in x], [r["decode_tokens_s"] for r in rows], 0.4, label="measured")
    ax.bar([i + 0.2 for i in x], [r["batch"] / r["bound_s"] if "bound_s" in r else 0
                                  for r in rows], 0.4, label="must-read bound")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("decode tokens/s (cut model)")
    ax.set_title("MoE decode on this CPU: measured vs bound, llama.cpp beside")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_outputs(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))
