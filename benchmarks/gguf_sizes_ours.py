"""Our runtime's side of ``gguf_sizes.py``: each measurement in a fresh process of its own
(its start and its peak RSS are its own), run as ``python gguf_sizes_ours.py SPEC``.

    got = in_subprocess({"gguf": path, "batch": 1, "threads": 2, "depth": 4096, "gen": 32,
                         "prefill": 512, "batch_prompt": 128, "prefill_dir": folder}, 3600)

``batch`` 1: the first token of a ``prefill``-token prompt from the process's start, then
(warm) that prompt's prefill tokens/s and decode tokens/s at depth 0 and at ``depth``; else
the batch's total decode tokens/s. ``warm``: a warm-up only (store, kernels, page cache).
"""
from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not an install


def _prompts(vocab: int, length: int, batch: int, seed: int) -> list[list[int]]:
    import torch
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(batch)]


def _decode_rate(out, batch: int) -> float:
    """Tokens/s of the median decode step after the first two (all of them when few)."""
    steps = out.step_times[1:]
    steady = steps[2:] if len(steps) > 4 else steps
    return batch / statistics.median(steady)


def run_ours(spec: dict) -> dict:
    """One process's measurements (``spec["batch"]`` 1: start, prefill, depths; else the
    batch's decode). ``spawned_at``: the parent's clock just before it started this process."""
    import torch
    torch.set_num_threads(spec["threads"])
    from flexgen_infinigen import OffloadedLM, Placement
    from flexgen_infinigen.engine.prefill_cache import PrefillCache

    b, gen, depth, prefill = spec["batch"], spec["gen"], spec["depth"], spec["prefill"]
    longest = max(depth, prefill) if b == 1 else spec["batch_prompt"]
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=b)
    got: dict = {}
    with OffloadedLM.load(model=spec["gguf"], policy=policy, progress=False,
                          kv_policy=spec.get("kv_policy", "full"),
                          max_len_hint=(longest, gen)) as lm:
        got["load_s"] = time.time() - spec["spawned_at"]
        vocab = lm.cfg.vocab_size
        if b == 1:
            first: list[float] = []
            lm.generate(_prompts(vocab, prefill, 1, 1), 1, stop_token_id=None,
                        on_tokens=lambda *_: first or first.append(time.time()))
            got["ttft_s"] = first[0] - spec["spawned_at"]
            out = lm.generate(_prompts(vocab, prefill, 1, 2), gen, stop_token_id=None)
            got["prefill_tokens_s"] = prefill / out.prefill_latency_s
            got["decode_at_prefill_tokens_s"] = _decode_rate(out, 1)
            out = lm.generate(_prompts(vocab, 1, 1, 3), gen, stop_token_id=None)
            got["decode_0_tokens_s"] = _decode_rate(out, 1)
            kept = PrefillCache(spec["prefill_dir"])
            out = lm.generate(_prompts(vocab, depth, 1, 4), gen, stop_token_id=None,
                              prefill_cache=kept)
            got["decode_depth_tokens_s"] = _decode_rate(out, 1)
            got["depth_prefill_reused"] = out.prefills_reused > 0
        else:
            out = lm.generate(_prompts(vocab, spec["batch_prompt"], b, 5), gen,
                              stop_token_id=None)
            got["batch_tokens_s"] = _decode_rate(out, b)
            got["batch_prefill_tokens_s"] = b * spec["batch_prompt"] / out.prefill_latency_s
        got["weights_placed_bytes"] = sum(lm.weight_bytes_by_tier().values())
        got["model_name"] = lm.cfg.name
    got["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return got


def in_subprocess(spec: dict, timeout: float) -> dict:
    """``run_ours`` in a fresh process (its start, its peak RSS are its own): what it
    returns, or ``{"error": ...}`` (never an exception, never a hang)."""
    spec = {**spec, "spawned_at": time.time()}
    cmd = [sys.executable, __file__, json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        lines = (proc.stderr or "").strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def warm_up(spec: dict) -> dict:
    """Load at batch 1 and at the batch and decode two tokens, in this process: a first use
    makes the runtime's store of the file and compiles its kernels, neither of which a
    measured start should count; the file is then in the page cache, as for llama.cpp."""
    import torch
    torch.set_num_threads(spec["threads"])
    from flexgen_infinigen import OffloadedLM, Placement

    for b in (1, spec["batch"]):
        policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=b)
        with OffloadedLM.load(model=spec["gguf"], policy=policy, progress=False,
                              max_len_hint=(4, 2)) as lm:
            lm.generate(_prompts(lm.cfg.vocab_size, 4, b, 0), 2, stop_token_id=None)
    return {"warm": True}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(warm_up(spec) if spec.get("warm") else run_ours(spec)))
