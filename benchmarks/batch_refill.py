"""``batch`` on a file of mixed answer lengths: rows refilled as answers end (the default)
against blocks run to their longest answer (``--no-refill``, the command before refilling).

The file: ``--prompts`` chat prompts to ``--model`` (default SmolLM2-135M-Instruct, its GGUF
codes), each with a ``gen_len`` drawn from ``--lengths``; an instruct model's answers also
end at its end token, at their own lengths. Both modes run the same file,
alternately, ``--runs`` times; every output line must be equal between them (temperature 0),
and the throughput is generated tokens over the command's wall time (each run a process of
its own, as a user runs it; loading included, the same for both).

    python benchmarks/batch_refill.py --runs 3
    python benchmarks/batch_refill.py --runs 3 --model path/to/qwen2.5-coder-0.5b-instruct.gguf

Appends each run to benchmarks/results/batch_refill.json (``--fresh`` starts anew) and
rewrites batch_refill.md and .png from all of them.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import artifacts  # noqa: E402

OUT = HERE / "results" / "batch_refill"
TOPICS = ["the moon", "bread", "a bicycle", "the ocean", "chess", "volcanoes", "a library",
          "coffee", "rain", "the piano", "bees", "a lighthouse", "trains", "maps", "snow",
          "gardens"]
ASKS = ["Say one word about {}.", "Write a short poem about {}.", "Explain {} to a child.",
        "List three facts about {}.", "Tell a long story about {}."]


def job_file(path: Path, prompts: int, lengths: list[int], seed: int) -> None:
    rng = random.Random(seed)
    lines = [{"id": f"p{i}", "prompt": rng.choice(ASKS).format(rng.choice(TOPICS)),
              "gen_len": rng.choice(lengths)} for i in range(prompts)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def run_mode(a, src: Path, mode: str, folder: Path) -> tuple[dict, dict]:
    out = folder / f"{mode}.jsonl"
    out.unlink(missing_ok=True)
    args = ["--input", str(src), "--output", str(out), "--gpu-batch-size", str(a.rows),
            "--threads", str(a.threads), mode]
    if a.model:
        args = ["--model", str(a.model), *args]
    start = time.perf_counter()  # a process of its own, as a user runs it
    done = subprocess.run([sys.executable, "-m", "flexgen_infinigen.batch", *args],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"batch {mode} failed: {done.stderr[-2000:]}")
    lines = {x["id"]: x for x in map(json.loads, out.read_text().splitlines())}
    tokens = sum(len(x["token_ids"]) for x in lines.values())
    return {"mode": "refill" if mode == "--refill" else "blocks", "wall_s": wall,
            "tokens": tokens, "tokens_per_s": tokens / wall}, lines


def markdown(doc: dict) -> str:
    s = doc["settings"]
    return (artifacts.table(doc["runs"], ["model", "prompts", "mode"], [
        ("wall s", "wall_s"), ("generated tokens", "tokens", "{:.0f}"),
        ("tokens/s", "tokens_per_s"), ("x blocks", "speedup"),
        ("lines equal", "equal", "{:.0f}")]) + "\n"
        + f"Chat prompts, gen_len from {s['lengths']}, {s['rows']} rows a block, "
        f"{s['threads']} threads. {artifacts.meta_line(doc['runs'])}\n")


def plot(doc: dict, path: Path) -> None:
    plt = artifacts.pyplot()
    if plt is None:
        return
    groups = artifacts.grouped(doc["runs"], ["model", "mode"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, rows in enumerate(groups.values()):
        ys = [r["tokens_per_s"] for r in rows]
        ax.scatter([i] * len(ys), ys)
        ax.bar([i], [sorted(ys)[len(ys) // 2]], 0.5, alpha=0.4)
    ax.set_xticks(range(len(groups)), [f"{m}\n{mode}" for m, mode in groups], fontsize=7)
    ax.set_ylabel("generated tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a GGUF file or a model name (default: the embedded default model)")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args()
    settings = {"prompts": a.prompts, "lengths": a.lengths, "rows": a.rows,
                "threads": a.threads,
                "model": Path(a.model).name if a.model else "SmolLM2-135M-Instruct"}
    doc = artifacts.load(a.out)
    fresh = a.fresh
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        src = folder / "in.jsonl"
        job_file(src, a.prompts, a.lengths, a.seed)
        for i in range(0 if a.report_only else a.runs):
            order = ["--refill", "--no-refill"] if i % 2 == 0 else ["--no-refill", "--refill"]
            got = {}
            for mode in order:
                row, lines = run_mode(a, src, mode, folder)
                got[row["mode"]] = (row, lines)
            (refill, mine), (blocks, theirs) = got["refill"], got["blocks"]
            rows = [refill, blocks]
            for r in rows:
                r["model"], r["prompts"] = settings["model"], a.prompts
            equal = sum(mine[k] == theirs.get(k) for k in mine)
            refill["speedup"] = refill["tokens_per_s"] / blocks["tokens_per_s"]
            for r in rows:
                r["equal"] = equal
            doc = artifacts.append_run(a.out, {"rows": rows}, fresh, settings=settings)
            fresh = False
    artifacts.write_report(a.out, doc, settings, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
