"""The fused CPU decode step (one compiled call a stage, ``engine/stage_plan.py``) beside the
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
generation and resumes it right after, even on an error.

Each case appends a run to its artifact's ``runs`` list and rewrites the summary of every
run: the long case ``benchmarks/results/infinigen_vs_full.{json,md,png}`` (``--out``), the
short case ``benchmarks/results/default_model_vs_llamacpp.{json,md,png}`` (``--short-out``).
``--fresh`` starts a list anew; ``--report-only`` rewrites the .md and .png alone.
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
import artifacts  # noqa: E402

LONG_OUT = artifacts.RESULTS / "infinigen_vs_full"
SHORT_OUT = artifacts.RESULTS / "default_model_vs_llamacpp"
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
    from flexgen_infinigen.kernels.layer_call import LayerCall

    real = LayerCall.run

    def timed(self, mode):
        start = time.perf_counter()
        real(self, mode)
        spent[0] += time.perf_counter() - start
    LayerCall.run = timed


def _run(lm, prompts, steps: int, fused, pause, spent, kept=None) -> dict:
    """One generation with the fused step on (``fused``: the compiled-call library) or off."""
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

    from flexgen_infinigen import OffloadedLM, Placement
    from flexgen_infinigen.weights.embedded import default_model_store

    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=1)
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

    from flexgen_infinigen import OffloadedLM, Placement
    from flexgen_infinigen.kv import make_kv_policy
    from flexgen_infinigen.engine.prefill_cache import PrefillCache

    kept = PrefillCache(a.prefill_dir, keep=0)  # on disk only: one copy of the KV in memory
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=a.batch)
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


def short_rows(short: dict) -> list[dict]:
    """The short case's rows for the runs list: one a program, llama-bench's decode and
    prefill on one row, each rate against llama.cpp's decode of the same run."""
    rows, llama = [], {"program": "llama.cpp", "prompt": short["prompt_tokens"]}
    for r in short["rows"]:
        if r["variant"].startswith("llama.cpp"):
            if "error" in r:
                llama.setdefault("error", r["error"][-300:])
                continue
            if "decode" in r["variant"]:
                llama["decode_tokens_s"] = r["tokens_s"]
                if "empty cache" in r["variant"]:
                    llama["program"] = "llama.cpp (decode from an empty cache)"
            else:
                llama["prefill_tokens_s"] = r["tokens_s"]
            continue
        rows.append({"program": f"flexgen_infinigen, {r['variant']}",
                     "prompt": short["prompt_tokens"], "decode_tokens_s": r["decode_tokens_s"],
                     "decode_range": r["decode_range"],
                     "prefill_tokens_s": r["prefill_tokens_s"],
                     "in_fused_calls": r["in_fused_calls"]})
    if len(llama) > 2:
        rows.append(llama)
    base = llama.get("decode_tokens_s")
    for r in rows:
        if base and r is not llama and "decode_tokens_s" in r:
            r["x_llama_cpp"] = r["decode_tokens_s"] / base
    return rows


def long_rows(long: dict) -> list[dict]:
    """The long case's rows for the runs list: one a KV policy and path, each step against
    the full cache's step on the same path in the same run."""
    rows = []
    for r in long["rows"]:
        rows.append({"model": "SmolLM2-135M", "batch": long["batch"],
                     "context": long["context"], "kv_policy": r["kv_policy"],
                     "variant": r["variant"], "step_ms": 1e3 * r["step_s"],
                     "tokens_s": long["batch"] / r["step_s"],
                     "kv_read": r["kv_fetch_fraction"], "bound_ms": 1e3 * r["bound_s"],
                     "step_over_bound": r["step_over_bound"],
                     "in_fused_calls": r["in_fused_calls"]})
    full = {r["variant"]: r["step_ms"] for r in rows if r["kv_policy"] == "full"}
    for r in rows:
        if r["variant"] in full and r["kv_policy"] != "full":
            r["x_full"] = full[r["variant"]] / r["step_ms"]
    return rows


def _table(runs: list[dict], keys: list[str], columns: list[tuple[str, str, str]],
           where=None) -> str:
    """``artifacts.table`` with a format a column: ``(header, field, fmt)``."""
    lines = ["| " + " | ".join([*keys, *(h for h, _, _ in columns)]) + " |",
             "|" + "---|" * (len(keys) + len(columns))]
    for key, rows in artifacts.grouped(runs, keys, where).items():
        cells = ["" if k is None else str(k) for k in key]
        cells += [artifacts.spread((r.get(f) for r in rows), fmt) for _, f, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _latest_case(runs: list[dict]) -> tuple[int, int] | None:
    """(batch, context) of the newest run's rows: the table sums up the runs of that case."""
    for run in reversed(runs):
        for r in run["rows"]:
            return r["batch"], r["context"]
    return None


def long_markdown(doc: dict) -> str:
    runs = doc["runs"]
    case = _latest_case(runs)
    if case is None:
        return "# InfiniGen against the full cache\n\nNo runs yet.\n"
    context = case[1]

    def fused(r):
        return r["variant"] == "fused" and (r["batch"], r["context"]) == case
    cases = [run for run in runs if any(fused(r) for r in run["rows"])]
    return (f"# InfiniGen against the full cache: SmolLM2-135M, batch {case[0]} x {context:,} "
            "tokens, fused CPU decode step\n\n" + artifacts.meta_line(cases) + "\n\n"
            + _table(runs, ["kv_policy"], [
                ("step ms", "step_ms", "{:.1f}"),
                ("tokens/s (batch total)", "tokens_s", "{:.1f}"),
                ("x full cache", "x_full", "{:.2f}"), ("KV read", "kv_read", "{:.2f}")],
                where=fused)
            + "\nEach cell: median (min-max, N runs) over the runs; x full cache: the full "
            "cache's step over this step, in the same run.\n")


def short_markdown(doc: dict) -> str:
    runs = doc["runs"]

    def shown(r):
        return "per-operation" not in r["program"]
    prompt = next((r["prompt"] for run in reversed(runs) for r in run["rows"]), "?")
    return (f"# The default model against llama.cpp: batch 1, a {prompt}-token prompt\n\n"
            + artifacts.meta_line(runs) + "\n\n"
            + _table(runs, ["program"], [
                ("decode tokens/s", "decode_tokens_s", "{:.1f}"),
                ("prefill tokens/s", "prefill_tokens_s", "{:.0f}"),
                ("decode / llama.cpp's", "x_llama_cpp", "{:.2f}")], where=shown)
            + "\nEach cell: median (min-max, N runs) over the runs; decode / llama.cpp's: in "
            "the same run.\n")


def _plot(runs: list[dict], key: str, field: str, where, title: str, ylabel: str,
          path: Path) -> None:
    """One bar a ``key`` value: the median of ``field`` over the runs, each run a dot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = artifacts.grouped(runs, [key], where)
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 * len(groups) + 2), 3.8))
    for i, rows in enumerate(groups.values()):
        values = [r[field] for r in rows if r.get(field) is not None]
        if not values:
            continue
        ax.bar(i, statistics.median(values), color="tab:blue", alpha=0.6)
        ax.plot([i] * len(values), values, "ko", markersize=4)
    ax.set_xticks(range(len(groups)), [k[0] for k in groups], rotation=15, ha="right")
    ax.set(ylabel=ylabel, title=f"{title} ({len(runs)} run{'s' if len(runs) != 1 else ''})")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_long(stem: Path) -> None:
    """``STEM.md`` and ``STEM.png`` from every run in ``STEM.json``."""
    doc = artifacts.load(stem)
    stem.with_suffix(".md").write_text(long_markdown(doc))
    case = _latest_case(doc["runs"])
    if case:
        _plot(doc["runs"], "kv_policy", "step_ms",
              lambda r: r["variant"] == "fused" and (r["batch"], r["context"]) == case,
              f"SmolLM2 batch {case[0]} x {case[1]}, fused step", "ms a decode step",
              stem.with_suffix(".png"))


def write_short(stem: Path) -> None:
    doc = artifacts.load(stem)
    stem.with_suffix(".md").write_text(short_markdown(doc))
    if doc["runs"]:
        _plot(doc["runs"], "program", "decode_tokens_s",
              lambda r: "per-operation" not in r["program"],
              "default model, batch 1", "decode tokens/s", stem.with_suffix(".png"))


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
    p.add_argument("--out", default=None,
                   help="the long case's artifact stem: STEM.json gains a run, STEM.md and "
                        "STEM.png sum up every run (default: benchmarks/results/"
                        "infinigen_vs_full)")
    p.add_argument("--short-out", default=None,
                   help="the short case's stem (default: benchmarks/results/"
                        "default_model_vs_llamacpp, or OUT_batch1 when --out is given)")
    p.add_argument("--fresh", action="store_true",
                   help="start the runs list anew instead of appending")
    p.add_argument("--report-only", action="store_true",
                   help="only rewrite the .md and .png from the runs in the JSON")
    a = p.parse_args(argv)
    long_out = Path(a.out).with_suffix("") if a.out else LONG_OUT
    short_out = (Path(a.short_out).with_suffix("") if a.short_out else
                 Path(f"{long_out}_batch1") if a.out else SHORT_OUT)
    if a.report_only:
        for case in a.cases:
            stem = long_out if case == "long" else short_out
            if stem.with_suffix(".json").is_file():
                (write_long if case == "long" else write_short)(stem)
                print(f"wrote {stem}.md, .png")
        return 0
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
    command = ["benchmarks/fused_decode.py", *(sys.argv[1:] if argv is None else argv)]
    for case in a.cases:
        result = (short_case if case == "short" else long_case)(a, a.pause, spent)
        extra = {"machine": machine_info()}
        if case == "long":
            extra["bandwidth_gb_s"] = result["read_bandwidth_bytes_s"] / 1e9
            stem, rows, write = long_out, long_rows(result), write_long
            about = {"benchmark": "fused_decode.py --cases long: SmolLM2 at batch x context, "
                                  "each KV policy's decode step, fused and per-operation"}
        else:
            stem, rows, write = short_out, short_rows(result), write_short
            about = {"benchmark": "fused_decode.py --cases short: the default model at batch "
                                  "1, fused and per-operation, beside llama-bench"}
            extra["same_tokens"] = result["same_tokens"]
        run = {"meta": artifacts.run_meta(command, **extra), "rows": rows,
               "prompt_source": result["prompt_source"]}
        artifacts.append_run(stem, run, fresh=a.fresh, **about)
        write(stem)
        print(f"appended a run to {stem}.json; wrote {stem}.md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
