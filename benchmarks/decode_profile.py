"""Where a decode step's time goes on a CPU: each compiled kernel's share, and the rest (the
model's other torch operations and Python), for several KV policies from one prefill.

    python benchmarks/decode_profile.py                       # SmolLM2, batch 8 x 8,180 tokens
    python benchmarks/decode_profile.py --model path/to/qwen2.5-coder-0.5b-instruct.gguf \\
        --context 16384 --batch 1 --compress-weight --tag qwen16k

The prompt is prefilled once (kept on disk, see ``flexgen_infinigen.prefill_cache``) and each
policy decodes ``--steps`` tokens from it; every kernel call is timed (wall time, on the
calling thread, which waits for it) and the step's remainder is reported as "other". The
KV cache lives in CPU memory (``--percent 100 0 0 100 100 0``). Writes
``decode_profile_<tag>.{json,md}`` under ``--out-dir`` (default the temporary folder's
``flexgen_infinigen_investigations``: a profile is an investigation, not a result kept
under ``benchmarks/results/``).
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
OUT = Path(tempfile.gettempdir()) / "flexgen_infinigen_investigations"
KERNELS = ("attend_rows", "attend_rows_q4", "attend_indexed", "speculate_mass",
           "speculate_pages", "score_packed", "select_mass", "spec_write")
LAYER_KERNELS = ("linear", "rms_norm", "rotary", "moe_experts")  # in cpu_layers
FUSED = "decode_layer"  # a layer's step as one compiled call (LayerCall.run)
FUSED_MOE = "moe_layer"  # a MoE stage's step as one compiled call (fused_moe.MoePlan)


def _timed_kernels(times: dict, calls: collections.Counter, active: list) -> None:
    """Wrap the kernels where the runtime calls them, adding each call's wall time while
    ``active[0]`` (decode steps only)."""
    import importlib

    from flexgen_infinigen.kernels import cpu_kernels
    try:
        from flexgen_infinigen.kernels import layers as cpu_layers
    except ImportError:  # an older checkout: the layers' kernels lived in cpu_kernels
        cpu_layers = cpu_kernels

    def wrap(module, name):
        real = getattr(module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = real(*args, **kwargs)
            if active[0]:
                times[name] += time.perf_counter() - start
                calls[name] += 1
            return out
        return timed

    timed = {name: wrap(cpu_kernels, name) for name in KERNELS}
    try:  # the fused layer call: the kernels inside it are C calling C, not wrapped
        from flexgen_infinigen.kernels.layer_call import LayerCall
        real_call = LayerCall.run

        def timed_call(self, mode):
            start = time.perf_counter()
            real_call(self, mode)
            if active[0]:
                times[FUSED] += time.perf_counter() - start
                calls[FUSED] += 1
        LayerCall.run = timed_call
    except (ImportError, AttributeError):  # an older checkout: no fused call
        pass
    try:  # a MoE stage's decode step as one call (norm, router, experts, residual)
        from flexgen_infinigen.engine import fused_moe
        real_stage = fused_moe.MoePlan.__call__

        def timed_stage(self, h):
            start = time.perf_counter()
            out = real_stage(self, h)
            if active[0]:
                times[FUSED_MOE] += time.perf_counter() - start
                calls[FUSED_MOE] += 1
            return out
        fused_moe.MoePlan.__call__ = timed_stage
    except (ImportError, AttributeError):  # an older checkout: no such call
        pass
    # rms_norm and rotary are called as cpu_layers.<name>; linear is imported by name
    real = {name: getattr(cpu_layers, name) for name in LAYER_KERNELS
            if hasattr(cpu_layers, name)}
    layer = {name: wrap(cpu_layers, name) for name in real}
    for name, fn in layer.items():
        setattr(cpu_layers, name, fn)
    for module in ("flexgen_infinigen.kernels.cpu_kernels",
                   "flexgen_infinigen.kv.infinigen.spec_keys",
                   "flexgen_infinigen.kv.infinigen.spec_pages",
                   "flexgen_infinigen.kv.infinigen.rehearsal", "flexgen_infinigen.models.llama",
                   "flexgen_infinigen.models.opt", "flexgen_infinigen.models.moe",
                   "flexgen_infinigen.kernels.attention"):
        mod = importlib.import_module(module)
        for name, fn in timed.items():
            if module.endswith("cpu_kernels") or getattr(mod, name, None) is not None:
                setattr(mod, name, fn)
        for name, fn in layer.items():  # imported by name (linear, moe_experts)
            if getattr(mod, name, None) is real[name]:
                setattr(mod, name, fn)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=8180)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="decode steps timed (after a first)")
    p.add_argument("--policies", nargs="+",
                   default=["full", "infinigen", "infinigen:max_kv_fraction=0.1"],
                   help="NAME or NAME:key=value,... (kv options)")
    p.add_argument("--compress-weight", action="store_true")
    p.add_argument("--sep-layer", choices=["true", "false"], default=None,
                   help="attention and MLP as separate schedule stages or one (default: the "
                        "runtime's choice, one stage a layer here)")
    p.add_argument("--prefill-dir", default=None, help="keep the prefill there (reused)")
    p.add_argument("--data-dir", default=None,
                   help="folder with pg19_firstbook.txt / wikitext2_test.txt (default: "
                        "../shared/data; without either, a built-in paragraph)")
    p.add_argument("--tag", default="smollm2_b8_8k")
    p.add_argument("--out-dir", default=str(OUT), help="where the JSON and table go")
    a = p.parse_args(argv)

    from long_context import read_bandwidth
    from long_prompts import SHARED, natural_prompts
    from machine import machine_info

    from flexgen_infinigen import OffloadedLM, Placement
    from flexgen_infinigen.kv import make_kv_policy
    from flexgen_infinigen.engine.prefill_cache import PrefillCache

    times: dict = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    active = [False]  # kernels are timed in decode steps only, not in the prefill
    _timed_kernels(times, calls, active)
    kept = PrefillCache(a.prefill_dir) if a.prefill_dir else PrefillCache()
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=a.batch,
                                 compress_weight=a.compress_weight,
                                 sep_layer=None if a.sep_layer is None
                                 else a.sep_layer == "true")
    rows = []
    with OffloadedLM.load(model=a.model, policy=policy, progress=False,
                          max_len_hint=(a.context, a.steps + 2)) as lm:
        sep_layer = lm.policy.sep_layer
        prompts, source = natural_prompts(lm.tokenizer, a.context, a.batch,
                                          Path(a.data_dir) if a.data_dir else SHARED)
        print(f"prompts: {source}", flush=True)
        iteration = lm.engine._iteration

        decodes = [0]

        def timed_iteration(p, *args):
            # the first decode step also writes what the prompt left (a kept prefill's
            # speculation keys): timed from the second on, as the steps are
            decodes[0] += p.decode
            active[0] = decodes[0] >= 2
            return iteration(p, *args)
        lm.engine._iteration = timed_iteration
        for label in a.policies:
            kv, _, opts = label.partition(":")
            kw = {k: _value(v) for k, v in (o.split("=") for o in opts.split(",") if o)}
            lm.use_kv_policy(make_kv_policy(kv, **kw))
            times.clear()
            calls.clear()
            decodes[0], active[0] = 0, False  # a kept prefill is restored outside them
            out = lm.generate(prompts, a.steps + 2, stop_token_id=None, prefill_cache=kept)
            steps = out.step_times[2:]  # not the prefill, nor the first decode step
            n = len(steps)
            step = statistics.median(steps)
            per_step = {k: v / n for k, v in times.items()}
            rows.append({"policy": label, "step_s": step, "mean_step_s": sum(steps) / n,
                         "kernels_s": per_step, "calls_per_step": {k: v // n for k, v in
                                                                   calls.items()},
                         "other_s": sum(steps) / n - sum(per_step.values()),
                         "kv_fetch_fraction": lm.engine.kv_policy.report().get(
                             "kv_fetch_fraction", 1.0)})
            print(f"{label}: {1e3 * step:.1f} ms a step; " + ", ".join(
                f"{k} {1e3 * v:.1f}" for k, v in per_step.items()), flush=True)
    result = {"machine": machine_info(), "model": a.model, "context": a.context,
              "batch": a.batch, "compress_weight": a.compress_weight, "prompt_source": source,
              "sep_layer": sep_layer,  # as the runtime resolved it
              "read_bandwidth_bytes_s": read_bandwidth(256 << 20), "rows": rows}
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"decode_profile_{a.tag}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result))
    print(f"written {stem}.json, .md")
    return 0


def _value(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def markdown(result: dict) -> str:
    names = [k for k in (FUSED, FUSED_MOE, *LAYER_KERNELS, *KERNELS)
             if any(k in r["kernels_s"] for r in result["rows"])]
    lines = [f"# Decode step profile: {result['model']}, batch {result['batch']} x "
             f"{result['context']} tokens" + (", 4-bit weights" if result["compress_weight"]
                                              else ""), "",
             "Milliseconds a step (mean over the measured steps; the step column is the "
             "median), KV cache in CPU memory.", "",
             "| policy | step | " + " | ".join(names) + " | other | other / step | KV read |",
             "|---" * (len(names) + 5) + "|"]
    for r in result["rows"]:
        cells = [r["policy"], f"{1e3 * r['step_s']:.1f}"]
        cells += [f"{1e3 * r['kernels_s'].get(k, 0.0):.1f}" for k in names]
        mean = r.get("mean_step_s") or r["step_s"]
        cells += [f"{1e3 * r['other_s']:.1f}", f"{100 * r['other_s'] / mean:.0f}%",
                  f"{r['kv_fetch_fraction']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
