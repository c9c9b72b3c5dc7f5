"""Long context on one machine: prefill and decode speed of each KV policy against the step's
memory bound, with the KV cache in CPU memory.

    python benchmarks/long_context.py --quick          # SmolLM2, 4K, batch 1, full and InfiniGen
    python benchmarks/long_context.py                  # SmolLM2 4K/8K x batch 1/8
    python benchmarks/long_context.py --model path/to/qwen2.5-coder-0.5b-instruct.gguf \\
        --contexts 16384 32768 --batches 1 --tag qwen

A decode step's **bound** is the bytes it must read over this machine's read bandwidth
(one large ``sum`` over all threads, measured in the run): every weight once (the tied
embedding once, by the head; an untied embedding only its rows); for the full cache every
cached K and V row once; for InfiniGen, in the layers that select, its speculation keys plus
the rows it selected (the others read every row); for H2O the rows it keeps; a 4-bit cache
its packed bytes. What the engine happens to copy is not counted. Each configuration runs
in its own process, so that its peak RSS is its own; the memory plan's prediction is
reported beside it. With ``--llama-bench PATH`` llama.cpp is measured in the same run (its
llama-bench, one stream, each context as its depth: ``llama_cpp.py``); ``--llama-cpp MODEL``
prints the figures measured separately in an earlier session (issue 27), labelled as such.

Each run appends to the ``runs`` list of ``benchmarks/results/long_context.json`` (or
``long_context_<tag>.json`` with ``--tag``, or ``--out STEM``; ``--fresh`` starts the list
anew), and the markdown table (medians over all runs) and the plot are rebuilt from every run
(``long_context_report.py``).
"""
from __future__ import annotations

import argparse
import inspect
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
OUT = ROOT / "benchmarks" / "results"

# policy label -> (kv policy, options, 4-bit KV cache, 4-bit weights); "-w4" labels keep the
# weights in 4 bits (multiplied as stored on a CPU), the setting that reads fewest bytes
POLICIES = {
    "full": ("full", {}, False, False),
    "infinigen": ("infinigen", {}, False, False),
    "infinigen@0.1": ("infinigen", {"max_kv_fraction": 0.1}, False, False),
    "h2o": ("h2o", {"hh_ratio": 0.1, "recent_ratio": 0.1}, False, False),
    "full-4bit": ("full", {}, True, False),
    "full-w4": ("full", {}, False, True),
    "infinigen-w4": ("infinigen", {}, False, True),
    "infinigen@0.1-w4": ("infinigen", {"max_kv_fraction": 0.1}, False, True),
    "infinigen-pages": ("infinigen", {"speculation_keys": "pages16"}, False, False),
    "infinigen-pages@0.1": ("infinigen", {"speculation_keys": "pages16",
                                          "max_kv_fraction": 0.1}, False, False),
    "infinigen-pages@0.1-w4": ("infinigen", {"speculation_keys": "pages16",
                                             "max_kv_fraction": 0.1}, False, True),
    "infinigen-4bit": ("infinigen", {}, True, False),
    # 4-bit speculation keys of half the skewed columns: half the bytes and byte products
    "infinigen-half": ("infinigen", {"partial_weight_ratio": 0.5}, False, False),
    "infinigen-half-w4": ("infinigen", {"partial_weight_ratio": 0.5}, False, True),
    "infinigen-half@0.1-w4": ("infinigen", {"partial_weight_ratio": 0.5,
                                            "max_kv_fraction": 0.1}, False, True),
    # each layer chooses with its own query (a CPU reads the chosen rows in place)
    "infinigen-own-w4": ("infinigen", {"speculation_query": "own"}, False, True),
    "infinigen-own@0.1-w4": ("infinigen", {"speculation_query": "own",
                                           "max_kv_fraction": 0.1}, False, True),
    # the paper's speculation query (the previous layer's attention input, rehearsed), which
    # the labels without "-own"/"-input" ran before the default became each layer's own
    # query on a CPU ("auto")
    "infinigen-input@0.1": ("infinigen", {"speculation_query": "input",
                                          "max_kv_fraction": 0.1}, False, False),
    "infinigen-input@0.1-w4": ("infinigen", {"speculation_query": "input",
                                             "max_kv_fraction": 0.1}, False, True),
    "infinigen-input-half@0.1-w4": ("infinigen", {"speculation_query": "input",
                                                  "partial_weight_ratio": 0.5,
                                                  "max_kv_fraction": 0.1}, False, True),
}
DEFAULT_POLICIES = ["full", "infinigen", "infinigen@0.1", "h2o", "full-4bit"]
# llama.cpp (llama-bench, 2 threads, 4/5-bit weights, f16 KV), measured separately on this
# machine and quoted in issue 27: decode tokens/s by depth, prefill tokens/s by depth
LLAMA_CPP = {"smollm2-135m": {"decode": {0: 212, 4096: 77.9, 8192: 44.3},
                              "prefill": {0: 468, 4096: 258, 8192: 140}},
             "qwen2.5-coder-0.5b": {"decode": {0: 81, 4096: 45.6, 16384: 20.1},
                                    "prefill": {0: 335, 4096: 170, 16384: 62.8}}}


def read_bandwidth(size: int = 1 << 30, repeats: int = 15) -> float:
    """Bytes per second one large ``sum`` reads, all threads, the median of ``repeats``."""
    x = torch.ones(size // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return size / statistics.median(times)


def weight_read_bytes(lm) -> int:
    """Bytes of weights one decode step must read: all of them, except that an untied
    embedding table is only looked up (its head is read in full)."""
    total = sum(sum(t.bytes_by_tier().values()) for t in lm.engine.weights.values())
    if not lm.cfg.tie_word_embeddings:
        total -= sum(lm.engine.weights["embed.weight"].bytes_by_tier().values())
    return total


def kv_read_bytes(lm, report: dict, batch: int, context: float, compress: bool) -> float:
    """Bytes of KV cache (and speculation keys) one decode step must read at ``context``."""
    from flexgen_infinigen.kv.infinigen.spec_keys import bytes_per_key
    from flexgen_infinigen.memory.codes import stored_bytes

    cfg, item = lm.cfg, lm.engine.dtype.itemsize
    rows = batch * cfg.num_kv_heads
    per_layer = 2 * stored_bytes((int(context), rows, cfg.head_dim), item, compress)
    fractions = report.get("kv_fetch_fraction_per_layer")
    if not fractions:
        return cfg.num_layers * per_layer
    total = sum(f * per_layer for f in fractions)
    if report["kv_policy"] == "infinigen":
        kind = report["speculation_keys"]
        cols = max(1, round(report["partial_weight_ratio"] * cfg.head_dim))
        selecting = sum(1 for f in fractions if f < 0.999)
        total += selecting * context * rows * bytes_per_key(kind, cols, item)
    return total


def run_one(spec: dict) -> dict:
    """One configuration, in this process: load, prefill, decode; speed, bound and memory."""
    from long_prompts import natural_prompts

    from flexgen_infinigen import OffloadedLM, Placement
    from flexgen_infinigen.engine import memory_plan
    from flexgen_infinigen.engine.loading import model_config
    from flexgen_infinigen.engine.prefill_cache import PrefillCache

    bandwidth = spec["bandwidth"]  # measured by the parent just before this process
    baseline = _current_rss()  # Python, torch and the libraries: what no plan counts
    kv, options, compress, weights4 = POLICIES[spec["policy"]]
    b, gen = spec["batch"], spec["gen_len"]
    # "8K" on a model of 8,192 positions: the prompt leaves room for the generated tokens
    ctx = min(spec["context"], model_config(spec["model"]).max_positions - gen)
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=b,
                                 compress_cache=compress, compress_weight=weights4,
                                 prefill_chunk=spec.get("chunk"))
    with OffloadedLM.load(model=spec["model"], policy=policy, kv_policy=kv,
                          kv_options=options or None, max_len_hint=(ctx, gen),
                          progress=False) as lm:
        prompts, source = natural_prompts(lm.tokenizer, ctx, b, Path(spec["data_dir"]))
        kept = PrefillCache(spec["prefill_dir"]) if spec.get("prefill_dir") else None
        out = lm.generate(prompts, gen, stop_token_id=None, prefill_cache=kept)
        report = lm.engine.kv_policy.report()
        steps = out.step_times[1:]
        step = statistics.median(steps[2:] if len(steps) > 4 else steps)
        # the compute device tells whether 4-bit weights are multiplied in place (an older
        # checkout on PYTHONPATH does not take it)
        where = {"device": lm.engine.tiers.device} \
            if "device" in inspect.signature(memory_plan.plan).parameters else {}
        plan = memory_plan.plan(lm.cfg, lm.policy, lm.engine.dtype, ctx, gen,
                                kv=lm.engine.kv_policy, **where)
        weights = weight_read_bytes(lm)
        kv_bytes = kv_read_bytes(lm, report, b, ctx + gen / 2, compress)
        name = lm.cfg.name
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shared = out.prefills_reused > 0  # the prefill of an earlier row, read back from disk
    prefill = None if shared else out.prefill_latency_s
    return {**spec, "bandwidth": bandwidth, "context": ctx, "model_name": name,
            "prompt_source": source, "prefill_shared": shared, "prefill_s": prefill,
            "prefill_tokens_s": None if shared else b * ctx / prefill,
            "decode_step_s": step, "decode_tokens_s": b / step,
            "must_read_bytes": {"weights": weights, "kv": kv_bytes},
            "bound_s": (weights + kv_bytes) / bandwidth,
            "step_over_bound": step / ((weights + kv_bytes) / bandwidth),
            "speculation_share": report.get("speculation_time_s", 0.0)
            / max(out.decode_latency_s, 1e-9),
            "kv_fetch_fraction": report.get("kv_fetch_fraction", 1.0),
            "peak_rss_bytes": rss, "baseline_rss_bytes": baseline,
            "planned_bytes": plan["total"]["device"] + plan["total"]["host"]}


def _current_rss() -> int:
    """This process's resident bytes now (not its peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_reference(spec: dict) -> dict:
    """transformers on the same GGUF (its own loader), batch 1: the prompt's forward (its
    prefill) and then ``gen_len`` one-token forwards with its KV cache (the decode steps,
    the median reported)."""
    from long_prompts import natural_prompts
    from transformers import AutoModelForCausalLM

    from flexgen_infinigen.engine.loading import find_weights
    from flexgen_infinigen.text.tokenizer import load_tokenizer

    path = Path(spec["gguf"])
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    store = find_weights(spec["model"], None, False, progress=False)[2]
    tok = load_tokenizer(store.path, store.config)
    spec = {**spec, "context": min(spec["context"], store.config.max_positions - spec["gen_len"])}
    prompts, _ = natural_prompts(tok, spec["context"], 1, Path(spec["data_dir"]))
    ids = torch.tensor(prompts)
    with torch.no_grad():
        start = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = time.perf_counter() - start
        past, steps = out.past_key_values, []
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(spec["gen_len"]):
            start = time.perf_counter()
            out = model(token, past_key_values=past, use_cache=True)
            steps.append(time.perf_counter() - start)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    decode = statistics.median(steps)
    return {**spec, "prefill_s": prefill, "prefill_tokens_s": spec["context"] / prefill,
            "decode_step_s": decode, "decode_tokens_s": 1 / decode,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def in_subprocess(spec: dict, timeout: float, script: str = __file__) -> dict:
    """``script --one SPEC`` in a fresh process (a row's peak memory is its own): the row it
    prints last, or the spec with an ``error`` (never an exception, never a hang)."""
    cmd = [sys.executable, script, "--one", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**spec, "error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        lines = (proc.stderr or "").strip().splitlines()
        return {**spec, "error": lines[-1] if lines else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="registry name or .gguf / folder")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--policies", nargs="*", default=DEFAULT_POLICIES, choices=list(POLICIES),
                   help="none: only the transformers rows (with --reference-gguf)")
    p.add_argument("--gen-len", type=int, default=12)
    p.add_argument("--reference-gguf", default=None,
                   help="the model's GGUF: also time transformers at batch 1 (its own loader)")
    p.add_argument("--llama-cpp", default=None, choices=list(LLAMA_CPP),
                   help="print llama.cpp's separately measured figures for this model")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-bench binary: measure llama.cpp in this run too "
                        "(one stream, each context as its depth; see llama_cpp.py)")
    p.add_argument("--llama-gguf", default=None,
                   help="the GGUF llama-bench runs (default: --model if it is one, else "
                        "--reference-gguf)")
    p.add_argument("--llama-prefill-tokens", type=int, default=512,
                   help="prompt tokens llama-bench times at each depth (0: decode only)")
    p.add_argument("--data-dir", default=None,
                   help="folder with pg19_firstbook.txt / wikitext2_test.txt, the prompts' text "
                        "(default: ../shared/data; without either, a built-in paragraph)")
    p.add_argument("--tag", default=None,
                   help="write results/long_context_TAG.* instead of results/long_context.*")
    p.add_argument("--out", default=None, metavar="STEM",
                   help="the artifact's path without suffix (default: results/long_context, "
                        "or results/long_context_TAG)")
    p.add_argument("--fresh", action="store_true",
                   help="start the JSON's runs list anew instead of appending this run")
    p.add_argument("--timeout", type=float, default=7200)
    p.add_argument("--quick", action="store_true", help="4K, batch 1, full and infinigen")
    p.add_argument("--update", action="store_true",
                   help="kept for older command lines: every run is appended to the JSON's "
                        "runs list, and the table gives the median over them")
    p.add_argument("--prefill-dir", default=None,
                   help="keep prefills there and reuse them (default: a temporary folder, "
                        "deleted at the end); each context and batch is prefilled once, by its "
                        "first policy, and every policy that needs no prompt queries decodes "
                        "from it (H2O prefills itself)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        spec = json.loads(a.one)
        print(json.dumps(run_reference(spec) if spec.get("reference") else run_one(spec)))
        return 0
    if a.quick:
        a.contexts, a.batches, a.policies = [4096], [1], ["full", "infinigen"]
    from long_prompts import SHARED, source_text
    data_dir = Path(a.data_dir).expanduser() if a.data_dir else SHARED
    source = source_text(data_dir)[1]
    if a.data_dir and source == "built-in paragraph":
        p.error(f"--data-dir {a.data_dir}: no pg19_firstbook.txt or wikitext2_test.txt there")
    print(f"prompts: {source}" + ("" if a.data_dir or source != "built-in paragraph" else
                                  f" (no {SHARED}: pass --data-dir for natural text)"), flush=True)
    if a.llama_bench:
        from llama_cpp import LlamaBenchError, check
        gguf = a.llama_gguf or (a.model if a.model.endswith(".gguf") else a.reference_gguf)
        try:
            a.llama_bench, a.llama_gguf = check(a.llama_bench, gguf)
        except LlamaBenchError as e:
            p.error(str(e))
    from artifacts import append_run, run_meta
    from artifacts import load as load_runs
    from long_context_report import write_outputs
    from machine import machine_info

    stem = Path(a.out).with_suffix("") if a.out and a.out.endswith(".json") else (
        Path(a.out) if a.out else OUT / ("long_context" + (f"_{a.tag}" if a.tag else "")))
    if not a.fresh:
        try:  # a JSON written before runs were appended stops here, not after the runs
            load_runs(stem)
        except ValueError as e:
            p.error(f"{e} (or pass --fresh)")
    from tqdm.auto import tqdm

    bandwidth = read_bandwidth()
    print(f"read bandwidth (1 GiB sum, all threads): {bandwidth / 1e9:.1f} GB/s", flush=True)
    import shutil
    import tempfile

    from flexgen_infinigen.weights.embedded import default_cache_dir
    folder = a.prefill_dir or tempfile.mkdtemp(prefix="prefills-", dir=default_cache_dir())
    specs = [{"model": a.model, "context": c, "batch": b, "policy": pol, "gen_len": a.gen_len,
              "bandwidth": bandwidth, "prefill_dir": folder, "data_dir": str(data_dir)}
             for c in a.contexts for b in a.batches for pol in a.policies]
    if a.reference_gguf:
        specs += [{"model": a.model, "context": c, "batch": 1, "policy": "transformers",
                   "gen_len": a.gen_len, "reference": True, "gguf": a.reference_gguf,
                   "data_dir": str(data_dir)}
                  for c in a.contexts]
    rows = []
    try:
        for spec in tqdm(specs, desc="configurations", unit="run"):
            # this configuration's own bandwidth, just before it runs (this shared machine's
            # moves between runs), measured here so that no run's peak RSS holds the buffer
            spec["bandwidth"] = read_bandwidth()
            row = in_subprocess(spec, a.timeout)
            rows.append(row)
            tqdm.write(_line(row))
    finally:
        if a.prefill_dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    if a.llama_bench:
        from llama_cpp import llama_bench_rows
        print(f"llama.cpp: llama-bench on {Path(a.llama_gguf).name} at depths "
              f"{', '.join(map(str, a.contexts))}", flush=True)
        for row in llama_bench_rows(a.llama_bench, a.llama_gguf, a.contexts,
                                    torch.get_num_threads(), timeout=a.timeout,
                                    prefill_tokens=a.llama_prefill_tokens, model_label=a.model):
            row["bandwidth"] = read_bandwidth()
            rows.append(row)
            print(_line(row), flush=True)
    if a.llama_cpp:
        print(f"llama.cpp, measured separately in an earlier session: "
              f"{LLAMA_CPP[a.llama_cpp]}", flush=True)
    run = {"meta": run_meta(machine=machine_info(), bandwidth_gb_s=bandwidth / 1e9),
           "rows": rows}
    if a.llama_cpp:
        run["llama_cpp_separately_measured"] = LLAMA_CPP[a.llama_cpp]
    doc = append_run(stem, run, fresh=a.fresh, benchmark="long_context.py: prefill and "
                     "decode of each KV policy, KV cache in CPU memory")
    write_outputs(doc, stem)
    return 0


def _line(r: dict) -> str:
    head = f"{r['policy']:<12} ctx {r['context']:>6} b {r['batch']}"
    if "error" in r:
        return f"{head}: error: {r['error']}"
    prefill = "shared" if r.get("prefill_shared") else (
        f"{r['prefill_tokens_s']:.0f} tok/s" if "prefill_tokens_s" in r else "not timed")
    text = (f"{head}: prefill {prefill}, decode "
            f"{r['decode_tokens_s']:.2f} tok/s ({1e3 * r['decode_step_s']:.0f} ms/step")
    if "bound_s" in r:
        text += (f", bound {1e3 * r['bound_s']:.0f} ms = {r['step_over_bound']:.2f}x; "
                 f"spec {100 * r['speculation_share']:.0f}%; RSS "
                 f"{r['peak_rss_bytes'] / 1e9:.2f} GB, plan {r['planned_bytes'] / 1e9:.2f} GB")
    return text + ")"


if __name__ == "__main__":
    sys.exit(main())
