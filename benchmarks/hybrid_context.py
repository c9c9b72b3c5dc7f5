"""A hybrid's decode against the context, and against llama.cpp on the same file: a layer
cut of Qwen3.5-35B-A3B in its real shapes (three Gated DeltaNet layers to one gated
attention layer, 256 routed experts of 512, 8 a token, and a shared expert), random Q4_K
codes written as llama.cpp's converter writes a ``qwen35moe`` GGUF
(:mod:`random_qwen35_gguf`), read in place by us and by llama.cpp's ``llama-bench``.

A DeltaNet layer reads and replaces a fixed state per row at each step, so its time should
not move with the context; an attention layer reads every cached row, so its time grows
with it. At each context this times our decode steps and each layer kind's token mixing
within them (the engine's own calls, wrapped), and llama-bench's decode after as many
cached tokens, in the same run. Bound: the bytes a step must read (the weights but the
embedding and the unrouted experts, the KV rows, the DeltaNet state read and written) over
the read bandwidth measured before the run.

    python benchmarks/hybrid_context.py --gguf-dir G --contexts 1024 4096 16384 --runs 2 \\
        --llama-bench path/to/llama-bench --out benchmarks/results/hybrid_context --docs

Prints a table (``--json`` for one JSON object). With ``--out STEM`` the run is appended to
STEM.json's ``runs`` (``--fresh`` starts them anew), STEM.md and STEM.png are rewritten
from all of them, and ``--docs`` replaces the section of docs/results.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import artifacts  # noqa: E402
import random_qwen35_gguf as files  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["program", "context"]
HEADING = "## A hybrid's decode against the context"
MODEL = "qwen3.5-35b-a3b"


class MixerClock:
    """Seconds in each layer kind's token mixing during decode passes (the engine's
    ``StageCompute._attention``, which runs a DeltaNet layer's recurrence or attention)."""

    def __init__(self, cfg):
        from flexgen_infinigen.engine.stage_compute import StageCompute

        self.cfg, self.seconds = cfg, {"deltanet": 0.0, "attention": 0.0}
        original = StageCompute._attention
        clock = self

        def timed(compute, block, p, stage, batch, w, h, loaded):
            start = time.perf_counter()
            out = original(compute, block, p, stage, batch, w, h, loaded)
            if p.decode:
                kind = "deltanet" if cfg.is_linear(compute.stages[stage].layer) else "attention"
                clock.seconds[kind] += time.perf_counter() - start
            return out

        StageCompute._attention = timed

    def reset(self):
        self.seconds = {k: 0.0 for k in self.seconds}


def measure(lm, cfg, clock: MixerClock, context: int, steps: int) -> dict:
    torch.manual_seed(context)
    ids = torch.randint(10, cfg.vocab_size - 10, (1, context))
    batches = [(ids, torch.ones_like(ids, dtype=torch.bool))]
    clock.reset()
    times = []
    for i, step in enumerate(lm.engine.generate_block(batches, steps + 1,
                                                      lambda x, s, b: x.argmax(-1))):
        if i > 0:
            times.append(step.seconds)
    linear = len(cfg.linear_layers)
    attention = cfg.num_layers - linear
    step_ms = 1e3 * statistics.median(times)
    per = {k: 1e3 * v / steps for k, v in clock.seconds.items()}
    mean_ms = 1e3 * sum(times) / steps
    return {"program": "flexgen_infinigen", "context": context, "step_ms": step_ms,
            "decode_tokens_s": 1e3 / step_ms,
            "deltanet_layer_ms": per["deltanet"] / linear,
            "attention_layer_ms": per["attention"] / attention,
            "deltanet_share": per["deltanet"] / mean_ms,
            "attention_share": per["attention"] / mean_ms}


COLUMNS = [("decode tok/s", "decode_tokens_s"), ("step ms", "step_ms"),
           ("step / bound", "step_over_bound"), ("x llama.cpp", "x_llama_cpp"),
           ("DeltaNet ms / layer", "deltanet_layer_ms"),
           ("attention ms / layer", "attention_layer_ms"),
           ("DeltaNet share", "deltanet_share"), ("attention share", "attention_share")]


def llama_rows(binary: str, path: Path, contexts: list[int], steps: int, threads: int) -> list:
    """llama-bench's decode at each context, the better of its flash-attention settings."""
    from llama_cpp import llama_bench_rows

    best: dict[int, dict] = {}
    for fa in ("0", "1"):
        for r in llama_bench_rows(binary, str(path), contexts, threads, gen_tokens=steps,
                                  prefill_tokens=0, model_label=path.name, extra=("-fa", fa)):
            row = {"program": "llama.cpp", "context": r["context"], "error": r["error"]} \
                if "error" in r else \
                {"program": "llama.cpp", "context": r["context"], "flash_attention": fa == "1",
                 "decode_tokens_s": r["decode_tokens_s"], "step_ms": 1e3 * r["decode_step_s"],
                 "command": r["command"]}
            had = best.get(r["context"])
            if had is None or row.get("decode_tokens_s", 0) > had.get("decode_tokens_s", 0):
                best[r["context"]] = row
    return [best[c] for c in contexts]


def with_bounds(rows: list[dict], layers: int, bandwidth: float) -> list[dict]:
    """Each row's step over its bound, and ours over llama.cpp's rate at its context."""
    weights = files.describe(MODEL, layers)["decode_read_bytes_batch_1"]
    theirs = {r["context"]: r.get("decode_tokens_s") for r in rows
              if r["program"] == "llama.cpp"}
    for r in rows:
        if "step_ms" not in r:
            continue
        bound = (weights + files.state_read_bytes(MODEL, layers, r["context"])) / bandwidth
        r["bound_ms"] = 1e3 * bound
        r["step_over_bound"] = r["step_ms"] / r["bound_ms"]
        if r["program"] != "llama.cpp" and theirs.get(r["context"]):
            r["x_llama_cpp"] = r["decode_tokens_s"] / theirs[r["context"]]
    return rows


def report(doc: dict, out: Path) -> str:
    runs = doc["runs"]
    table = artifacts.table(runs, KEYS, COLUMNS, fmt="{:.3g}")
    out.with_suffix(".md").write_text(f"# {HEADING[3:]}\n\n{artifacts.meta_line(runs)}\n\n"
                                      f"{table}\n")
    plt = artifacts.pyplot()
    if plt is None:
        return table
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    rows = [r for run in runs for r in run["rows"] if r["program"] == "flexgen_infinigen"]
    contexts = sorted({r["context"] for r in rows})
    for key, label in (("deltanet_layer_ms", "a DeltaNet layer"),
                       ("attention_layer_ms", "an attention layer")):
        med = [statistics.median(r[key] for r in rows if r["context"] == c) for c in contexts]
        lo = [m - min(r[key] for r in rows if r["context"] == c) for m, c in zip(med, contexts)]
        hi = [max(r[key] for r in rows if r["context"] == c) - m for m, c in zip(med, contexts)]
        ax.errorbar(contexts, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms a decode step (median, min-max)")
    ax.set_title("token mixing a layer, Qwen3.5-35B-A3B shapes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)
    return table


def shown_command(a) -> str:
    """The run's command as the results page shows it: no local folders."""
    return ("python benchmarks/hybrid_context.py --gguf-dir G --contexts "
            + " ".join(map(str, a.contexts)) + f" --steps {a.steps} --runs {a.runs}"
            + (" --llama-bench path/to/llama-bench" if a.llama_bench else "")
            + " --out benchmarks/results/hybrid_context --fresh --docs")


def write_docs(doc: dict, table: str, out: Path, results_md: Path) -> None:
    """Replace this benchmark's section of ``results_md`` (heading to the next ``## ``), or
    add it at the end, in the page's form: machine, bandwidth, dates and commits, links, the
    command, the table, what the rows are."""
    runs = doc["runs"]
    rel = Path("..") / (out.relative_to(ROOT) if out.is_absolute() else out)

    def each(field):
        return ", ".join(dict.fromkeys(str(r["meta"].get(field)) for r in runs))
    bandwidths = [r["meta"]["read_bandwidth_gb_s"] for r in runs]
    links = ",\n".join(f"[{ext}]({rel.with_suffix('.' + ext)})" for ext in ("json", "md", "png"))
    command = runs[-1]["meta"]["shown"]
    if len(command) > 100:  # the page's width: the rest on a continued line
        cut = command.rindex(" --", 0, 100)
        command = command[:cut] + " \\\n   " + command[cut:]
    section = (f"{HEADING}\n{each('cpu')}, {each('cores')} cores; read bandwidth "
               f"{min(bandwidths):.1f}–{max(bandwidths):.1f} GB/s; {each('date')}, "
               f"`{each('commit')}`; {len(runs)} runs;\n{links}.\n"
               f"```bash\n{command}\n```\n{table.rstrip()}\n\n"
               f"A cut of {runs[-1]['meta']['layers']} of 40 layers, random Q4_K codes, one file "
               "for both programs; 2 threads;\nllama.cpp's better flash-attention setting; "
               "shares: each layer kind's token mixing over the step.\n")
    page = results_md.read_text()
    old = next((h for h in (HEADING, "## A hybrid's decode step against the context")
                if h in page), None)
    if old:
        start = page.index(old)
        end = page.find("\n## ", start + len(old))
        page = page[:start] + section + ("" if end < 0 else "\n" + page[end + 1:])
    else:
        page = page.rstrip("\n") + "\n\n" + section
    results_md.write_text(page)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf-dir", type=Path, required=True,
                   help="where the cut's GGUF is (written there when missing)")
    p.add_argument("--layers", type=int, default=4, help="the cut's layers (every fourth is "
                   "attention; default 4)")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--steps", type=int, default=8, help="decode steps timed at each context")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="llama-bench's threads")
    p.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--docs", nargs="?", const=str(ROOT / "docs" / "results.md"), default=None)
    a = p.parse_args()
    if a.layers < 4:
        p.error("--layers must be 4 or more (every fourth layer is the attention layer)")
    if a.llama_bench:  # one error before any long work
        from gguf_sizes_llama import check_binary
        a.llama_bench = check_binary("--llama-bench", a.llama_bench)
    from long_context import read_bandwidth

    from flexgen_infinigen import OffloadedLM, Placement

    path = a.gguf_dir / files.file_name(MODEL, a.layers)
    if not path.is_file():
        a.gguf_dir.mkdir(parents=True, exist_ok=True)
        files.write_gguf(MODEL, path, a.layers)
    doc, clock = None, None
    for run in range(a.runs):
        bandwidth = read_bandwidth(1 << 30)
        rows = []
        with OffloadedLM.load(model=str(path), policy=Placement(), progress=False,
                              max_len_hint=(max(a.contexts), a.steps + 1)) as lm:
            clock = clock or MixerClock(lm.cfg)  # wraps the engine's call once
            for context in a.contexts:
                rows.append(measure(lm, lm.cfg, clock, context, a.steps))
        if a.llama_bench:
            rows += llama_rows(a.llama_bench, path, a.contexts, a.steps, a.threads)
        rows = with_bounds(rows, a.layers, bandwidth)
        for r in rows:
            if not a.json:
                print(f"run {run} {r['program']} context {r['context']}: "
                      + (r.get("error") or f"{r['decode_tokens_s']:.2f} tok/s, "
                         f"step/bound {r['step_over_bound']:.2f}"), flush=True)
        if a.out is not None:
            meta = artifacts.run_meta(model=MODEL, layers=a.layers, steps=a.steps,
                                      read_bandwidth_gb_s=bandwidth / 1e9, gguf=path.name,
                                      shown=shown_command(a))
            doc = artifacts.append_run(a.out, {"meta": meta, "rows": rows},
                                       fresh=a.fresh and run == 0,
                                       benchmark=__doc__.splitlines()[0])
        elif a.json:
            print(json.dumps({"run": run, "rows": rows}))
    if doc is not None:
        table = report(doc, a.out)
        if a.json:
            print(json.dumps(doc))
        if a.docs:
            write_docs(doc, table, a.out, Path(a.docs))


if __name__ == "__main__":
    main()
