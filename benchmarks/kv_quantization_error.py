"""How much a 4-bit KV cache moves keys and attention scores, per model: groups of 64 along
the head dimension (what ``--compress-cache`` stores) against groups of 64 tokens per
channel (KIVI's layout for keys, not implemented here).

    python benchmarks/kv_quantization_error.py                      # SmolLM2
    python benchmarks/kv_quantization_error.py --model path/to/qwen2.5-coder-0.5b-instruct.gguf

One full-precision forward pass over ``--tokens`` tokens of WikiText-2 records every layer's
queries and keys; each layout quantizes the keys (and is expanded back), and the report gives
the keys' relative L2 error and the mean absolute error of the scaled scores q.k over the
scores' standard deviation, averaged over layers (and the worst layer). Each run appends to
the ``runs`` list of ``benchmarks/results/kv_quantization_error.json`` (rows per model and
layout; ``--out`` another stem, ``--fresh`` a new list); the .md table and the .png sum up
every run.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
TEXT = ROOT.parent / "shared" / "data" / "wikitext2_test.txt"
import artifacts  # noqa: E402

OUT = artifacts.RESULTS / "kv_quantization_error"
COLUMNS = [("key relative error", "key_relative_error", "{:.3f}"),
           ("key error, worst layer", "key_relative_error_worst", "{:.3f}"),
           ("score error / score spread", "score_error_over_spread", "{:.3f}"),
           ("score error, worst layer", "score_error_over_spread_worst", "{:.3f}")]


def _errors(rec, cfg, layout: str) -> dict:
    from flexgen_infinigen.memory.codes import compress, decompress

    keys, scores = [], []
    group = cfg.num_heads // cfg.num_kv_heads
    for layer in range(cfg.num_layers):
        q, k = rec[layer]["q"], rec[layer]["k"]  # [s, H, d], [s, KV, d]
        if layout == "head_dim":
            kq = decompress(compress(k))
        else:  # groups run along tokens, one channel at a time
            kq = decompress(compress(k.permute(1, 2, 0).contiguous())).permute(2, 0, 1)
        keys.append(((kq - k).norm() / k.norm()).item())
        qq = q.view(q.shape[0], cfg.num_kv_heads, group, -1)
        scale = 1 / math.sqrt(k.shape[-1])
        s = torch.einsum("skgd,tkd->kgst", qq, k) * scale
        sq = torch.einsum("skgd,tkd->kgst", qq, kq) * scale
        scores.append(((sq - s).abs().mean() / s.std()).item())
    return {"key_relative_error": sum(keys) / len(keys), "key_relative_error_worst": max(keys),
            "score_error_over_spread": sum(scores) / len(scores),
            "score_error_over_spread_worst": max(scores)}


def write_outputs(stem: Path) -> None:
    """``STEM.md`` and ``STEM.png`` from every run: one line a model and key layout."""
    doc = artifacts.load(stem)
    runs = doc["runs"]
    lines = ["# 4-bit keys: error by group layout (groups of 64 values)", "",
             artifacts.meta_line(runs), "",
             "| model | key groups | " + " | ".join(h for h, _, _ in COLUMNS) + " |",
             "|" + "---|" * (2 + len(COLUMNS))]
    groups = artifacts.grouped(runs, ["model", "layout"])
    for key, rows in groups.items():
        lines.append("| " + " | ".join([*key] + [artifacts.spread(
            (r.get(f) for r in rows), fmt) for _, f, fmt in COLUMNS]) + " |")
    lines += ["", "Each cell: median (min-max, N runs); errors averaged over layers, and the "
              "worst layer's."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import statistics

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    labels = [f"{m}\n{layout.replace('_', ' ')}" for m, layout in groups]
    for j, (field, name) in enumerate((("key_relative_error", "key relative error"),
                                       ("score_error_over_spread", "score error / spread"))):
        values = [statistics.median(r[field] for r in rows) for rows in groups.values()]
        ax.bar([i + 0.4 * j for i in range(len(values))], values, width=0.4, label=name)
    ax.set_xticks([i + 0.2 for i in range(len(labels))], labels, fontsize=7)
    ax.set(ylabel="median over layers and runs", title="4-bit keys: head dim vs per channel")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="registry name or .gguf / folder")
    p.add_argument("--text", default=str(TEXT))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--tag", default=None, help="the rows' model label (default: the model's "
                   "name without -instruct)")
    p.add_argument("--out", default=str(OUT), help="the artifact stem (STEM.json, .md, .png)")
    p.add_argument("--fresh", action="store_true", help="start the runs list anew")
    p.add_argument("--report-only", action="store_true",
                   help="only rewrite the .md and .png from the runs in the JSON")
    a = p.parse_args(argv)
    stem = Path(a.out).with_suffix("")
    if a.report_only:
        write_outputs(stem)
        return 0
    if not Path(a.text).is_file():
        print(f"error: {a.text} is absent; pass --text (a UTF-8 text)", file=sys.stderr)
        return 2
    from selection_recall import Recorder

    from flexgen_infinigen import OffloadedLM

    with OffloadedLM.load(model=a.model, progress=False) as lm:
        ids = lm.tokenizer.encode(Path(a.text).read_text(encoding="utf-8")[:40 * a.tokens])
        rec, _ = Recorder(lm)(ids[:a.tokens])
        cfg = lm.cfg
        errors = {layout: _errors(rec, cfg, layout) for layout in ("head_dim", "per_channel")}
    label = a.tag or cfg.name.split("-instruct")[0]
    command = ["benchmarks/kv_quantization_error.py", *(sys.argv[1:] if argv is None else argv)]
    run = {"meta": artifacts.run_meta(command),
           "settings": {"model_name": cfg.name, "tokens": a.tokens, "text": Path(a.text).name},
           "rows": [{"model": label, "layout": layout.replace("_", " "), **r}
                    for layout, r in errors.items()]}
    artifacts.append_run(stem, run, fresh=a.fresh)
    write_outputs(stem)
    return 0


if __name__ == "__main__":
    sys.exit(main())
