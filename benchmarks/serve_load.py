"""The OpenAI-compatible server under load, against ``batch``'s generation of the same prompts.

1. 16 concurrent streaming clients at temperature 0, in rounds that alternate with the
   library's generation of the same 16 prompts as one block (what the ``batch`` command runs):
   - every answer must equal the one the server gives the same prompt alone;
   - aggregate decode tokens/s (tokens after each client's first, over the span from the
     first first-token to the last token) against ``generate``'s decode tokens/s (goal >= 90%);
   - time to first token against one prefill of the block plus ``--max-wait-ms`` (goal: at
     most 110%); and a lone request's against a batch-1 prefill plus the wait.
2. A load test: ``--requests`` requests from 16 clients, a random quarter of which disconnect
   after a few chunks; none may be lost (the server's finished + cancelled counters add up to
   the requests, every client that stayed got one complete answer) or answered twice, and
   the server's RSS after it is compared with its RSS before.
3. ``--sweep``: block size and ``--max-wait-ms`` against first-token latency and throughput
   (16 clients arriving together, and one alone), one server per setting.

    python benchmarks/serve_load.py --quick      # short settings for a busy machine

Appends the run to benchmarks/results/serve_load.json's ``runs`` (``--fresh`` starts them
anew) and rewrites serve_load.md (median, min-max over every round and run) and .png from all
of them; ``--report-only`` only rewrites those two.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import artifacts  # noqa: E402
from machine import machine_info  # noqa: E402

from flexgen_infinigen import OffloadedLM, Placement  # noqa: E402

OUT = HERE / "results" / "serve_load"
MODEL = "smollm2-135m"
STARTS = ["The capital of France is", "Once upon a time there was", "My favourite food is",
          "The best way to learn to code is", "Water boils at", "In 1969, the first",
          "The three primary colours are", "A good night's sleep", "The history of the bicycle",
          "Photosynthesis is the process", "The largest ocean on Earth", "To bake bread you",
          "The rules of chess say", "Jupiter is a planet that", "A healthy breakfast has",
          "The internet was invented"]


# ---- a server in a subprocess -----------------------------------------------------------------
def start_server(block: tuple[int, int], wait_ms: float, *args: str
                 ) -> tuple[subprocess.Popen, str]:
    """``serve`` in a subprocess with blocks of ``block`` rows and ``--max-wait-ms``
    ``wait_ms`` (``args``: more flags); (the process, its URL) once it answers."""

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "flexgen_infinigen.serve", "--port",
                             str(port), "--gpu-batch-size", str(block[0]), "--num-gpu-batches",
                             str(block[1]), "--max-wait-ms", str(wait_ms), "--max-queue", "1000",
                             *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(3000):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not come up")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    return proc.returncode


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"flexgen_infinigen_{name} "):
            return float(line.split()[-1])
    raise KeyError(name)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---- clients ----------------------------------------------------------------------------------
def stream_one(url: str, prompt: str, max_tokens: int, out: dict, start):
    """One streaming completion: send time, each chunk's arrival time, the text."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=600) as http:
        http.get(f"{url}/health")  # the connection is open before the start
        start.wait()  # every client sends at once
        sent, times, pieces, usage = time.perf_counter(), [], [], None
        with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            lines = list(_timed_lines(r))
    for t, line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        if chunk["choices"] and chunk["choices"][0]["text"]:
            times.append(t)
            pieces.append(chunk["choices"][0]["text"])
    out.update(sent=sent, times=times, text="".join(pieces),
               tokens=usage["completion_tokens"] if usage else len(times))


def _timed_lines(response):
    for line in response.iter_lines():
        yield time.perf_counter(), line


def concurrent_round(url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    results = [{} for _ in prompts]
    go = threading.Barrier(len(prompts))
    threads = [threading.Thread(target=stream_one, args=(url, p, max_tokens, r, go))
               for p, r in zip(prompts, results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def in_thread(fn, *args, **kwargs):
    """``fn``'s result, computed in a worker thread as the server's engine thread computes:
    on a machine whose cores other processes keep busy, torch's intra-op threads ran many
    times slower called from the main thread than from another thread (a plain matmul shows
    it), which would compare the server with a handicapped reference."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)))
    t.start()
    t.join()
    return out[0]


def summarize(results: list[dict]) -> dict:
    first = min(r["times"][0] for r in results)
    last = max(r["times"][-1] for r in results)
    decoded = sum(r["tokens"] - 1 for r in results)
    ttft = [r["times"][0] - r["sent"] for r in results]
    return {"decode_tokens": decoded, "decode_s": last - first,
            "decode_tokens_per_s": decoded / (last - first) if last > first else float("nan"),
            "ttft_max_s": max(ttft), "ttft_mean_s": sum(ttft) / len(ttft),
            "latency_max_s": max(r["times"][-1] - r["sent"] for r in results)}


async def load_test(url: str, n: int, max_tokens: int, seed: int) -> dict:
    """``n`` streamed requests from 16 clients; a random quarter hang up after a few chunks."""
    rng = random.Random(seed)
    plan = [(STARTS[i % len(STARTS)], rng.randint(1, max_tokens),
             rng.randint(1, 3) if rng.random() < 0.25 else None) for i in range(n)]
    todo = list(enumerate(plan))
    outcome: dict[int, dict] = {}

    async def client(http: httpx.AsyncClient):
        while todo:
            i, (prompt, tokens, hang_up_after) = todo.pop()
            body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                    "stream": True}
            got = {"chunks": 0, "finish": [], "done": 0, "ids": set(), "hung_up": False}
            async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        got["done"] += 1
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        got["ids"].add(chunk["id"])
                        got["chunks"] += 1
                        if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                            got["finish"].append(chunk["choices"][0]["finish_reason"])
                    if hang_up_after is not None and got["chunks"] >= hang_up_after \
                            and not got["done"]:
                        got["hung_up"] = True
                        break  # leaving the block closes the connection
            outcome[i] = got

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(16)))
    stayed = [o for o in outcome.values() if not o["hung_up"]]
    ids = [next(iter(o["ids"])) for o in outcome.values() if o["ids"]]
    return {"requests": n, "answered": len(outcome),
            "hung_up": sum(o["hung_up"] for o in outcome.values()),
            "stayed_complete": sum(len(o["finish"]) == 1 and o["done"] == 1 for o in stayed),
            "stayed": len(stayed), "one_id_per_answer": all(len(o["ids"]) == 1
                                                            for o in outcome.values()),
            "answer_ids_unique": len(ids) == len(set(ids))}


# ---- the parts --------------------------------------------------------------------------------
def part_concurrent(a, lm) -> dict:
    proc, url = start_server(tuple(a.block), a.max_wait_ms)
    prompts = STARTS[:16]
    try:
        concurrent_round(url, prompts[:4], 2)  # warm-up
        alone = {}
        for p in prompts:
            out = {}
            stream_one(url, p, a.gen_len, out, threading.Barrier(1))
            alone[p] = out
        in_thread(lm.generate, prompts, 2)  # warm-up, both shapes
        in_thread(lm.generate, prompts[:1], 2)
        rounds = []
        for _ in range(a.rounds):  # alternate server and library, one after the other
            blocks = metric(url, "blocks_total")
            served = concurrent_round(url, prompts, a.gen_len)
            blocks = metric(url, "blocks_total") - blocks
            gen = in_thread(lm.generate, prompts, a.gen_len)
            rounds.append({"server": summarize(served), "server_blocks": blocks,
                           "batch": {"decode_tokens_per_s": gen.decode_tokens
                                     / gen.decode_latency_s,
                                     "prefill_s": gen.prefill_latency_s,
                                     "steps": gen.generated_tokens},
                           "equal_to_alone": sum(s["text"] == alone[p]["text"]
                                                 for s, p in zip(served, prompts))})
        lone = in_thread(lm.generate, prompts[:1], a.gen_len)
        rss_before = rss_mb(proc.pid)
        cancelled0 = metric(url, "requests_cancelled_total")
        finished0 = metric(url, "requests_finished_total")
        load = asyncio.run(load_test(url, a.requests, a.gen_len, a.seed))
        deadline = time.monotonic() + 120
        while metric(url, "running_rows") or metric(url, "queue_depth"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        load["server_finished"] = metric(url, "requests_finished_total") - finished0
        load["server_cancelled"] = metric(url, "requests_cancelled_total") - cancelled0
        load["none_lost"] = load["server_finished"] + load["server_cancelled"] == a.requests \
            and load["stayed_complete"] == load["stayed"] and load["answered"] == a.requests
        load["none_twice"] = load["one_id_per_answer"] and load["answer_ids_unique"]
        load["rss_before_mb"], load["rss_after_mb"] = rss_before, rss_mb(proc.pid)
        load["rss_ratio"] = load["rss_after_mb"] / rss_before
        lone_served = {}
        time.sleep(a.max_wait_ms / 1000)
        stream_one(url, prompts[0], a.gen_len, lone_served, threading.Barrier(1))
    finally:
        code = stop_server(proc)
    ratios = [r["server"]["decode_tokens_per_s"] / r["batch"]["decode_tokens_per_s"]
              for r in rounds]
    ttft = [r["server"]["ttft_max_s"] / (r["batch"]["prefill_s"] + a.max_wait_ms / 1000)
            for r in rounds]
    lone_ttft = lone_served["times"][0] - lone_served["sent"]
    return {"rounds": rounds, "decode_ratio": ratios, "ttft_ratio": ttft,
            "all_equal_to_alone": all(r["equal_to_alone"] == 16 for r in rounds),
            "lone": {"ttft_s": lone_ttft, "prefill_s": lone.prefill_latency_s,
                     "ttft_ratio": lone_ttft / (lone.prefill_latency_s + a.max_wait_ms / 1000)},
            "load_test": load, "server_exit_code": code}


def part_sweep(a) -> list[dict]:
    rows = []
    for b, n, wait in a.sweep:
        proc, url = start_server((b, n), wait)
        try:
            concurrent_round(url, STARTS[:2], 2)  # warm-up
            blocks, rows0 = metric(url, "blocks_total"), metric(url, "block_rows_total")
            together = summarize(concurrent_round(url, STARTS[:16], a.gen_len))
            blocks = metric(url, "blocks_total") - blocks
            fill = (metric(url, "block_rows_total") - rows0) / blocks / (b * n)
            time.sleep(0.5)
            lone = concurrent_round(url, STARTS[:1], a.gen_len)[0]
        finally:
            stop_server(proc)
        rows.append({"gpu_batch_size": b, "num_gpu_batches": n, "max_wait_ms": wait,
                     **together, "lone_ttft_s": lone["times"][0] - lone["sent"],
                     "blocks": blocks, "mean_block_fill": fill})
    return rows


def rows_of(run: dict) -> list[dict]:
    """The table's rows of one run: one per round of the 16 clients, the lone request, and
    each setting of the sweep (16 clients, then one alone)."""
    st, c = run["settings"], run["concurrent"]
    block, wait, tokens = f"{st['block'][0]} x {st['block'][1]}", st["max_wait_ms"], st["gen_len"]
    rows = []
    for x, ratio, tt in zip(c["rounds"], c["decode_ratio"], c["ttft_ratio"]):
        rows.append({"clients": 16, "block": block, "max_wait_ms": wait, "tokens": tokens,
                     "server_decode_tok_s": x["server"]["decode_tokens_per_s"],
                     "batch_decode_tok_s": x["batch"]["decode_tokens_per_s"],
                     "server_over_batch": ratio, "ttft_max_s": x["server"]["ttft_max_s"],
                     "ttft_over_prefill_wait": tt,
                     "latency_max_s": x["server"]["latency_max_s"],
                     "equal_to_alone": x["equal_to_alone"], "blocks": x["server_blocks"],
                     "block_fill": 16 / (x["server_blocks"] * st["block"][0] * st["block"][1])
                     if x["server_blocks"] else None})
    rows.append({"clients": 1, "block": block, "max_wait_ms": wait, "tokens": tokens,
                 "ttft_max_s": c["lone"]["ttft_s"],
                 "ttft_over_prefill_wait": c["lone"]["ttft_ratio"]})
    for s in run.get("sweep") or []:
        key = {"block": f"{s['gpu_batch_size']} x {s['num_gpu_batches']}",
               "max_wait_ms": s["max_wait_ms"], "tokens": tokens}
        rows.append({"clients": 16, **key, "server_decode_tok_s": s["decode_tokens_per_s"],
                     "ttft_max_s": s["ttft_max_s"], "latency_max_s": s["latency_max_s"],
                     "blocks": s["blocks"], "block_fill": s["mean_block_fill"]})
        rows.append({"clients": 1, **key, "ttft_max_s": s["lone_ttft_s"]})
    return rows


KEYS = ["clients", "block", "max_wait_ms", "tokens"]
COLUMNS = [("server decode tok/s", "server_decode_tok_s", "{:.1f}"),
           ("`batch` decode tok/s", "batch_decode_tok_s", "{:.1f}"),
           ("server / batch", "server_over_batch", "{:.2f}"),
           ("max first token s", "ttft_max_s", "{:.2f}"),
           ("first token / (prefill + wait)", "ttft_over_prefill_wait", "{:.2f}"),
           ("max latency s", "latency_max_s", "{:.2f}"),
           ("answers equal to alone", "equal_to_alone", "{:.0f}"),
           ("blocks", "blocks", "{:.0f}"),
           ("block fill", "block_fill", "{:.2f}")]


def table(runs: list[dict]) -> str:
    """``artifacts.table`` with a format per column."""
    lines = ["| clients | block | max wait ms | tokens | "
             + " | ".join(h for h, _, _ in COLUMNS) + " |",
             "|" + "---|" * (len(KEYS) + len(COLUMNS))]
    for key, rows in artifacts.grouped(runs, KEYS).items():
        cells = [f"{k:g}" if isinstance(k, float) else str(k) for k in key]
        cells += [artifacts.spread((r.get(f) for r in rows), fmt) for _, f, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(doc: dict) -> str:
    runs = doc["runs"]
    lines = ["# Serving under load", "", artifacts.meta_line(runs), "",
             "SmolLM2-135M, streaming clients at temperature 0. Each cell: median (min-max, N), "
             "N counting every round of every run. `batch`: the library's generation of the "
             "same 16 prompts as one block, alternated with the server's rounds; first token / "
             "(prefill + wait): the slowest first token over that block's prefill (one "
             "prompt's for a lone request) plus `--max-wait-ms`.", "", table(runs),
             "## Load test", "",
             "| date | commit | requests | hung up | lost | answered twice | server finished "
             "+ cancelled | RSS MB before | after |", "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        t = run["concurrent"]["load_test"]
        lines.append(f"| {run['meta'].get('date')} | {run['meta'].get('commit')} | "
                     f"{t['requests']} | {t['hung_up']} | {'none' if t['none_lost'] else 'some'}"
                     f" | {'none' if t['none_twice'] else 'some'} | "
                     f"{t['server_finished']:.0f} + {t['server_cancelled']:.0f} | "
                     f"{t['rss_before_mb']:.0f} | {t['rss_after_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    plt = artifacts.pyplot()
    if plt is None:
        return
    import statistics

    groups = artifacts.grouped(doc["runs"], KEYS)

    def med(rows, field):
        xs = [r[field] for r in rows if r.get(field) is not None]
        return statistics.median(xs) if xs else None

    both = {k: g for k, g in groups.items() if med(g, "batch_decode_tok_s") is not None}
    sweep = {k: g for k, g in groups.items() if k[0] == 16 and med(g, "server_decode_tok_s")}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for i, g in enumerate(both.values()):
        for dx, field, label, color in ((-0.2, "server_decode_tok_s", "server, 16 clients",
                                         "tab:blue"),
                                        (0.2, "batch_decode_tok_s", "`batch`, the same block",
                                         "tab:orange")):
            xs = [r[field] for r in g if r.get(field) is not None]
            m = statistics.median(xs)
            ax.bar(i + dx, m, 0.4, color=color, label=label if i == 0 else None,
                   yerr=[[m - min(xs)], [max(xs) - m]], capsize=3)
    ax.set_xticks(range(len(both)), [f"{k[1]}, wait {k[2]:g} ms" for k in both])
    ax.set_xlim(-0.8, len(both) - 0.2)
    ax.set_ylabel("decode tokens/s (median, min-max)")
    ax.legend()
    ax = axes[1]
    for j, (k, g) in enumerate(sweep.items()):
        x, y = med(g, "ttft_max_s"), med(g, "server_decode_tok_s")
        ax.scatter(x, y, color="tab:blue")
        ax.annotate(f"{k[1]}, {k[2]:g} ms", (x, y), textcoords="offset points",
                    xytext=(6, -12 if j % 2 else 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("max time to first token, 16 clients (s)")
    ax.set_ylabel("aggregate decode tokens/s")
    fig.suptitle(f"serving, {len(doc['runs'])} run(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(doc: dict, out: Path) -> None:
    out.with_suffix(".md").write_text(markdown(doc))
    plot(doc, out.with_suffix(".png"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="short generations, 2 rounds, a small sweep")
    p.add_argument("--block", type=int, nargs=2, default=[8, 2], metavar=("B", "N"))
    p.add_argument("--max-wait-ms", type=float, default=50.0)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--out", type=Path, default=OUT,
                   help="STEM: this run is appended to STEM.json's runs; STEM.md and STEM.png "
                        "are rewritten from all of them")
    p.add_argument("--fresh", action="store_true", help="start STEM.json's runs anew")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: rewrite STEM.md and STEM.png from STEM.json")
    a = p.parse_args()
    out = a.out.with_suffix("") if a.out.suffix == ".json" else a.out
    if a.report_only:
        write_outputs(artifacts.load(out), out)
        print(out.with_suffix(".md").read_text())
        return 0
    if a.quick:
        a.gen_len, a.rounds = 12, 2
    a.sweep = [] if a.no_sweep else [(1, 1, 0), (8, 2, 0), (8, 2, 50), (8, 2, 500)]
    lm = OffloadedLM.load(model=MODEL, progress=False,
                          policy=Placement(gpu_batch_size=a.block[0], num_gpu_batches=a.block[1]))
    run = {"meta": artifacts.run_meta(["benchmarks/serve_load.py", *sys.argv[1:]],
                                      machine_info=machine_info()),
           "settings": {"model": MODEL, "block": list(a.block), "max_wait_ms": a.max_wait_ms,
                        "gen_len": a.gen_len, "rounds": a.rounds, "requests": a.requests}}
    with lm:
        run["concurrent"] = part_concurrent(a, lm)
    run["sweep"] = part_sweep(a)
    run["rows"] = rows_of(run)
    doc = artifacts.append_run(out, run, fresh=a.fresh, benchmark=__doc__.split("\n")[0])
    write_outputs(doc, out)
    print(out.with_suffix(".md").read_text())
    return 0

if __name__ == "__main__":
    sys.exit(main())
