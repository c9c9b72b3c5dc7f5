"""Mixture-of-experts decode on this CPU: tokens/s beside the step's must-read bound, the
full cache against InfiniGen at long context, and llama.cpp on a GGUF of the same shapes,
in one run.

    python benchmarks/moe_decode.py                       # Qwen3-30B-A3B and OLMoE-1B-7B shapes
    python benchmarks/moe_decode.py --models olmoe-1b-7b --quick
    python benchmarks/moe_decode.py --llama-bench PATH/llama-bench

Weights are seeded random (``--dummy``) in the registry configs' shapes, kept in 4 bits
(``--compress-weight``: codes plus a scale and a minimum per group of 32, multiplied as
stored); the KV cache is float32 in CPU memory (``--percent 100 0 0 100 100 0``). Whole
models do not fit this machine's memory next to other work, so each model keeps its real
layer shapes but fewer layers (``--layers``), and its vocabulary is cut in the same ratio:
every share of what a step reads (head, layers, KV) is then the full model's, and the full
model's tokens/s is the measured rate times layers/full layers (``full_model_tokens_s``).

A step's **bound** is what it must read over the bandwidth measured just before each row
(one large ``sum``, all threads): the dense weights once (the embedding only looked up), the
routed experts the step's tokens use (E(1-(1-k/E)^B) of a layer's E experts at batch B,
as stored), and the KV rows (InfiniGen: its speculation keys and the rows it selects).

llama.cpp: ``--llama-bench`` times its ``llama-bench`` (one stream, each context as its
depth) on a GGUF of the same cut shapes with random Q4_0 codes (``random_gguf.py``),
written under ``--gguf-dir`` (default a temporary folder, deleted at the end).

Timing shares the machine: a long run whose process group id is in
``/work/notes/accuracy_run.pid`` (``--pause-pid-file``) is stopped for each row and resumed
right after, also on an error.

Writes ``benchmarks/results/moe_decode.{json,md,png}`` (``--out``): a run appends to the
JSON's ``runs`` list (``artifacts.py``; ``--fresh`` starts it anew), kept row by row as it
goes, and the markdown table and plot are made from every run of the file, each cell the
median, min and max over the runs that measured it (``moe_decode_report.py``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this checkout, not an install
OUT = ROOT / "benchmarks" / "results" / "moe_decode"
# model -> layers kept, contexts; InfiniGen at the longest, batch 8 at the shortest
MODELS = {"qwen3-30b-a3b": (2, [4096, 16384]), "olmoe-1b-7b": (2, [4096, 8192])}
POLICIES = {"full": ("full", None),
            # the runtime's default: on a CPU each layer's own query, 4% of the context
            # with a floor of 256 rows (kv/options.py)
            "infinigen": ("infinigen", {}),
            # the same with speculation keys of half the skewed columns (4-bit): half the
            # scoring work a row (--partial-weight-ratio 0.5)
            "infinigen-half": ("infinigen", {"partial_weight_ratio": 0.5}),
            "infinigen-pages@0.1": ("infinigen", {"speculation_keys": "pages16",
                                                  "max_kv_fraction": 0.1}),
            # each layer chooses rows with its own query (a CPU reads them in place): the
            # same share of the KV, InfiniGen inside the fused call despite the q/k norms
            "infinigen-own@0.1": ("infinigen", {"speculation_query": "own",
                                                "max_kv_fraction": 0.1})}
GEN = 8


def cut_config(name: str, layers: int, max_len: int):
    """The registry model with ``layers`` layers and the vocabulary cut in that ratio, its
    positions raised to ``max_len`` where the published config has fewer."""
    from flexgen_infinigen.config import get_config

    full = get_config(name)
    vocab = round(full.vocab_size * layers / full.num_layers / 64) * 64
    return dataclasses.replace(full, name=f"{name}-{layers}-of-{full.num_layers}-layers",
                               num_layers=layers, vocab_size=vocab,
                               max_positions=max(full.max_positions, max_len))


def run_one(spec: dict) -> dict:
    """One row in this process: load, prefill (or read it back), decode; speed and bound."""
    import resource

    from long_context import kv_read_bytes

    from flexgen_infinigen import OffloadedLM, Placement
    from flexgen_infinigen.config import KNOWN_MODELS
    from flexgen_infinigen.models.moe import is_expert_weight
    from flexgen_infinigen.planner.workload import expert_coverage
    from flexgen_infinigen.engine.prefill_cache import PrefillCache

    ctx, b, gen_steps = spec["context"], spec["batch"], spec.get("steps", GEN)
    cfg = cut_config(spec["model"], spec["layers"], ctx + gen_steps)
    KNOWN_MODELS[cfg.name] = cfg
    kv, options = POLICIES[spec["policy"]]
    if kv == "infinigen":  # the full model's share of layers that read the whole cache
        spec["infinigen_first_layer"] = max(1, spec["infinigen_first_layer"])
        options = {**options, "first_layer": spec["infinigen_first_layer"]}
    # dummy weights are 4-bit with --compress-weight; a GGUF's Q4_0 codes are kept as stored
    gguf = spec.get("gguf")
    eg, ec = spec.get("experts_percent") or (None, None)  # None: experts as the weights
    g = spec.get("gpu_batches", 1)
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=b // g,
                                 num_gpu_batches=g,
                                 compress_weight=gguf is None, expert_gpu_percent=eg,
                                 expert_cpu_percent=ec)
    source = {"model": gguf} if gguf else {"model": cfg.name, "dummy": True}
    with OffloadedLM.load(**source, policy=policy, kv_policy=kv, kv_options=options,
                          max_len_hint=(ctx, gen_steps), progress=False,
                          offload_dir=spec.get("offload_dir")) as lm:
        gen = torch.Generator().manual_seed(ctx + b)
        prompts = [torch.randint(3, cfg.vocab_size, (ctx,), generator=gen).tolist()
                   for _ in range(b)]
        out = lm.generate(prompts, gen_steps, stop_token_id=None,
                          prefill_cache=PrefillCache(spec["prefill_dir"]))
        report = lm.engine.kv_policy.report()
        steps = out.step_times[1:]
        step = statistics.median(steps[2:] if len(steps) > 4 else steps)
        held = {n: sum(t.bytes_by_tier().values()) for n, t in lm.engine.weights.items()}
        kv_bytes = kv_read_bytes(lm, report, b, ctx + gen_steps / 2, False)
    dense = sum(v for n, v in held.items() if not is_expert_weight(n) and n != "embed.weight")
    one_expert = sum(v for n, v in held.items() if n.startswith("layers.0.experts.0."))
    active = cfg.num_layers * expert_coverage(cfg, b)
    experts = active * one_expert
    must = dense + experts + kv_bytes
    full_layers = int(spec["model_layers"])
    return {**spec, "model_name": cfg.name, "vocab_size_cut": cfg.vocab_size,
            "prefill_shared": out.prefills_reused > 0,
            "prefill_s": None if out.prefills_reused else out.prefill_latency_s,
            "decode_step_s": step, "decode_tokens_s": b / step,
            "full_model_tokens_s": b / step * cfg.num_layers / full_layers,
            "active_experts_per_layer": active / cfg.num_layers,
            "must_read_bytes": {"dense_weights": dense, "experts": experts, "kv": kv_bytes},
            "bound_s": must / spec["bandwidth"], "step_over_bound": step * spec["bandwidth"] / must,
            "kv_fetch_fraction": report.get("kv_fetch_fraction", 1.0),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


@contextlib.contextmanager
def paused(pid_file: str | None):
    """Stop the process group in ``pid_file`` (if it runs) and resume it on leaving, also on
    an error or a SIGTERM/SIGINT."""
    group = None
    if pid_file and Path(pid_file).is_file():
        with contextlib.suppress(ValueError, OSError):
            group = int(Path(pid_file).read_text().split()[0])
            os.killpg(group, signal.SIGSTOP)

    def stop(signum, frame):
        raise SystemExit(128 + signum)
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield group
    finally:
        if group is not None:
            with contextlib.suppress(OSError):
                os.killpg(group, signal.SIGCONT)
        for s, h in old.items():
            signal.signal(s, h)


def in_subprocess(spec: dict, timeout: float) -> dict:
    from long_context import in_subprocess as run_row
    return run_row(spec, timeout, __file__)


def specs_for(model: str, layers: int, contexts: list[int], batches: list[int],
              batch_policies: tuple[str, ...] = ("full",)) -> list[dict]:
    """Batch 1 with the full cache at every context, InfiniGen at the longest (after the
    full cache, whose prefill it reads back), the larger batches at the shortest (the full
    cache, and ``batch_policies`` after it)."""
    from flexgen_infinigen.config import get_config

    full = get_config(model).num_layers
    # InfiniGen's first 2 layers read the whole cache: the same share of the layers kept,
    # but at least layer 0 (it has no previous layer to speculate from)
    base = {"model": model, "layers": layers, "model_layers": full,
            "infinigen_first_layer": max(1, int(2 * layers / full + 0.5))}
    out = [{**base, "context": c, "batch": 1, "policy": "full"} for c in contexts]
    out += [{**base, "context": max(contexts), "batch": 1, "policy": p}
            for p in POLICIES if p != "full"]
    out += [{**base, "context": min(contexts), "batch": b, "policy": p}
            for b in batches if b > 1
            for p in ["full", *(q for q in batch_policies if q != "full")]]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--layers", type=int, default=None, help="layers kept (default per model)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--contexts", type=int, nargs="+", default=None,
                   help="contexts (default per model)")
    p.add_argument("--quick", action="store_true", help="contexts 1024/2048, batch 1 only")
    p.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary")
    p.add_argument("--gguf-dir", default=None, help="keep the random GGUFs there")
    p.add_argument("--llama-args", default="",
                   help="more llama-bench arguments, e.g. '--repack 0' where its repacked "
                        "(AMX) kernels stop on an illegal instruction")
    p.add_argument("--gguf-weights", action="store_true",
                   help="load the random Q4_0 GGUF llama-bench reads (16-bit scales, 4.5 bits "
                        "a weight) instead of 4-bit dummy weights (6 bits): a whole "
                        "Qwen3-30B-A3B (--layers 48) then fits in 24 GB")
    p.add_argument("--experts-percent", type=float, nargs=2, default=None,
                   metavar=("GPU", "CPU"), help="the routed experts' placement (disk the "
                   "rest, under the prefill folder); default: in memory with the weights")
    p.add_argument("--pause-pid-file", default="/work/notes/accuracy_run.pid")
    p.add_argument("--timeout", type=float, default=590.0, help="seconds per row")
    p.add_argument("--policies", nargs="+", default=["full", "infinigen-pages@0.1"],
                   choices=list(POLICIES),
                   help="run only these rows (infinigen: the runtime's default)")
    p.add_argument("--batch-policies", nargs="+", default=["full"], choices=list(POLICIES),
                   help="the policies of the larger batches' rows (default the full cache)")
    p.add_argument("--gpu-batches", type=int, default=1,
                   help="a larger batch as this many GPU batches of batch / N sequences (one "
                        "block, each stage's weights read once for all): a long prompt's "
                        "prefill then holds one GPU batch's activations, not the batch's")
    p.add_argument("--prefill-dir", default=None,
                   help="keep prefills there and reuse them (default: a temporary folder)")
    p.add_argument("--steps", type=int, default=GEN,
                   help="tokens decoded a row (the step time: their median after the first 3)")
    p.add_argument("--update", action="store_true",
                   help="kept for earlier command lines: a run always appends to --out's runs")
    p.add_argument("--fresh", action="store_true",
                   help="start --out's list of runs anew (default: append this run to it)")
    p.add_argument("--out", default=str(OUT), help="results path, without the suffix")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    out = Path(a.out)
    if a.one:
        print(json.dumps(run_one(json.loads(a.one))))
        return 0
    if a.llama_bench:
        from llama_cpp import check
        check(a.llama_bench, __file__)  # the binary, before any long work
    import shutil

    import artifacts
    from long_context import read_bandwidth

    from flexgen_infinigen.weights.embedded import default_cache_dir

    earlier = {"runs": []} if a.fresh else artifacts.load(out)  # refuses an old-format file
    meta = artifacts.run_meta(None if argv is None else ["benchmarks/moe_decode.py", *argv])
    prefills = a.prefill_dir or tempfile.mkdtemp(prefix="moe-prefills-", dir=default_cache_dir())
    ggufs = a.gguf_dir or tempfile.mkdtemp(prefix="moe-gguf-")
    rows = []
    try:
        for model in a.models:
            layers = a.layers or MODELS[model][0]
            contexts = [1024, 2048] if a.quick else a.contexts or MODELS[model][1]
            batches = [1] if a.quick else a.batches
            gguf = gguf_for(model, layers, contexts, ggufs) if a.gguf_weights else None
            for spec in specs_for(model, layers, contexts, batches, tuple(a.batch_policies)):
                if spec["policy"] not in a.policies:
                    continue
                if gguf:
                    spec["gguf"] = gguf
                if spec["batch"] > 1 and a.gpu_batches > 1:
                    if spec["batch"] % a.gpu_batches:
                        raise SystemExit(f"--gpu-batches {a.gpu_batches} must divide the batch "
                                         f"({spec['batch']})")
                    spec["gpu_batches"] = a.gpu_batches
                if a.experts_percent:
                    spec.update(experts_percent=a.experts_percent,
                                offload_dir=str(Path(prefills) / "offload"))
                with paused(a.pause_pid_file):
                    spec.update(bandwidth=read_bandwidth(), prefill_dir=prefills, steps=a.steps)
                    row = in_subprocess(spec, a.timeout)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "prefill_dir"}),
                      flush=True)
                save_run(earlier, meta, rows, a.models, out)  # what is done so far, kept
            if a.llama_bench:
                rows += llama_rows(a, model, layers, contexts, ggufs)
                save_run(earlier, meta, rows, a.models, out)
    finally:
        if a.prefill_dir is None:
            shutil.rmtree(prefills, ignore_errors=True)
        if a.gguf_dir is None:
            shutil.rmtree(ggufs, ignore_errors=True)
    save_run(earlier, meta, rows, a.models, out)
    return 0


def save_run(earlier: dict, meta: dict, rows: list[dict], models: list[str], out: Path) -> dict:
    """``out``'s earlier runs and this one (its rows so far) written whole, then the md and
    png from all of them; nothing is written before a first row."""
    import artifacts
    from machine import machine_info
    from moe_decode_report import bandwidths, write_outputs

    if not rows:
        return earlier
    run = {"meta": {**meta, "machine": machine_info()}, "rows": rows}
    bw = bandwidths([run])
    if bw:
        run["meta"]["bandwidth_gb_s"] = round(statistics.median(bw), 1)
    doc = {**earlier, **about(rows, models), "runs": [*earlier["runs"], run]}
    artifacts.save(out, doc)
    write_outputs(doc, out)
    return doc


def about(rows: list[dict], models: list[str]) -> dict:
    """What every run of the file measures (the JSON's own fields beside ``runs``)."""
    from flexgen_infinigen.config import get_config
    return {"models_full_layers": {m: get_config(m).num_layers
                                   for m in sorted({r["model"] for r in rows} | set(models))},
            "shapes": "each model's real layer shapes, fewer layers, vocabulary cut in the "
                      "same ratio; full_model_tokens_s = measured * layers / full layers",
            "weights": "seeded random, 4-bit codes multiplied as stored: dummy rows with a "
                       "float32 scale and minimum per group of 32 (6 bits a parameter); rows "
                       "with a 'gguf' load llama.cpp's random Q4_0 file (a float16 scale per "
                       "32, 4.5 bits)",
            "kv_cache": "float32, in CPU memory"}


def gguf_for(model: str, layers: int, contexts: list[int], folder: str) -> str:
    """The random-Q4_0 GGUF of ``model`` cut to ``layers`` layers in ``folder``, written once."""
    from random_gguf import write_random_gguf

    cfg = cut_config(model, layers, max(contexts) + 64)
    path = str(Path(folder) / f"{cfg.name}.gguf")
    if not Path(path).is_file():
        write_random_gguf(cfg, path)
    return path


def llama_rows(a, model: str, layers: int, contexts: list[int], folder: str) -> list[dict]:
    """llama-bench on a random-Q4_0 GGUF of the same cut shapes, each context a depth."""
    from llama_cpp import llama_bench_rows
    from long_context import read_bandwidth

    from flexgen_infinigen.config import get_config

    path = gguf_for(model, layers, contexts, folder)
    cfg = cut_config(model, layers, max(contexts) + 64)
    with paused(a.pause_pid_file):
        bandwidth = read_bandwidth()
        rows = llama_bench_rows(a.llama_bench, path, contexts, torch.get_num_threads(),
                                gen_tokens=16, prefill_tokens=0, timeout=a.timeout,
                                model_label=cfg.name, extra=tuple(a.llama_args.split()))
    for row in rows:
        row.update(model=model, layers=layers, bandwidth=bandwidth, policy="llama.cpp",
                   model_layers=get_config(model).num_layers, gguf="random Q4_0 codes")
        if "decode_tokens_s" in row:
            row["full_model_tokens_s"] = row["decode_tokens_s"] * layers / row["model_layers"]
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
