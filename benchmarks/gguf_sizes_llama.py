"""llama.cpp's side of ``gguf_sizes.py``: ``llama-bench`` for batch 1 and
``llama-batched-bench`` for batch 8, on the same GGUF in the same run.

    tests = decode_and_prefill(bench, gguf, threads=2, reps=3, depths=[0, 4096], gen=32,
                               prefill=512)
    batch = batched(batched_bench, gguf, threads=2, reps=3, prompt=128, gen=32, batch=8)

Each test runs with flash attention off and on (``-fa 0,1``) and keeps the setting whose
median is the better one (its samples are the rows' runs): the reader sees llama.cpp at its
best on this machine, whichever that is. ``llama-bench`` repeats a test ``-r`` times itself
(after one warm-up), each repetition filling the depth's cache first; ``llama-batched-bench``
has no repetitions, so it runs ``reps`` times. A failed or timed-out run gives an
``{"error": ...}`` result, never an exception and never a hang.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path


def check_binary(flag: str, binary: str | None) -> str | None:
    """The binary's resolved path, or one error naming the flag and the fix (before any long
    work starts); None stays None (llama.cpp not measured)."""
    if binary is None:
        return None
    path = Path(binary).expanduser()
    if not path.is_file() or not os.access(path, os.X_OK):
        name = flag.lstrip("-")
        raise SystemExit(f"error: {flag} {binary}: no executable there; pass the path of "
                         f"llama.cpp's {name} (build/bin/{name})")
    return str(path.resolve())


def _shown(cmd: list[str]) -> str:
    """The command without local folders (the binary's and the model's names only)."""
    return " ".join(Path(c).name if i == 0 or (i > 0 and cmd[i - 1] == "-m") else c
                    for i, c in enumerate(cmd))


def _run(cmd: list[str], timeout: float) -> tuple[str | None, str | None]:
    """(stdout, None) or (None, why it failed)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"{Path(cmd[0]).name} timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        lines = (proc.stderr or "").strip().splitlines()
        return None, f"{Path(cmd[0]).name}: {lines[-1] if lines else f'exit {proc.returncode}'}"
    return proc.stdout, None


def best_of(results: list[dict]) -> dict:
    """Of one test's results under each flash-attention setting, the one whose median
    tokens/s is highest; an error only when every setting failed."""
    good = [r for r in results if r.get("samples")]
    if not good:
        return results[0] if results else {"error": "no result"}
    best = max(good, key=lambda r: statistics.median(r["samples"]))
    return {**best, "other_fa_median": [statistics.median(r["samples"]) for r in good
                                        if r is not best] or None}


def bench_tests(binary: str, gguf: str, args: list[str], threads: int, reps: int,
                timeout: float, extra: tuple[str, ...] = ()) -> tuple[list[dict], str | None]:
    """llama-bench's JSON test records for ``args`` under -fa 0 and 1, or an error."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-r", str(reps), "-o", "json",
           "-fa", "0,1", *args, *extra]
    out, err = _run(cmd, timeout)
    if err:
        return [], err
    tests = json.loads(out)
    for t in tests:
        t["command"] = _shown(cmd)
    return tests, None


def _pick(tests: list[dict], n_prompt: int, n_gen: int, depth: int) -> dict:
    found = [{"samples": [float(x) for x in t.get("samples_ts") or [t["avg_ts"]]],
              "fa": int(t["flash_attn"]), "command": t["command"],
              "kv_cache": f"{t.get('type_k')}/{t.get('type_v')}",
              "threads": t.get("n_threads"), "model_type": t.get("model_type")}
             for t in tests if (int(t["n_prompt"]), int(t["n_gen"]), int(t["n_depth"]))
             == (n_prompt, n_gen, depth)]
    return best_of(found) if found else {"error": f"llama-bench gave no p{n_prompt}/"
                                                  f"n{n_gen} test at depth {depth}"}


def decode_and_prefill(binary: str, gguf: str, threads: int, reps: int, depths: list[int],
                       gen: int, prefill: int, timeout: float,
                       extra: tuple[str, ...] = ()) -> dict:
    """``{"decode": {depth: result}, "prefill": result}``; a result is ``{"samples": [tokens/s
    per repetition], "fa": 0 or 1, "command": ...}`` or ``{"error": ...}``."""
    out: dict = {"decode": {}}
    tests, err = bench_tests(binary, gguf, ["-p", "0", "-n", str(gen),
                                            "-d", ",".join(map(str, depths))],
                             threads, reps, timeout, extra)
    for d in depths:
        out["decode"][d] = {"error": err} if err else _pick(tests, 0, gen, d)
    tests, err = bench_tests(binary, gguf, ["-p", str(prefill), "-n", "0", "-d", "0"],
                             threads, reps, timeout, extra)
    out["prefill"] = {"error": err} if err else _pick(tests, prefill, 0, 0)
    return out


def batched(binary: str, gguf: str, threads: int, reps: int, prompt: int, gen: int,
            batch: int, timeout: float) -> dict:
    """llama-batched-bench with ``batch`` sequences of ``prompt`` tokens each (not shared),
    then ``gen`` tokens each: ``{"samples": [total decode tokens/s a run], ...}``."""
    ctx = batch * (prompt + gen) + 256  # every sequence's cells, and room to spare
    results = []
    for fa in ("off", "on"):
        cmd = [binary, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512",
               "-npp", str(prompt), "-ntg", str(gen), "-npl", str(batch), "-t", str(threads),
               "-fa", fa, "--output-format", "jsonl"]
        samples, err = [], None
        for _ in range(reps):
            out, err = _run(cmd, timeout)
            if err:
                break
            lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
            if not lines:
                err = f"{Path(binary).name} printed no result"
                break
            samples.append(float(lines[-1]["speed_tg"]))
        results.append({"error": err} if err else
                       {"samples": samples, "fa": int(fa == "on"), "command": _shown(cmd)})
    return best_of(results)
