"""Long chats, where InfiniGen counts: concurrent users with long histories, this runtime's
server (InfiniGen by default) against llama-server, both with prefix reuse, one GGUF, one run.

``--users`` users each open a chat with a text of about ``--history`` tokens (turn 1: the
whole history is prefilled, cold), then chat ``--turns`` more turns at once: every turn sends
the whole conversation (the answers as the server gave them) plus a new message of about
``--turn-tokens`` tokens, so each server finds the history in its prompt cache and prefills
only the new part. For each later turn, with every user's request running together:

* **decode tokens/s**: answer tokens after each first token, over the time during which at
  least one answer streams (the union of each answer's first-to-last-token span): the rate the
  server gives its users together, stalls for other users' prefills included (goal: at least
  2x llama-server's);
* time to first token (cold turn 1, and the later turns), and the share of the later turns'
  prompts the server reports as cached.

llama-server runs with ``-np`` as many slots as users and its prompt cache on (each user's
slot keeps the history); this runtime with ``--prefix-cache-gb`` large enough to hold every
history (``--ours-args`` adds flags, e.g. ``--kv-policy full`` for the full cache). Texts come
from ``--text`` (WikiText-2 in ``../shared/data``), seeded: both servers get the same chats.
Temperature 0.

    python benchmarks/long_chats.py --gguf path/to/qwen2.5-coder-0.5b-instruct.gguf \\
        --llama-server path/to/llama-server --runs 3

Appends each run to benchmarks/results/long_chats.json (``--fresh`` starts anew) and
rewrites long_chats.md and .png from all of them.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import artifacts  # noqa: E402
import chat_serving as cs  # noqa: E402

OUT = HERE / "results" / "long_chats"


def one_turn(url: str, conversations: list[list[dict]], answer: int) -> list[dict]:
    """Every user's request at once; their results, in user order."""
    out: list[dict] = [{}] * len(conversations)

    def user(u: int):
        # every answer its full length on both servers (the same work to compare)
        out[u] = cs.chat(url, conversations[u], answer, extra={"ignore_eos": True})

    threads = [threading.Thread(target=user, args=(u,)) for u in range(len(conversations))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def decode_rate(results: list[dict]) -> float:
    """Answer tokens after each first token a second, over the union of the answers'
    first-to-last-token spans (a stall while another user's prompt is prefilled counts; time
    when no answer streams does not)."""
    spans, tokens = [], 0
    for r in results:
        if r["ttft"] is None or not r["gaps"]:
            continue
        first = r["t0"] + r["ttft"]
        spans.append((first, first + sum(r["gaps"])))
        tokens += max(len(r["gaps"]), r["completion_tokens"] - 1)  # a chunk may hold more
    covered, end = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        covered += max(0.0, hi - max(lo, end))
        end = max(end, hi)
    return tokens / covered if covered > 0 else float("nan")


def run_once(a, which: str) -> dict:
    proc, url = cs.start(which, a)
    try:
        texts = cs.Texts(a.text, a.seed)
        talks = [[{"role": "system", "content": cs.SYSTEM},
                  {"role": "user", "content": "Summarize this text: " + texts.piece(a.history)}]
                 for _ in range(a.users)]
        follow = [[texts.piece(a.turn_tokens) for _ in range(a.turns)] for _ in range(a.users)]
        started = time.perf_counter()
        cold = one_turn(url, talks, a.first_answer)
        cold_wall = time.perf_counter() - started
        rates, warm, cached, texts_out, prompts = [], [], [], [], []
        results = cold
        for t in range(a.turns):
            for u, got in enumerate(results):
                talks[u] = talks[u] + [{"role": "assistant", "content": got["text"]},
                                       {"role": "user", "content": "And this one: "
                                        + follow[u][t]}]
            results = one_turn(url, talks, a.answer_tokens)
            rates.append(decode_rate(results))
            warm += [r["ttft"] for r in results]
            cached += [r["cached_tokens"] / max(1, r["prompt_tokens"]) for r in results]
            prompts += [r["prompt_tokens"] for r in results]
            texts_out.append([r["text"] for r in results])
        return {"decode_tokens_per_s": statistics.median(rates),
                "cold_ttft_s": statistics.median(r["ttft"] for r in cold),
                "cold_wall_s": cold_wall,
                "later_ttft_s": statistics.median(warm),
                "later_cached_share": statistics.median(cached),
                "longest_prompt_tokens": max(prompts), "answers": texts_out}
    finally:
        cs.stop(proc)


NAMES = {"ours": "flexgen_infinigen", "llama": "llama-server"}
COLUMNS = [("decode tok/s (all users)", "decode_tokens_per_s"),
           ("turn 1 first token s", "cold_ttft_s"),
           ("later turns first token s", "later_ttft_s"),
           ("later turns' prompt cached", "later_cached_share"),
           ("longest prompt", "longest_prompt_tokens")]
RATIO = "ours / llama-server"


def with_ratio(rows: list[dict]) -> list[dict]:
    by = {r["program"]: r for r in rows}
    if set(by) != set(NAMES.values()):
        return rows
    ours, theirs = by[NAMES["ours"]], by[NAMES["llama"]]  # each run's own pair
    return rows + [{"program": RATIO, **{f: ours[f] / theirs[f] for _, f in COLUMNS[:3]
                                         if ours.get(f) and theirs.get(f)}}]


def markdown(doc: dict) -> str:
    s = doc["settings"]
    return (artifacts.table(doc["runs"], ["program"], COLUMNS) + "\n"
            + f"{s['gguf']}; {s['users']} users at once, histories of ~{s['history']} "
            f"tokens, then {s['turns']} turns of ~{s['turn_tokens']} new tokens and "
            f"{s['answer_tokens']}-token answers; llama-server -np {s['users']} with its prompt "
            f"cache; ours: {s['ours_args'] or 'defaults'}. {artifacts.meta_line(doc['runs'])}\n")


def plot(doc: dict, path: Path) -> None:
    plt = artifacts.pyplot()
    if plt is None:
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    groups = artifacts.grouped(doc["runs"], ["program"], lambda r: r["program"] != RATIO)
    names = [k[0] for k in groups]
    ax.bar(names, [statistics.median(r["decode_tokens_per_s"] for r in rows)
                   for rows in groups.values()])
    ax.set_ylabel("decode tokens/s, all users (median)")
    for i, key in enumerate(["cold_ttft_s", "later_ttft_s"]):
        bx.bar([x + 0.4 * i for x in range(len(names))],
               [statistics.median(r[key] for r in rows) for rows in groups.values()], 0.4,
               label={"cold_ttft_s": "turn 1", "later_ttft_s": "later turns"}[key])
    bx.set_xticks([x + 0.2 for x in range(len(names))], names)
    bx.set_ylabel("time to first token, s (median)")
    bx.set_yscale("log")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--llama-server", type=Path, default=None,
                   help="llama-server's binary (without it: this runtime alone)")
    p.add_argument("--text", type=Path, default=cs.SHARED_TEXT)
    p.add_argument("--users", type=int, default=4, help="also block rows and llama's -np")
    p.add_argument("--history", type=int, default=16000, help="turn 1's text, ~tokens")
    p.add_argument("--turns", type=int, default=2, help="measured turns after turn 1")
    p.add_argument("--turn-tokens", type=int, default=200)
    p.add_argument("--first-answer", type=int, default=16)
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--flash-attn", default="auto", choices=["on", "off", "auto"])
    p.add_argument("--prefix-cache-gb", type=float, default=8.0)
    p.add_argument("--ours-args", default="--kv-policy infinigen",
                   help="more flags for this runtime's server (default: InfiniGen)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args()
    if not a.gguf.exists():
        raise SystemExit(f"no GGUF at {a.gguf}: give --gguf the Qwen2.5 file "
                         f"(../shared/models/qwen2.5-coder-0.5b.sh DEST makes it)")
    if a.llama_server is not None and not a.llama_server.exists():
        raise SystemExit(f"no llama-server at {a.llama_server}")
    # what chat_serving.start reads: one row (slot) a user, each its history and turns
    a.rows, a.max_wait_ms = a.users, 50.0
    a.context = int(1.25 * (a.history + a.turns * (a.turn_tokens + a.answer_tokens))) + 512
    a.ours_args = shlex.split(a.ours_args) + ["--prefix-cache-gb", str(a.prefix_cache_gb)]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                if k not in ("out", "fresh", "report_only", "llama_server", "text")}
    settings["gguf"], settings["ours_args"] = a.gguf.name, " ".join(a.ours_args)
    doc = artifacts.load(a.out)
    if not a.report_only:
        from tqdm import tqdm
        programs = ["ours"] + (["llama"] if a.llama_server else [])
        fresh = a.fresh
        for _ in tqdm(range(a.runs), desc="runs"):
            rows = []
            for which in programs:
                row = run_once(a, which)
                row["program"] = NAMES[which]
                rows.append(row)
            doc = artifacts.append_run(a.out, {"rows": with_ratio(rows)}, fresh,
                                       settings=settings)
            fresh = False
    artifacts.write_report(a.out, doc, settings, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
