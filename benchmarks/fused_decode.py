"""The fused CPU decode step (one compiled call a stage, ``runtime/fused_decode.py``) beside the
per-operation path, alternating in one run, and llama.cpp's ``llama-bench`` on the same GGUF.

    python benchmarks/fused_decode.py --llama-bench path/to/llama-bench   # both cases
    python benchmarks/fused_decode.py --cases short --repeats 5

``short``: the default model (its GGUF's codes, as the runtime stores them), batch 1, a
~900-token WikiText-2 prompt: decode tokens/s (median step) and prefill tokens/s, fused and
per-operation, then llama-bench's decode after 900 cached tokens and its 900-token prefill
(flash attention on). ``long``: SmolLM2, batch 8 x 8,180 tokens, the full cache and InfiniGen,
fused and per-operation, from one kept prefill, with each step's must-read bound (weights
and KV rows a step must read over this machine's read bandwidth) and the share of the step
spent inside the fused calls.

``--pause PIDFILE`` stops that process group (another job sharing the CPU) during each timed
generation and resumes it right after, even on an error. Writes
``benchmarks/results/fused_decode.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
OUT = ROOT / "benchmarks" / "results" / "fused_decode"
GGUF = Path.home() / ".cache" / "flexgen_infinigen" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextlib.contextmanager
def paused(pidfile: str | None):
    """The process group in ``pidfile`` stopped for the block (resumed whatever happens)."""
    pid = None
    if pidfile and Path(pidfile).is_file():
        with contextlib.suppress(ValueError):
            pid = int(Path(pidfile).read_text().strip())
    if pid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGCONT)


def _timed_calls(spent: list) -> None:
    """Add each fused call's wall time to ``spent[0]``."""
    from flexgen_infinigen.runtime import fused_decode

    real = fused_decode.LayerPlan._call

    def timed(self, mode):
        start = time.perf_counter()
        real(self, mode)
        spent[0] += time.perf_counter() - start
    fused_decode.LayerPlan._call = timed


def _run(lm, prompts, steps: int, fused, pause, spent, kept=None) -> dict:
    """One generation with the fused step on (``fused`` the engine's FusedDecode) or off."""
    saved = lm.engine.fused
    lm.engine.fused = fused
    spent[0] = 0.0
    try:
        with paused(pause):
            out = lm.generate(prompts, steps + 1, stop_token_id=None, prefill_cache=kept)
    finally:
        lm.engine.fused = saved
    times = out.step_times[1:]
    step = statistics.median(times[1:] if len(times) > 2 else times)
    return {"step_s": step, "decode_tokens_s": len(prompts) / step,
            "prefill_s": out.step_times[0], "in_fused_calls": spent[0] / sum(times),
            "tokens": out.token_ids}


def short_case(a, pause, spent) -> dict:
    from long_prompts import SHARED, natural_prompts

    from flexgen_infinigen import OffloadedLM, Policy
    from flexgen_infinigen.weights.embedded import default_model_store

    policy = Policy.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=1)
    runs = {"fused": [], "per-operation": []}
    with OffloadedLM.load(path=default_model_store(progress=False), policy=policy,
                          progress=False, max_len_hint=(a.prompt, a.steps + 1)) as lm:
        prompts, source = natural_prompts(lm.tokenizer, a.prompt, 1,
                                          Path(a.data_dir) if a.data_dir else SHARED)
        fused = lm.engine.fused
        assert fused is not None, "the fused step is not available here (no compiler?)"
        _run(lm, prompts, 4, fused, pause, spent)  # warm: kernels, plans, page faults
        for r in range(a.repeats):
            for name in (("fused", "per-operation") if r % 2 == 0 else
                         ("per-operation", "fused")):
                got = _run(lm, prompts, a.steps, fused if name == "fused" else None, pause,
                           spent)
                runs[name].append(got)
                print(f"short {name}: {got['decode_tokens_s']:.1f} tokens/s, prefill "
                      f"{a.prompt / got['prefill_s']:.0f} tokens/s", flush=True)
    same = runs["fused"][0]["tokens"] == runs["per-operation"][0]["tokens"]
    rows = [_summary(name, got, a.prompt) for name, got in runs.items()]
    if a.llama_bench:
        rows += llama_bench(a.llama_bench, a.gguf, a.prompt, a.threads, pause,
                            not a.llama_no_depth, tuple(a.llama_args.split()))
    return {"prompt_tokens": a.prompt, "prompt_source": source, "steps": a.steps,
            "same_tokens": same, "rows": rows}


def _summary(name: str, runs: list[dict], prompt: int, **extra) -> dict:
    rates = [r["decode_tokens_s"] for r in runs]
    prefill = [prompt * r.get("batch", 1) / r["prefill_s"] for r in runs]
    return {"variant": name, **extra, "decode_tokens_s": statistics.median(rates),
            "decode_range": [min(rates), max(rates)], "step_s": statistics.median(
                r["step_s"] for r in runs),
            "prefill_tokens_s": statistics.median(prefill),
            "in_fused_calls": statistics.median(r["in_fused_calls"] for r in runs)}


def llama_bench(binary: str, gguf: str, prompt: int, threads: int, pause,
                depth_works: bool = True, extra: tuple[str, ...] = ()) -> list[dict]:
    """llama-bench's decode after ``prompt`` cached tokens and its ``prompt``-token prefill,
    flash attention on. Without ``depth_works`` (a build that stops on ``-d``), its decode
    from an empty cache: an upper bound of its rate after ``prompt`` tokens."""
    from llama_cpp import check

    binary, gguf = check(binary, gguf)
    rows = []
    depth = ["-d", str(prompt)] if depth_works else []
    for what, args in (("decode", ["-p", "0", "-n", "32", *depth]),
                       ("prefill", ["-p", str(prompt), "-n", "0"])):
        cmd = [binary, "-m", gguf, "-t", str(threads), "-r", "3", "-o", "json", "-fa", "1",
               *args, *extra]
        with paused(pause):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            rows.append({"variant": f"llama.cpp {what}", "error": proc.stderr[-300:]})
            continue
        test = json.loads(proc.stdout)[0]
        empty = "" if depth_works or what == "prefill" else " (empty cache)"
        rows.append({"variant": f"llama.cpp {what}{empty}", "tokens_s": float(test["avg_ts"]),
                     "range": [float(test["avg_ts"]) - float(test["stddev_ts"]),
                               float(test["avg_ts"]) + float(test["stddev_ts"])],
                     "command": " ".join([Path(binary).name, *cmd[1:2], Path(gguf).name,
                                          *cmd[3:]])})
        print(f"llama.cpp {what}: {float(test['avg_ts']):.1f} tokens/s", flush=True)
    return rows


def long_case(a, pause, spent) -> dict:
    from long_context import kv_read_bytes, read_bandwidth, weight_read_bytes
    from long_prompts import SHARED, natural_prompts

    from flexgen_infinigen import OffloadedLM, Policy
    from flexgen_infinigen.kv import make_kv_policy
    from flexgen_infinigen.runtime.prefill_cache import PrefillCache

    kept = PrefillCache(a.prefill_dir, keep=0)  # on disk only: one copy of the KV in memory
    policy = Policy.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=a.batch)
    rows = []
    with OffloadedLM.load(model="smollm2-135m", policy=policy, progress=False,
                          max_len_hint=(a.context, a.long_steps + 1)) as lm:
        prompts, source = natural_prompts(lm.tokenizer, a.context, a.batch,
                                          Path(a.data_dir) if a.data_dir else SHARED)
        fused = lm.engine.fused
        bandwidth = read_bandwidth(256 << 20)
        for kv in a.long_policies:
            if kv in ("full", "infinigen"):  # the runtime's defaults
                lm.use_kv_policy(make_kv_policy(kv))
            else:  # as the retrieval benchmark names and measures them
                from long_context_accuracy import parse_policy
                name, options, _ = parse_policy(kv)  # checked in main
                lm.use_kv_policy(make_kv_policy(name, **options))
            _run(lm, prompts, 2, fused, None, spent, kept)  # the prefill, kept; warm
            runs = {"fused": [], "per-operation": []}
            for r in range(a.long_repeats):
                for name in (("fused", "per-operation") if r % 2 == 0 else
                             ("per-operation", "fused")):
                    got = _run(lm, prompts, a.long_steps, fused if name == "fused" else None,
                               pause, spent, kept)
                    got["batch"] = a.batch
                    runs[name].append(got)
                    print(f"long {kv} {name}: {1e3 * got['step_s']:.1f} ms a step",
                          flush=True)
            report = lm.engine.kv_policy.report()
            context = a.context + a.long_steps / 2
            must = weight_read_bytes(lm) + kv_read_bytes(lm, report, a.batch, context, False)
            for name, got in runs.items():
                row = _summary(name, got, a.context, kv_policy=kv)
                row.pop("prefill_tokens_s")  # a kept prefill: not measured here
                row["must_read_bytes"] = must
                row["bound_s"] = must / bandwidth
                row["step_over_bound"] = row["step_s"] / row["bound_s"]
                row["kv_fetch_fraction"] = report.get("kv_fetch_fraction", 1.0)
                rows.append(row)
    return {"batch": a.batch, "context": a.context, "prompt_source": source,
            "read_bandwidth_bytes_s": bandwidth, "rows": rows}


def markdown(result: dict) -> str:
    lines = ["# Fused CPU decode step", ""]
    short = result.get("short")
    if short:
        lines += [f"Default model, batch 1, a {short['prompt_tokens']}-token prompt "
                  f"({short['prompt_source']}); same tokens fused and per-operation: "
                  f"{short['same_tokens']}.", "",
                  "| variant | decode tokens/s (range) | prefill tokens/s | in fused calls |",
                  "|---|---|---|---|"]
        for r in short["rows"]:
            if "error" in r:
                lines.append(f"| {r['variant']} | error: {r['error'][:80]} | | |")
            elif r["variant"].startswith("llama.cpp"):
                rate = f"{r['tokens_s']:.1f} ({r['range'][0]:.1f}-{r['range'][1]:.1f})"
                cells = [rate, ""] if "decode" in r["variant"] else ["", rate]
                lines.append(f"| {r['variant']} | " + " | ".join(cells) + " | |")
            else:
                lines.append(f"| {r['variant']} | {r['decode_tokens_s']:.1f} "
                             f"({r['decode_range'][0]:.1f}-{r['decode_range'][1]:.1f}) | "
                             f"{r['prefill_tokens_s']:.0f} | {r['in_fused_calls']:.0%} |")
        lines.append("")
    long = result.get("long")
    if long:
        lines += [f"SmolLM2, batch {long['batch']} x {long['context']} tokens, KV cache in CPU "
                  "memory; bound: bytes a step must read over "
                  f"{long['read_bandwidth_bytes_s'] / 1e9:.1f} GB/s.", "",
                  "| KV policy | variant | step ms | tokens/s (range) | bound ms | step / bound "
                  "| in fused calls | KV read |", "|---|---|---|---|---|---|---|---|"]
        for r in long["rows"]:
            lines.append(f"| {r['kv_policy']} | {r['variant']} | {1e3 * r['step_s']:.1f} | "
                         f"{r['decode_tokens_s']:.1f} ({r['decode_range'][0]:.1f}-"
                         f"{r['decode_range'][1]:.1f}) | {1e3 * r['bound_s']:.1f} | "
                         f"{r['step_over_bound']:.2f}x | {r['in_fused_calls']:.0%} | "
                         f"{r['kv_fetch_fraction']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("short", "long") if result.get(k)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        rows = [r for r in result[key]["rows"] if "error" not in r
                and (key == "long" or "prefill" not in r["variant"])]
        labels = [(r.get("kv_policy", "") + " " + r["variant"]).strip() for r in rows]
        rates = [r.get("decode_tokens_s", r.get("tokens_s")) for r in rows]
        ax.bar(range(len(rows)), rates, color="tab:blue")
        if key == "long":
            bounds = [r["batch"] / r["bound_s"] if "batch" in r else
                      result["long"]["batch"] / r["bound_s"] for r in rows]
            ax.plot(range(len(rows)), bounds, "k_", markersize=30, label="must-read bound")
            ax.legend()
        ax.set_xticks(range(len(rows)), labels, rotation=20, ha="right")
        ax.set_ylabel("decode tokens/s")
        ax.set_title("default model, batch 1, ~900 tokens" if key == "short" else
                     f"SmolLM2 batch {result['long']['batch']} x {result['long']['context']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["short", "long"], choices=["short", "long"])
    p.add_argument("--prompt", type=int, default=900)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=8180)
    p.add_argument("--long-steps", type=int, default=8)
    p.add_argument("--long-repeats", type=int, default=2)
    p.add_argument("--long-policies", nargs="+", default=["full", "infinigen"],
                   help="KV policies of the long case: full, infinigen (the defaults), or a "
                        "label of benchmarks/long_context_accuracy.py, e.g. infinigen@0.04 "
                        "(a budget whose retrieval scores are measured there)")
    p.add_argument("--prefill-dir", default=str(Path.home() / ".cache" / "flexgen_infinigen"
                                                / "bench_prefill"))
    p.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary")
    p.add_argument("--gguf", default=str(GGUF), help="the GGUF llama-bench reads")
    p.add_argument("--llama-no-depth", action="store_true",
                   help="llama-bench's decode from an empty cache (for a build that stops on -d)")
    p.add_argument("--llama-args", default="", help="more llama-bench arguments, e.g. "
                   "'--repack 0' for a build whose repacked kernels stop on this CPU")
    p.add_argument("--data-dir", default=None, help="folder with wikitext2_test.txt (default: "
                   "../shared/data)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--pause", default=None, help="PIDFILE of a process group to stop while "
                   "timing")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    for kv in a.long_policies:  # a misspelt label stops here, not after the model loads
        if kv not in ("full", "infinigen"):
            from long_context_accuracy import parse_policy
            try:
                cache_4bit = parse_policy(kv)[2]
            except ValueError as e:
                p.error(f"--long-policies: {kv}: {e}")
            if cache_4bit or kv.endswith("-w4"):
                p.error(f"--long-policies: {kv} changes the cache or weights; this benchmark "
                        "keeps both as the default model has them")
    if a.llama_bench:
        from llama_cpp import LlamaBenchError, check
        try:
            check(a.llama_bench, a.gguf)
        except LlamaBenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    from machine import machine_info

    spent = [0.0]
    _timed_calls(spent)
    result = {"machine": machine_info(), "command": " ".join(["python",
                                                             "benchmarks/fused_decode.py",
                                                             *(argv or sys.argv[1:])])}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for case in a.cases:
        result[case] = (short_case if case == "short" else long_case)(a, a.pause, spent)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(f"written {out}.json, .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
