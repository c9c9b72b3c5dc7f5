"""Chat-grade serving against llama-server: one GGUF, both servers on this machine, one run.

Three loads, each sent to this runtime's server and to llama-server (built from the same
llama.cpp source as the other comparisons, its prompt cache on, ``-np`` slots as many as
our block's rows), one server at a time:

1. **Latecomer.** A 256-token answer streams; after its 16th token a short request arrives.
   Its time to first token is compared with one decode step (the long answer's median gap
   between tokens before it came) plus its own first-token time on an idle server (goal: at
   most 1.5x).
2. **Multi-turn.** ``--users`` users chat ``--turns`` turns each, concurrently; every turn
   sends the whole conversation (the earlier answers as the server gave them) plus a new
   user message of about ``--turn-tokens`` tokens. Median time to first token of the first
   turn and of the later ones (goal: later / first at most 0.25, and no worse than
   llama-server's).
3. **Mixed load.** ``--mixed`` requests, prompts of 200 to ``--mixed-prompt-max`` tokens and
   answers of 16 to ``--mixed-answer-max``, from ``--clients`` concurrent clients: total
   tokens/s (prompt and answer tokens over the wall time) and median time to first token.

Texts come from ``--text`` (WikiText-2 in ``../shared/data``), cut at word boundaries; the
random choices are seeded, so both servers get the same requests. Temperature 0.

    python benchmarks/chat_serving.py --gguf path/to/qwen2.5-coder-0.5b-instruct.gguf \\
        --llama-server path/to/llama-server --runs 3

Appends each run to benchmarks/results/chat_serving.json (``--fresh`` starts anew) and
rewrites chat_serving.md and .png from all of them.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import artifacts  # noqa: E402

OUT = HERE / "results" / "chat_serving"
SHARED_TEXT = HERE.parent.parent / "shared" / "data" / "wikitext2_test.txt"
SYSTEM = "You are a helpful assistant. Answer briefly."


# ---- servers --------------------------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(proc: subprocess.Popen, url: str, log: Path) -> None:
    for _ in range(6000):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not come up")


def start(which: str, a) -> tuple[subprocess.Popen, str]:
    """``ours`` or ``llama``, serving ``a.gguf`` with ``a.rows`` rows (slots), on 127.0.0.1."""
    port = _port()
    log = Path(f"/tmp/chat_serving_{which}.log")
    if which == "ours":
        cmd = [sys.executable, "-m", "flexgen_infinigen.serve", "--model", str(a.gguf),
               "--port", str(port), "--gpu-batch-size", str(a.rows), "--num-gpu-batches",
               "1", "--max-wait-ms", str(a.max_wait_ms), "--max-queue", "1000",
               "--threads", str(a.threads), "--max-tokens", "1024",
               "--max-model-len", str(a.context), "--admit-prompt-tokens", str(a.context),
               *getattr(a, "ours_args", [])]
    else:
        cmd = [str(a.llama_server), "-m", str(a.gguf), "--port", str(port), "-t",
               str(a.threads), "-np", str(a.rows), "-c", str(a.context * a.rows),
               "--cache-prompt", "-fa", a.flash_attn]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    _wait_up(proc, url, log)
    MODELS[url] = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    return proc, url


MODELS: dict[str, str] = {}  # url -> the model id its /v1/models lists first


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()


# ---- one streamed chat request -------------------------------------------------------------
def chat(url: str, messages: list[dict], max_tokens: int, on_token=None,
         extra: dict | None = None) -> dict:
    """Stream one chat completion (``extra``: more fields of the body); its start, its
    first-token time, its token gaps, its text and its prompt and answer token counts (the
    server's usage)."""
    body = {"model": MODELS.get(url, "m"), "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **(extra or {})}
    start, first, last, gaps, text, usage = time.perf_counter(), None, None, [], [], {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if not piece:
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now - start
                else:
                    gaps.append(now - last)
                last = now
                text.append(piece)
                if on_token is not None:
                    on_token(len(text))
    details = usage.get("prompt_tokens_details") or {}
    return {"t0": start, "ttft": first, "gaps": gaps, "text": "".join(text),
            "seconds": time.perf_counter() - start, "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": details.get("cached_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", len(text))}


# ---- texts ----------------------------------------------------------------------------------
class Texts:
    """Pieces of a corpus of about ``n`` tokens (four characters a token), at word ends."""

    def __init__(self, path: Path | None, seed: int):
        words = (path.read_text(encoding="utf-8").split() if path and path.exists() else
                 ("the river ran past the old mill where the miller kept his grain and "
                  "counted the days of the harvest ").split() * 20000)
        self.words, self.rng = [w for w in words if w not in ("@-@", "@,@", "@.@")], \
            random.Random(seed)

    def piece(self, tokens: int) -> str:
        out, chars = [], 0
        at = self.rng.randrange(len(self.words) - 1)
        while chars < 4 * tokens:
            w = self.words[at % len(self.words)]
            out.append(w)
            chars += len(w) + 1
            at += 1
        return " ".join(out)


# ---- the loads ------------------------------------------------------------------------------
def latecomer(url: str, texts: Texts) -> dict:
    def short():  # a new text each time: no server has it cached
        return [{"role": "user", "content": "Say hello in French. " + texts.piece(24)}]

    chat(url, short(), 4)  # warm
    alone = statistics.median(chat(url, short(), 8)["ttft"] for _ in range(3))
    came = threading.Event()
    long_msgs = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    result = {}

    def long_run():
        result["long"] = chat(url, long_msgs, 256,
                              on_token=lambda n: n == 16 and came.set())

    t = threading.Thread(target=long_run)
    t.start()
    came.wait(600)
    late = chat(url, short(), 8)
    t.join()
    before = result["long"]["gaps"][:15]
    step = statistics.median(before) if before else float("nan")
    return {"latecomer_ttft_s": late["ttft"], "alone_ttft_s": alone, "step_s": step,
            "latecomer_ratio": late["ttft"] / (step + alone)}


def multi_turn(url: str, texts: Texts, users: int, turns: int, first_tokens: int,
               turn_tokens: int, answer: int) -> dict:
    ttft: dict[int, list[float]] = {t: [] for t in range(turns)}
    cached: list[float] = []
    prompts: list[int] = []
    lock = threading.Lock()
    openings = [texts.piece(first_tokens) for _ in range(users)]
    follow = [[texts.piece(turn_tokens) for _ in range(turns)] for _ in range(users)]

    def user(u: int):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Summarize this text: " + openings[u]}]
        for t in range(turns):
            got = chat(url, messages, answer)
            with lock:
                ttft[t].append(got["ttft"])
                prompts.append(got["prompt_tokens"])
                if t:
                    cached.append(got["cached_tokens"] / max(1, got["prompt_tokens"]))
            messages += [{"role": "assistant", "content": got["text"]},
                         {"role": "user", "content": "And this one: " + follow[u][t]}]

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    first = statistics.median(ttft[0])
    later = statistics.median([x for t in range(1, turns) for x in ttft[t]])
    return {"first_turn_ttft_s": first, "later_turns_ttft_s": later,
            "later_over_first": later / first, "longest_prompt_tokens": max(prompts),
            "later_cached_share": statistics.median(cached) if cached else 0.0}


def mixed(url: str, texts: Texts, n: int, clients: int, prompt_max: int, answer_max: int,
          seed: int) -> dict:
    rng = random.Random(seed)
    jobs = [(texts.piece(rng.randint(200, prompt_max)), rng.randint(16, answer_max))
            for _ in range(n)]
    results, lock, it = [], threading.Lock(), iter(jobs)

    def client():
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            got = chat(url, [{"role": "user", "content": "Continue: " + job[0]}], job[1])
            with lock:
                results.append(got)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - start
    tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in results)
    answers = sum(r["completion_tokens"] for r in results)
    return {"mixed_tokens_per_s": tokens / wall, "mixed_answer_tokens_per_s": answers / wall,
            "mixed_ttft_s": statistics.median(r["ttft"] for r in results if r["ttft"]),
            "mixed_wall_s": wall}


def run_once(a, which: str) -> dict:
    proc, url = start(which, a)
    try:
        texts = Texts(a.text, a.seed)
        row = {"program": which}
        row.update(latecomer(url, texts))
        texts = Texts(a.text, a.seed + 1)  # the same conversations for both servers
        row.update(multi_turn(url, texts, a.users, a.turns, a.first_tokens, a.turn_tokens,
                              a.answer_tokens))
        texts = Texts(a.text, a.seed + 2)
        row.update(mixed(url, texts, a.mixed, a.clients, a.mixed_prompt_max,
                         a.mixed_answer_max, a.seed))
        return row
    finally:
        stop(proc)


# ---- report ---------------------------------------------------------------------------------
NAMES = {"ours": "flexgen_infinigen", "llama": "llama-server"}
COLUMNS = [("latecomer first token s", "latecomer_ttft_s"), ("decode step s", "step_s"),
           ("alone first token s", "alone_ttft_s"),
           ("latecomer / (step + alone)", "latecomer_ratio"),
           ("turn 1 first token s", "first_turn_ttft_s"),
           ("later turns first token s", "later_turns_ttft_s"),
           ("later / turn 1", "later_over_first"),
           ("later turns' prompt cached", "later_cached_share"),
           ("mixed tok/s", "mixed_tokens_per_s"),
           ("mixed first token s", "mixed_ttft_s")]
RATIO = "ours / llama-server"


def with_ratio(rows: list[dict]) -> list[dict]:
    """The run's rows, and ours over llama-server's of every field (both ran)."""
    by = {r["program"]: r for r in rows}
    if set(by) != set(NAMES.values()):
        return rows
    ours, theirs = by[NAMES["ours"]], by[NAMES["llama"]]
    return rows + [{"program": RATIO, **{f: ours[f] / theirs[f] for _, f in COLUMNS
                                         if ours.get(f) and theirs.get(f)}}]


def markdown(doc: dict) -> str:
    s = doc["settings"]
    return (artifacts.table(doc["runs"], ["program"], COLUMNS) + "\n"
            + f"{s['gguf']}; {s['rows']} rows (llama-server -np {s['rows']}, prompt cache on); "
            f"latecomer after 16 of 256 tokens; {s['users']} users x {s['turns']} turns "
            f"(opening ~{s['first_tokens']} tokens, then ~{s['turn_tokens']} a turn, answers "
            f"{s['answer_tokens']}); mixed: {s['mixed']} requests, prompts "
            f"200-{s['mixed_prompt_max']}, answers 16-{s['mixed_answer_max']}, "
            f"{s['clients']} clients. {artifacts.meta_line(doc['runs'])}\n")


def plot(doc: dict, path: Path) -> None:
    plt = artifacts.pyplot()
    if plt is None:
        return
    keys = ["latecomer_ttft_s", "first_turn_ttft_s", "later_turns_ttft_s", "mixed_ttft_s"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    groups = artifacts.grouped(doc["runs"], ["program"], lambda r: r["program"] != RATIO)
    for i, ((name,), rows) in enumerate(groups.items()):
        med = [statistics.median(r[k] for r in rows) for k in keys]
        ax.bar([x + 0.4 * i for x in range(len(keys))], med, 0.4, label=name)
        bx.bar([i], [statistics.median(r["mixed_tokens_per_s"] for r in rows)], 0.6)
    ax.set_xticks([x + 0.2 for x in range(len(keys))],
                  ["latecomer", "turn 1", "later turns", "mixed"])
    ax.set_ylabel("time to first token, s (median)")
    ax.legend()
    bx.set_xticks(range(len(groups)), [k[0] for k in groups])
    bx.set_ylabel("mixed load, tokens/s (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--llama-server", type=Path, default=None,
                   help="llama-server's binary (without it: this runtime alone)")
    p.add_argument("--text", type=Path, default=SHARED_TEXT)
    p.add_argument("--rows", type=int, default=4, help="block rows, and llama-server's -np")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=8192, help="tokens a request may fill")
    p.add_argument("--max-wait-ms", type=float, default=50.0)
    p.add_argument("--flash-attn", default="auto", choices=["on", "off", "auto"])
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--first-tokens", type=int, default=1500)
    p.add_argument("--turn-tokens", type=int, default=200)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--mixed", type=int, default=16)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--mixed-prompt-max", type=int, default=1000)
    p.add_argument("--mixed-answer-max", type=int, default=128)
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
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                if k not in ("out", "fresh", "report_only", "llama_server", "text")}
    settings["gguf"] = a.gguf.name
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
