"""Quantized GGUF files kept as their codes: store size, conversion memory, decode speed and
perplexity against the float32 store of the same weights.

- Store size on disk over the GGUF's size: the default model (SmolLM2-135M Q4_1), the
  Qwen2.5-Coder-0.5B GGUF when it is present (``--qwen``; assembled by
  ``/work/shared/models/qwen2.5-coder-0.5b.sh DEST``), and an 8B Q4_K_M-shaped GGUF written
  here with ``gguf``'s writer from random codes (Llama-3-8B shapes, ~4.9 GB under
  ``--tmp``; converted in a fresh process whose peak resident memory above its imports is
  recorded, then both deleted).
- Decode tokens/s of the default model at batch 1 after a ~900-token prompt: from its Q4_1
  codes (scales and minima held as float16, exact for Q4_1), from the same codes with
  float32 scales and minima (the form before 16-bit factors, for a side-by-side
  comparison), from the float32 store of the same (dequantized) weights, and from that
  float store with ``--compress-weight``; all loaded at once and run in turn, repeated,
  with each one's weight bytes in memory.
- A decode step's linear layers alone (every coded matrix of the default model once, batch
  1, its own codes) with float16 and with float32 factors, the two alternated; the minimum
  over the repeats is the least disturbed by other work on the machine.
- WikiText-2 perplexity (``python -m flexgen_infinigen.eval perplexity``) of the three
  stores (the float32-factor codes hold the same values as the float16 ones).

    python benchmarks/gguf_store.py                   # all of it (minutes; 5 GB of /tmp)
    python benchmarks/gguf_store.py --skip-8b         # no 8B file

Appends the run to benchmarks/results/gguf_store.json's ``runs`` (``--fresh`` starts them
anew; the run is saved after each part, so a run cut short keeps what it measured) and
rewrites gguf_store.md (median, min-max over every repeat of every run) and .png from all of
them; ``--render`` only rewrites those two.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

import artifacts  # noqa: E402

WIKI = Path("/work/shared/data/wikitext2_test.txt")
QWEN = Path.home() / ".cache" / "flexgen_infinigen" / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf"
GOALS = {"smollm2-135m Q4_1": 1.15, "qwen2.5-coder-0.5b": 1.6, "8B Q4_K_M-shaped": 1.2}

CHILD = r"""
import json, sys, time
from flexgen_infinigen.weights.gguf_convert import convert_gguf

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts after the imports
base = status("VmRSS")
t = time.perf_counter()
convert_gguf(sys.argv[1], sys.argv[2], progress=False)
print(json.dumps({"seconds": time.perf_counter() - t,
                  "peak_growth_bytes": status("VmHWM") - base}))
"""


def folder_bytes(path: Path) -> int:
    """A store's own files (its tensors, manifest, tokenizer); not the subfolders runs add
    to it later (InfiniGen's calibrations)."""
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def convert_in_child(gguf_path: Path, dest: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(gguf_path), str(dest)], env=env,
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def size_row(name: str, gguf_path: Path, store: Path, child: dict | None = None) -> dict:
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    types: dict[str, int] = {}
    largest = 0
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        largest = max(largest, int(t.n_elements) * 4)
    row = {"model": name, "gguf_bytes": gguf_path.stat().st_size,
           "store_bytes": folder_bytes(store), "tensor_types": types,
           "largest_tensor_float32_bytes": largest, "goal": GOALS.get(name)}
    row["ratio"] = row["store_bytes"] / row["gguf_bytes"]
    if child:
        row.update(child)
    return row


# --- an 8B Q4_K_M-shaped file -------------------------------------------------------------

def _more_bits(i: int, n: int) -> bool:
    """Layers whose attn_v / ffn_down a Q4_K_M file keeps in Q6_K (the first and last
    eighth, and every third one between)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def write_8b(path: Path, layers: int = 32) -> None:
    """Llama-3-8B shapes, Q4_K_M's mix of Q4_K and Q6_K, random codes (float16 factors
    normal-sized), F32 norms; one tensor in memory at a time."""
    import gguf
    from gguf import GGMLQuantizationType as T

    hidden, inter, vocab, heads, kv = 4096, 14336, 128256, 32, 8
    f16_at = {T.Q4_K: [0, 2], T.Q6_K: [208]}
    tensors = [("token_embd.weight", (vocab, hidden), T.Q4_K)]
    for i in range(layers):
        v_down = T.Q6_K if _more_bits(i, layers) else T.Q4_K
        tensors += [(f"blk.{i}.attn_norm.weight", (hidden,), None),
                    (f"blk.{i}.attn_q.weight", (hidden, hidden), T.Q4_K),
                    (f"blk.{i}.attn_k.weight", (kv * 128, hidden), T.Q4_K),
                    (f"blk.{i}.attn_v.weight", (kv * 128, hidden), v_down),
                    (f"blk.{i}.attn_output.weight", (hidden, hidden), T.Q4_K),
                    (f"blk.{i}.ffn_norm.weight", (hidden,), None),
                    (f"blk.{i}.ffn_gate.weight", (inter, hidden), T.Q4_K),
                    (f"blk.{i}.ffn_up.weight", (inter, hidden), T.Q4_K),
                    (f"blk.{i}.ffn_down.weight", (hidden, inter), v_down)]
    tensors += [("output_norm.weight", (hidden,), None),
                ("output.weight", (vocab, hidden), T.Q6_K)]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    for name, shape, qtype in tensors:
        if qtype is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            per, size = gguf.GGML_QUANT_SIZES[qtype]
            row = shape[1] // per * size
            w.add_tensor_info(name, (shape[0], row), np.dtype(np.uint8), shape[0] * row,
                              raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _name, shape, qtype in tensors:
        if qtype is None:
            w.write_tensor_data(np.ones(shape, np.float32))
            continue
        per, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (shape[0], shape[1] // per, size), dtype=np.uint8)
        for at in f16_at[qtype]:
            f = (rng.standard_normal(raw.shape[:2]) * 1e-3).astype(np.float16)
            raw[..., at:at + 2] = f.view(np.uint8).reshape(*raw.shape[:2], 2)
        w.write_tensor_data(raw.reshape(shape[0], -1))
        del raw
    w.close()


# --- decode speed and perplexity ----------------------------------------------------------

WIDE = "codes (Q4_1), float32 factors"


def _load(path, compress: bool, wide: bool):
    """The model at ``path``; ``wide``: its codes' scales and minima kept as float32 (the
    float16 check answering no), as before 16-bit factors."""
    from contextlib import nullcontext
    from unittest import mock

    from flexgen_infinigen import OffloadedLM, Placement
    from flexgen_infinigen.weights import gguf_codes

    with mock.patch.object(gguf_codes, "half_exact", lambda *_: False) if wide \
            else nullcontext():
        return OffloadedLM.load(path=path, policy=Placement(compress_weight=compress),
                                progress=False)


def decode_speed(stores: dict, prompt_tokens: int, gen_len: int, repeats: int) -> dict:
    import torch

    from flexgen_infinigen.text.tokenizer import load_tokenizer

    text = WIKI.read_text(encoding="utf-8")
    lms = {name: _load(path, cw, name == WIDE) for name, (path, cw) in stores.items()}
    weight_bytes = {name: sum(lm.weight_bytes_by_tier().values()) for name, lm in lms.items()}
    tok = load_tokenizer(stores["codes (Q4_1)"][0], next(iter(lms.values())).cfg)
    prompt = tok.encode(text[:20000])[:prompt_tokens]
    runs: dict[str, list] = {name: [] for name in lms}
    for lm in lms.values():  # warm-up: kernels built, pages touched
        lm.generate([prompt[:64]], 4, stop_token_id=None)
    for _ in range(repeats):
        for name, lm in lms.items():  # side by side, in turn
            out = lm.generate([prompt], gen_len, stop_token_id=None)
            runs[name].append({"decode_tokens_per_s": (gen_len - 1) / out.decode_latency_s,
                               "prefill_s": out.prefill_latency_s})
    for lm in lms.values():
        lm.close()
    rates = {n: [r["decode_tokens_per_s"] for r in rs] for n, rs in runs.items()}
    return {"prompt_tokens": len(prompt), "gen_len": gen_len, "repeats": repeats,
            "threads": torch.get_num_threads(), "runs": runs, "weight_bytes": weight_bytes,
            "median_tokens_per_s": {n: float(np.median(r)) for n, r in rates.items()}}


def kernel_step(store: Path, repeats: int) -> dict:
    """Seconds of one step's coded products (``cpu_layers.linear`` on each coded matrix,
    one row of x) with float16 factors and with the same values in float32, alternated."""
    import torch

    from flexgen_infinigen.kernels import layers as cpu_layers
    from flexgen_infinigen.memory.codes import Packed, PackedWeight
    from flexgen_infinigen.weights.store import WeightStore

    ws = WeightStore(store)
    packs = [ws.packed(n) for n in ws.tensors if ws.layout(n) is not None]
    forms = {"float16 factors": [PackedWeight(p, torch.float32) for p in packs],
             "float32 factors": [PackedWeight(Packed(p.codes, p.scale.float(),
                                                     p.minimum.float(), p.shape))
                                 for p in packs]}
    gen = torch.Generator().manual_seed(0)
    xs = {p.shape[1]: torch.randn(1, p.shape[1], generator=gen) for p in packs}
    seconds: dict[str, list] = {f: [] for f in forms}
    for _ in range(repeats + 1):
        for form, weights in forms.items():
            start = time.perf_counter()
            for w in weights:
                cpu_layers.linear(xs[w.shape[1]], w)
            seconds[form].append(time.perf_counter() - start)
    return {"repeats": repeats, "matrices": len(packs),
            "threads": torch.get_num_threads(),
            "seconds": {f: s[1:] for f, s in seconds.items()},  # the first warms up
            "bytes": {f: sum(w.packed.nbytes for w in ws_) for f, ws_ in forms.items()}}


def perplexity(path: Path, compress: bool, windows: int, seq: int, prefill: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "flexgen_infinigen.eval", "perplexity", "--path",
               str(path), "--text", str(WIKI), "--seq-len", str(seq), "--prefill-len",
               str(prefill), "--max-windows", str(windows), "--json", f.name]
        if compress:
            cmd.append("--compress-weight")
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        out = json.loads(Path(f.name).read_text())
    return {"perplexity": out["perplexity"], "tokens_scored": out["tokens_scored"],
            "command": " ".join(cmd[1:-2])}


# --- report -------------------------------------------------------------------------------

MODELS = {"smollm2-135m Q4_1": "SmolLM2-135M", "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B",
          "8B Q4_K_M-shaped": "Llama-3-8B shapes, random codes"}
FORMS = {"codes (Q4_1)": "Q4_1 codes, float16 factors",
         WIDE: "Q4_1 codes, float32 factors",
         "float32 store": "float32 expansion of the codes",
         "float32 + --compress-weight": "float32 + --compress-weight (4-bit/64)",
         "float16 factors": "Q4_1 codes, float16 factors",
         "float32 factors": "Q4_1 codes, float32 factors"}
KEYS = ["model", "weights"]
COLUMNS = [("GGUF MiB", "gguf_mib", "{:.0f}"), ("store MiB", "store_mib", "{:.0f}"),
           ("store / file", "store_over_file", "{:.3f}"),
           ("MiB in memory", "memory_mib", "{:.1f}"),
           ("decode tok/s", "decode_tok_s", "{:.1f}"),
           ("x float32 store", "x_float32", "{:.2f}"),
           ("perplexity", "perplexity", "{:.4f}"),
           ("coded products ms", "coded_products_ms", "{:.1f}")]


def rows_of(r: dict) -> list[dict]:
    """The table's rows of one run: a row per store size, per decode and per pass over the
    coded products (repeats are rows), and one per form for its memory, decode ratio (of
    medians) and perplexity."""
    rows, others = [], []  # the default model's rows first, the other files' sizes last
    for s in r.get("sizes", []):
        smol_file = s["model"].startswith("smollm2")
        quant = sorted((t for t in s["tensor_types"] if not t.startswith(("F32", "F16"))),
                       key=lambda t: -s["tensor_types"][t])
        weights = FORMS["codes (Q4_1)"] if smol_file else f"GGUF codes ({', '.join(quant)})"
        (rows if smol_file else others).append({
            "model": MODELS.get(s["model"], s["model"]), "weights": weights,
            "gguf_mib": s["gguf_bytes"] / 2**20, "store_mib": s["store_bytes"] / 2**20,
            "store_over_file": s["ratio"], "tensor_types": s["tensor_types"],
            "convert_peak_growth_mib": s["peak_growth_bytes"] / 2**20
            if "peak_growth_bytes" in s else None})
    smol = MODELS["smollm2-135m Q4_1"]
    d = r.get("decode")
    if d:
        base = d["median_tokens_per_s"]["float32 store"]
        for name, rs in d["runs"].items():
            w = FORMS.get(name, name)
            rows += [{"model": smol, "weights": w, "decode_tok_s": x["decode_tokens_per_s"],
                      "prefill_s": x["prefill_s"]} for x in rs]
            mem = d.get("weight_bytes", {}).get(name)
            rows.append({"model": smol, "weights": w,
                         "memory_mib": mem / 2**20 if mem else None,
                         "x_float32": d["median_tokens_per_s"][name] / base})
    k = r.get("kernels")
    if k:
        for form, times in k["seconds"].items():
            rows += [{"model": smol, "weights": FORMS.get(form, form),
                      "coded_products_ms": 1e3 * t} for t in times]
    for name, x in (r.get("perplexity") or {}).items():
        rows.append({"model": smol, "weights": FORMS.get(name, name),
                     "perplexity": x["perplexity"], "tokens_scored": x["tokens_scored"]})
    return rows + others


def table(runs: list[dict]) -> str:
    """``artifacts.table`` with a format per column."""
    lines = ["| " + " | ".join([*KEYS, *(h for h, _, _ in COLUMNS)]) + " |",
             "|" + "---|" * (len(KEYS) + len(COLUMNS))]
    for key, rows in artifacts.grouped(runs, KEYS).items():
        cells = [str(x) for x in key]
        cells += [artifacts.spread((r.get(f) for r in rows), fmt) for _, f, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(doc: dict) -> str:
    runs = doc["runs"]
    lines = ["# Quantized GGUF files kept as their codes", "", artifacts.meta_line(runs), "",
             "Each cell: median (min-max, N), N counting every repeat of every run: decodes "
             "(batch 1, a ~900-token WikiText-2 prompt, all forms loaded at once and run in "
             "turn), passes of `cpu_layers.linear` over every coded matrix once (one row of x, "
             "the two factor forms alternated). x float32 store: the run's median decode rate "
             "over the float32 expansion's. Perplexity: WikiText-2, 512 tokens scored; the "
             "float32-factor codes hold the float16 ones' values and are not scored again.",
             "", table(runs)]
    conv = [(run["meta"].get("date"), row) for run in runs for row in run["rows"]
            if row.get("convert_peak_growth_mib")]
    if conv:
        lines += ["## Converting", "", "| date | model | tensor types | converter's peak RSS "
                  "growth MiB |", "|---|---|---|---|"]
        for date, row in conv:
            types = ", ".join(f"{n} {t}" for t, n in sorted(row["tensor_types"].items()))
            lines.append(f"| {date} | {row['model']} | {types} | "
                         f"{row['convert_peak_growth_mib']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    plt = artifacts.pyplot()
    if plt is None:
        return
    groups = artifacts.grouped(doc["runs"], KEYS)

    def values(field):
        out = {}
        for (model, weights), rows in groups.items():
            xs = [r[field] for r in rows if r.get(field) is not None]
            if xs:
                out[f"{model}\n{weights}" if field == "store_over_file" else weights] = xs
        return out

    panels = [("store_over_file", "store / GGUF size"),
              ("decode_tok_s", "decode tokens/s, SmolLM2-135M"),
              ("perplexity", "WikiText-2 perplexity, SmolLM2-135M")]
    panels = [(f, label, values(f)) for f, label in panels if values(f)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.6), squeeze=False)
    for ax, (field, label, vals) in zip(axes[0], panels):
        meds = [statistics.median(v) for v in vals.values()]
        err = [[m - min(v) for m, v in zip(meds, vals.values())],
               [max(v) - m for m, v in zip(meds, vals.values())]]
        ax.bar(range(len(vals)), meds, yerr=err, capsize=3, color="tab:blue")
        ax.set_xticks(range(len(vals)), list(vals), rotation=20, ha="right", fontsize=7)
        ax.set_title(label, fontsize=10)
        ax.set_ylabel("median, min-max")
        if field == "perplexity":
            ax.set_ylim(min(meds) * 0.97, max(meds) * 1.01)
    fig.suptitle(f"GGUF files kept as their codes, {len(doc['runs'])} run(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--qwen", type=Path, default=QWEN, help="the Qwen2.5-Coder-0.5B GGUF")
    p.add_argument("--skip-8b", action="store_true")
    p.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--prompt-tokens", type=int, default=900)
    p.add_argument("--gen-len", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ppl-windows", type=int, default=4)
    p.add_argument("--kernel-repeats", type=int, default=30)
    p.add_argument("--out", type=Path, default=RESULTS / "gguf_store",
                   help="STEM: this run is appended to STEM.json's runs; STEM.md and STEM.png "
                        "are rewritten from all of them")
    p.add_argument("--fresh", action="store_true", help="start STEM.json's runs anew")
    p.add_argument("--render", action="store_true",
                   help="measure nothing: rewrite STEM.md and STEM.png from STEM.json")
    a = p.parse_args()
    a.out = a.out.with_suffix("") if a.out.suffix == ".json" else a.out
    if a.render:
        write_outputs(artifacts.load(a.out), a.out)
        return
    sys.path.insert(0, str(ROOT))
    from flexgen_infinigen.config import default_cache_dir
    from flexgen_infinigen.weights.embedded import default_gguf, default_model_store

    codes = default_model_store(progress=False)
    work = Path(tempfile.mkdtemp(prefix="gguf_store-", dir=a.tmp))
    r = {"meta": artifacts.run_meta(["benchmarks/gguf_store.py", *sys.argv[1:]]), "rows": [],
         "sizes": [size_row("smollm2-135m Q4_1", default_gguf(default_cache_dir()), codes)]}
    earlier = [] if a.fresh else artifacts.load(a.out)["runs"]
    if a.qwen.is_file():
        r["sizes"].append(size_row("qwen2.5-coder-0.5b", a.qwen, work / "qwen",
                                   convert_in_child(a.qwen, work / "qwen")))
    else:
        print(f"note: no {a.qwen}; the Qwen2.5 row is skipped", file=sys.stderr)
    if not a.skip_8b:
        big = work / "llama-8b-q4_k_m-shaped.gguf"
        write_8b(big)
        child = convert_in_child(big, work / "8b")
        r["sizes"].append(size_row("8B Q4_K_M-shaped", big, work / "8b", child))
        big.unlink()
        subprocess.run(["rm", "-rf", str(work / "8b")], check=True)
    from flexgen_infinigen.weights.hf_reference import float_store

    floats = float_store(codes, work / "smollm2-float32")
    stores = {"codes (Q4_1)": (codes, False), WIDE: (codes, False),
              "float32 store": (floats, False), "float32 + --compress-weight": (floats, True)}
    save(earlier, r, a.out)  # after each part: a long run cut short keeps what it measured
    if a.kernel_repeats:
        r["kernels"] = kernel_step(codes, a.kernel_repeats)
        save(earlier, r, a.out)
    if a.repeats:
        r["decode"] = decode_speed(stores, a.prompt_tokens, a.gen_len, a.repeats)
        save(earlier, r, a.out)
    if a.ppl_windows:
        r["perplexity"] = {}
        for name, (path, cw) in stores.items():
            if name == WIDE:  # the same values as the float16 factors: the same outputs
                continue
            r["perplexity"][name] = perplexity(path, cw, a.ppl_windows, 512, 256)
            save(earlier, r, a.out)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    print(a.out.with_suffix(".md").read_text())


def write_outputs(doc: dict, out: Path) -> None:
    out.with_suffix(".md").write_text(markdown(doc))
    plot(doc, out.with_suffix(".png"))


def save(earlier: list[dict], r: dict, out: Path) -> None:
    """STEM.json with ``r`` (as measured so far) after the ``earlier`` runs."""
    r["rows"] = rows_of(r)
    doc = {"benchmark": __doc__.split("\n")[0], "runs": [*earlier, r]}
    artifacts.save(out, doc)
    write_outputs(doc, out)


if __name__ == "__main__":
    main()
