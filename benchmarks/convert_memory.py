"""Peak memory of converting a sharded bf16 checkpoint: about one tensor, not a shard or the
model.

Writes a synthetic Llama-shaped checkpoint (random bf16 tensors, sharded safetensors with an
index, ~2 GB by default), converts it in a fresh process, and reports that process's peak
resident memory above what it held after its imports, beside the largest tensor, the
largest shard and the whole checkpoint.

    python benchmarks/convert_memory.py                 # ~2 GB, about a minute
    python benchmarks/convert_memory.py --gb 0.2        # a quick look

Appends the run to benchmarks/results/convert_memory.json's ``runs`` (``--fresh`` starts
them anew) and rewrites convert_memory.md (median, min-max over the runs) and .png from all
of them (the plot needs matplotlib); ``--report-only`` only rewrites those two.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import artifacts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

CHILD = r"""
import json, sys, time
from flexgen_infinigen.weights.hf_convert import convert_hf

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) after the imports
base = status("VmRSS")
t = time.perf_counter()
convert_hf(sys.argv[1], sys.argv[2], "synthetic", progress=False)
print(json.dumps({"baseline_rss": base, "seconds": time.perf_counter() - t,
                  "peak_rss": status("VmHWM")}))
"""

def shapes(hidden: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    kv, ffn = hidden // 4, int(hidden * 2.75)
    out = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
           "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (hidden,),
                    p + "post_attention_layernorm.weight": (hidden,),
                    p + "self_attn.q_proj.weight": (hidden, hidden),
                    p + "self_attn.k_proj.weight": (kv, hidden),
                    p + "self_attn.v_proj.weight": (kv, hidden),
                    p + "self_attn.o_proj.weight": (hidden, hidden),
                    p + "mlp.gate_proj.weight": (ffn, hidden),
                    p + "mlp.up_proj.weight": (ffn, hidden),
                    p + "mlp.down_proj.weight": (hidden, ffn)})
    return out


def write_checkpoint(folder: Path, gb: float, shard_mb: int) -> dict:
    import torch
    from safetensors.torch import save_file

    hidden, vocab = 2048, 32000
    per_layer = sum(2 * math.prod(s) for n, s in shapes(hidden, 1, vocab).items()
                    if ".layers." in n)
    fixed = 2 * 2 * vocab * hidden
    layers = max(1, round((gb * 2**30 - fixed) / per_layer))
    table = shapes(hidden, layers, vocab)
    config = {"model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
              "intermediate_size": int(hidden * 2.75), "num_hidden_layers": layers,
              "num_attention_heads": 16, "num_key_value_heads": 4,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    shards, current, size, weight_map = [], {}, 0, {}

    def flush():
        nonlocal current, size
        if current:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(current, str(folder / name), metadata={"format": "pt"})
            shards.append((name, size))
            weight_map.update({k: name for k in current})
            current, size = {}, 0

    largest = 0
    for name, shape in table.items():
        t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        nbytes = t.numel() * 2
        largest = max(largest, nbytes)
        if size + nbytes > shard_mb << 20:
            flush()
        current[name] = t
        size += nbytes
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(s for _, s in shards)}, "weight_map": weight_map}))
    return {"layers": layers, "tensors": len(table), "largest_tensor_bytes": largest,
            "largest_shard_bytes": max(s for _, s in shards), "shards": len(shards),
            "checkpoint_bytes": sum(s for _, s in shards)}


MIB = 2**20
KEYS = ["checkpoint"]
COLUMNS = [("checkpoint MiB", "checkpoint_mib", "{:.0f}"),
           ("largest shard MiB", "largest_shard_mib", "{:.0f}"),
           ("largest tensor MiB", "largest_tensor_mib", "{:.0f}"),
           ("converter's peak RSS growth MiB", "peak_growth_mib", "{:.0f}"),
           ("growth / largest tensor", "growth_over_largest_tensor", "{:.2f}"),
           ("seconds", "convert_seconds", "{:.1f}")]


def table(runs: list[dict]) -> str:
    """``artifacts.table`` with a format per column."""
    return artifacts.table(runs, KEYS, COLUMNS)


def row(gb: float, shard_mb: int, info: dict, child: dict, store_bytes: int) -> dict:
    """One measured configuration: the checkpoint's sizes and the converter's peak growth."""
    growth = child["peak_rss"] - child["baseline_rss"]
    shards = f"{info['shards']} shard{'s' if info['shards'] > 1 else ''}"
    return {"checkpoint": f"{gb:g} GB bf16, {shards} of <= {shard_mb} MB",
            "gb": gb, "shard_mb": shard_mb, "layers": info["layers"],
            "tensors": info["tensors"], "shards": info["shards"],
            "checkpoint_mib": info["checkpoint_bytes"] / MIB,
            "largest_shard_mib": info["largest_shard_bytes"] / MIB,
            "largest_tensor_mib": info["largest_tensor_bytes"] / MIB,
            "store_mib": store_bytes / MIB, "convert_seconds": child["seconds"],
            "baseline_rss_mib": child["baseline_rss"] / MIB,
            "peak_rss_mib": child["peak_rss"] / MIB, "peak_growth_mib": growth / MIB,
            "growth_over_largest_tensor": growth / info["largest_tensor_bytes"]}


def report(doc: dict, out: Path) -> str:
    """The markdown table and the plot of every run in ``doc``; returns the markdown."""
    runs = doc["runs"]
    md = ["# Converting a sharded bf16 checkpoint: peak memory", "",
          artifacts.meta_line(runs), "",
          "Each cell: median (min-max, N runs). Peak RSS growth is the converting process's "
          "resident peak above its size after its imports.", "", table(runs)]
    out.with_suffix(".md").write_text("\n".join(md))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return "\n".join(md)
    groups = artifacts.grouped(runs, KEYS)
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 3), squeeze=False)
    for ax, (key, rows) in zip(axes[0], groups.items()):
        names = [h.replace(" MiB", "") for h, f, _ in COLUMNS if f.endswith("_mib")]
        fields = [f for _, f, _ in COLUMNS if f.endswith("_mib")]
        med = [statistics.median(r[f] for r in rows) for f in fields]
        low = [m - min(r[f] for r in rows) for m, f in zip(med, fields)]
        high = [max(r[f] for r in rows) - m for m, f in zip(med, fields)]
        ax.barh(names, med, xerr=[low, high])
        ax.set_xlabel(f"MiB (median of {len(rows)} run{'s' if len(rows) > 1 else ''})")
        ax.set_title(key[0], fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
    return "\n".join(md)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0, help="checkpoint size (default 2)")
    p.add_argument("--shard-mb", type=int, default=1000, help="shard size (default 1000)")
    p.add_argument("--workdir", default=None, help="where to write (default: a temp folder)")
    p.add_argument("--out", default=str(RESULTS / "convert_memory"),
                   help="STEM: this run is appended to STEM.json's runs; STEM.md and STEM.png "
                        "are rewritten from all of them")
    p.add_argument("--fresh", action="store_true", help="start STEM.json's runs anew")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: rewrite STEM.md and STEM.png from STEM.json")
    a = p.parse_args(argv)
    out = Path(a.out)
    if a.report_only:
        print(report(artifacts.load(out), out))
        return 0
    work = Path(a.workdir or tempfile.mkdtemp(prefix="convert-memory-"))
    ckpt, store = work / "checkpoint", work / "store"
    ckpt.mkdir(parents=True, exist_ok=True)
    try:
        print(f"writing a ~{a.gb} GB bf16 checkpoint in {ckpt} ...", flush=True)
        info = write_checkpoint(ckpt, a.gb, a.shard_mb)
        print("converting in a fresh process ...", flush=True)
        run = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), str(store)],
                             capture_output=True, text=True, check=True)
        child = json.loads(run.stdout.strip().splitlines()[-1])
        store_bytes = sum(f.stat().st_size for f in store.glob("*.npy"))
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    meta = artifacts.run_meta(["benchmarks/convert_memory.py", *(argv or sys.argv[1:])],
                              python=platform.python_version())
    doc = artifacts.append_run(out, {"meta": meta,
                                     "rows": [row(a.gb, a.shard_mb, info, child, store_bytes)]},
                               fresh=a.fresh, benchmark="peak memory of converting a sharded "
                               "bf16 checkpoint (a synthetic Llama-shaped one)")
    print(report(doc, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
