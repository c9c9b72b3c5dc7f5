"""How much a 4-bit KV cache moves keys and attention scores, per model: groups of 64 along
the head dimension (what ``--compress-cache`` stores) against groups of 64 tokens per
channel (KIVI's layout for keys, not implemented here).

    python benchmarks/kv_quantization_error.py                      # SmolLM2
    python benchmarks/kv_quantization_error.py --model path/to/qwen2.5-coder-0.5b-instruct.gguf

One full-precision forward pass over ``--tokens`` tokens of WikiText-2 records every layer's
queries and keys; each layout quantizes the keys (and is expanded back), and the report gives
the keys' relative L2 error and the mean absolute error of the scaled scores q.k over the
scores' standard deviation, averaged over layers (and the worst layer). Writes
``benchmarks/results/kv_quantization_error_<tag>.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
TEXT = ROOT.parent / "shared" / "data" / "wikitext2_test.txt"
OUT = ROOT / "benchmarks" / "results"


def _errors(rec, cfg, layout: str) -> dict:
    from flexgen_infinigen.runtime.compression import compress, decompress

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="registry name or .gguf / folder")
    p.add_argument("--text", default=str(TEXT))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--tag", default=None, help="default: the model's name")
    a = p.parse_args(argv)
    if not Path(a.text).is_file():
        print(f"error: {a.text} is absent; pass --text (a UTF-8 text)", file=sys.stderr)
        return 2
    from selection_recall import Recorder

    from flexgen_infinigen import OffloadedLM

    with OffloadedLM.load(model=a.model, progress=False) as lm:
        ids = lm.tokenizer.encode(Path(a.text).read_text(encoding="utf-8")[:40 * a.tokens])
        rec, _ = Recorder(lm)(ids[:a.tokens])
        cfg = lm.cfg
        rows = {layout: _errors(rec, cfg, layout) for layout in ("head_dim", "per_channel")}
    tag = a.tag or cfg.name.split("-instruct")[0]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"kv_quantization_error_{tag}.json").write_text(json.dumps(
        {"model": cfg.name, "tokens": a.tokens, "text": Path(a.text).name, "layouts": rows},
        indent=1))
    lines = [f"# 4-bit keys: {cfg.name}, {a.tokens} tokens of {Path(a.text).name}", "",
             "| key groups of 64 | key relative error (worst layer) | score error / score "
             "spread (worst layer) |", "|---|---|---|"]
    for layout, r in rows.items():
        lines.append(f"| {layout.replace('_', ' ')} | {r['key_relative_error']:.3f} "
                     f"({r['key_relative_error_worst']:.3f}) | {r['score_error_over_spread']:.3f}"
                     f" ({r['score_error_over_spread_worst']:.3f}) |")
    (OUT / f"kv_quantization_error_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
