"""Decode throughput and bytes moved per token for several offloading policies.

For each model and policy: load the model, run one warm-up generation, reset the byte
counters, run the measured generation (``stop_token_id=None`` so every row generates
exactly ``gen_len`` tokens) and record decode tokens/s, prefill latency, bytes moved per
generation step by link and kind, and peak memory per tier. Hugging Face transformers'
``generate`` on the same machine, model and lengths is the reference.

    python benchmarks/throughput.py            # full run (about 8 minutes on 2 idle CPU cores)
    python benchmarks/throughput.py --quick    # smoke configuration (about 10 seconds)

See benchmarks/README.md for what each column means.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

import flexgen_infinigen
from flexgen_infinigen import OffloadedLM, Policy
from flexgen_infinigen.report import build_report
from flexgen_infinigen.run import synthesize_prompts
from flexgen_infinigen.tiers import KINDS, LINKS, TIERS

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "throughput_cpu.json"

# name -> (percent WG WC CG CC HG HC, extra Policy switches)
POLICIES = {
    "all on device": ([100, 0, 100, 0, 100, 0], {}),
    "weights in CPU memory": ([0, 100, 100, 0, 100, 0], {}),
    "KV cache in CPU memory": ([100, 0, 0, 100, 100, 0], {}),
    "weights + cache in CPU memory": ([0, 100, 0, 100, 100, 0], {}),
    "KV cache on disk": ([100, 0, 0, 0, 100, 0], {}),
    "4-bit weights, all on device": ([100, 0, 100, 0, 100, 0], {"compress_weight": True}),
}

# How each model is loaded, and the lengths it runs at unless given on the command line.
# opt-1.3b in float32 is 5.3 GB; on 2 CPU cores a 256-token prefill of 4 prompts takes
# tens of seconds per run, so it runs shorter (and repeats fewer times) to keep a full run
# near 15 minutes. ``repeats``: measured generations per configuration, the fastest reported.
MODELS = {
    "smollm2-135m": {"load": {"model": "smollm2-135m"}, "prompt_len": None, "gen_len": None,
                     "repeats": 3},
    "opt-1.3b": {"load": {"model": "opt-1.3b", "dummy": True}, "prompt_len": 64, "gen_len": 16,
                 "repeats": 1},
}
OPT_1_3B = dict(hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32,
                vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=2048,
                do_layer_norm_before=True, pad_token_id=1, bos_token_id=2, eos_token_id=2)


# ---- machine ----------------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import transformers
    cuda = torch.cuda.is_available()
    return {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "flexgen_infinigen_version": flexgen_infinigen.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": "cuda" if cuda else "cpu",
        "device_name": torch.cuda.get_device_name(0) if cuda else cpu_name(),
    }


# ---- contention -------------------------------------------------------------------------------
class CpuMeter:
    """Share of the machine's CPU time used by *other* processes while a measurement ran.

    The benchmark shares the machine with whatever else runs; on 2 cores a busy neighbour
    slows torch's threads down by several times, so every row records how busy it was.
    """

    def __init__(self):
        self.wall, self.busy, self.own = time.perf_counter(), self._busy(), self._own()

    @staticmethod
    def _busy() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def others(self) -> float | None:
        """Fraction (0..1) of all cores' time that other processes used since construction."""
        busy = self._busy()
        if busy is None or self.busy is None:
            return None
        wall = time.perf_counter() - self.wall
        other = (busy - self.busy) - (self._own() - self.own)
        return max(0.0, other / max(wall * (os.cpu_count() or 1), 1e-9))


@dataclass
class Retry:
    """How hard to try for measurements that no other process disturbed."""

    repeats: int  # measured runs per configuration (the fastest is reported)
    max_others: float = 0.10  # a run is "quiet" when others used at most this CPU share
    extra: int = 2  # more runs when none of the first ``repeats`` was quiet
    pause_s: float = 5.0  # wait before each extra run, for the neighbour to finish


def measure(fn, retry: Retry) -> tuple[list[dict], list[dict]]:
    """Call ``fn()`` (which returns a dict) ``retry.repeats`` times, and up to ``retry.extra``
    more times while no run was quiet. Returns (all runs, the quiet ones or else all)."""
    runs: list[dict] = []
    while True:
        meter = CpuMeter()
        run = fn()
        run["other_processes_cpu"] = others = meter.others()
        run["quiet"] = others is None or others <= retry.max_others
        runs.append(run)
        quiet = [r for r in runs if r["quiet"]]
        if len(runs) >= retry.repeats and (quiet or len(runs) >= retry.repeats + retry.extra):
            return runs, quiet or runs
        if len(runs) >= retry.repeats:
            time.sleep(retry.pause_s)


# ---- our runtime ------------------------------------------------------------------------------
def run_policy(model: str, name: str, prompt_len: int, gen_len: int, batch: int,
               warmup_gen_len: int, retry: Retry, seed: int) -> dict:
    """Load, warm up, then the measured generations; the fastest quiet one is reported."""
    percent, switches = POLICIES[name]
    policy = Policy.from_percent(percent, gpu_batch_size=batch, num_gpu_batches=1, **switches)
    lm = OffloadedLM.load(policy=policy, seed=seed, progress=False,
                          max_len_hint=(prompt_len, gen_len), **MODELS[model]["load"])
    with lm:
        prompts = synthesize_prompts(lm, prompt_len, batch, seed)
        lm.generate(prompts, gen_len=warmup_gen_len, stop_token_id=None)  # warm-up

        def one_run() -> dict:
            lm.tiers.reset_counters()
            gen = lm.generate(prompts, gen_len=gen_len, stop_token_id=None)
            if any(len(t) != gen_len for t in gen.token_ids):
                raise RuntimeError(f"{model} / {name}: a row did not generate {gen_len} tokens")
            return {"prefill_s": gen.prefill_latency_s, "decode_s": gen.decode_latency_s,
                    "bytes_moved": json.loads(json.dumps(lm.tiers.bytes_moved)), "gen": gen}

        runs, usable = measure(one_run, retry)
        report = build_report(lm, runs[-1]["gen"], str(lm.tiers.device))
        load_time = lm.load_time_s
    moved = runs[0]["bytes_moved"]
    if any(r["bytes_moved"] != moved for r in runs):
        raise RuntimeError(f"{model} / {name}: bytes moved differ between identical runs")
    for r in runs:
        del r["bytes_moved"], r["gen"]
    best = min(usable, key=lambda r: r["decode_s"])
    return {
        "policy": name,
        "percent": percent,
        "compress_weight": bool(switches.get("compress_weight", False)),
        "decode_tokens_per_s": batch * (gen_len - 1) / max(best["decode_s"], 1e-9),
        "prefill_s": min(r["prefill_s"] for r in usable),
        "decode_s": best["decode_s"],
        "bytes_per_token": {link: {kind: moved[link][kind] / gen_len for kind in KINDS}
                            for link in LINKS},
        "bytes_total": moved,
        "peak_memory_bytes": {t: report["peak_memory_bytes"][t] for t in TIERS},
        "weights_by_tier_bytes": report["weights_by_tier_bytes"],
        "model_bytes": report["sizes_bytes"]["model"],
        "cache_bytes": report["sizes_bytes"]["cache"],
        "load_time_s": load_time,
        "other_processes_cpu": best["other_processes_cpu"],
        "quiet": best["quiet"],
        "runs": runs,
        "ratio_vs_transformers": None,  # filled in once the reference has run
    }


# ---- the transformers reference --------------------------------------------------------------
def hf_smollm2():
    """LlamaForCausalLM holding exactly our store's SmolLM2 weights, with transformers'
    default attention (sdpa), which is what a user of ``generate`` gets."""
    from flexgen_infinigen.weights.embedded import default_model_store
    from flexgen_infinigen.weights.hf_reference import hf_llama_from_store

    return hf_llama_from_store(default_model_store(progress=False), attn_implementation="sdpa")


def hf_opt_1_3b(seed: int):
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(seed)
    return OPTForCausalLM(OPTConfig(**OPT_1_3B)).float().eval()


def hf_prompts(model: str, prompt_len: int, batch: int, seed: int) -> torch.Tensor:
    """The same token ids our runtime is given (synthesize_prompts needs a loaded model)."""
    if model == "smollm2-135m":
        from flexgen_infinigen.run import FILLER_TEXT
        from flexgen_infinigen.tokenizer import load_tokenizer
        from flexgen_infinigen.weights.embedded import default_model_store
        from flexgen_infinigen.weights.store import WeightStore
        path = default_model_store(progress=False)
        ids = load_tokenizer(path, WeightStore(path).config).encode(FILLER_TEXT)
        ids = (ids * (prompt_len // len(ids) + 1))[:prompt_len]
        return torch.tensor([ids] * batch)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, OPT_1_3B["vocab_size"], (batch, prompt_len), generator=gen)


def run_transformers(model: str, prompt_len: int, gen_len: int, batch: int, retry: Retry,
                     seed: int) -> dict:
    """decode tokens/s = batch * (gen_len - 1) / (time(gen_len tokens) - time(1 token)).

    Each of the two times is the best quiet one of ``retry.repeats`` (or more) runs, after
    one warm-up generation.
    """
    start = time.perf_counter()
    hf = hf_smollm2() if model == "smollm2-135m" else hf_opt_1_3b(seed)
    build_s = time.perf_counter() - start
    ids = hf_prompts(model, prompt_len, batch, seed)
    mask = torch.ones_like(ids)
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def timed(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - t
        assert out.shape[1] == prompt_len + n, out.shape
        return elapsed

    timed(min(gen_len, 2))  # warm-up
    ones, ones_ok = measure(lambda: {"s": timed(1)}, retry)
    fulls, fulls_ok = measure(lambda: {"s": timed(gen_len)}, retry)
    one = min(ones_ok, key=lambda r: r["s"])
    full = min(fulls_ok, key=lambda r: r["s"])
    return {"policy": "transformers generate", "percent": None,
            "decode_tokens_per_s": batch * (gen_len - 1) / max(full["s"] - one["s"], 1e-9),
            "prefill_s": one["s"], "generate_s": full["s"], "build_s": build_s,
            "runs": {"one_token": ones, "gen_len_tokens": fulls},
            "other_processes_cpu": max(one["other_processes_cpu"] or 0,
                                       full["other_processes_cpu"] or 0),
            "quiet": one["quiet"] and full["quiet"],
            "attn_implementation": "sdpa (transformers default)", "dtype": "float32"}


# ---- output -----------------------------------------------------------------------------------
def _gb(n: float) -> str:
    return f"{n / 1e9:.3f}"


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _busy(r: dict) -> str:
    x = r.get("other_processes_cpu")
    return ("-" if x is None else f"{100 * x:.0f}%") + ("" if r.get("quiet", True) else " (!)")


SHORT = {"disk->host": "disk>h", "host->device": "h>d", "device->host": "d>h",
         "host->disk": "h>disk"}


def _links(bpt: dict, kind: str) -> str:
    """MB per step of one kind, by link, e.g. 'h>d 48.5, d>h 1.5' ('0' when nothing moved)."""
    parts = [f"{SHORT[link]} {_mb(bpt[link][kind])}" for link in LINKS if bpt[link][kind]]
    return ", ".join(parts) or "0"


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Decode throughput on {m['device_name']} ({m['cpu_count']} CPUs, "
             f"torch {m['torch_version']}, transformers {m['transformers_version']})", ""]
    for model, entry in result["models"].items():
        s = entry["settings"]
        lines += [f"## {model}", "",
                  f"batch {s['batch']}, prompt {s['prompt_len']} tokens, generate "
                  f"{s['gen_len']} tokens, {s['dtype']}; model {_mb(entry['model_bytes'])} MB. "
                  "Bytes are per generation step (one new token for each of the "
                  f"{s['batch']} prompts), averaged over all {s['gen_len']} steps "
                  f"(prefill included). Times are the best of {s['repeats']} "
                  f"run{'s' if s['repeats'] > 1 else ''} (more when another process was "
                  "busy). (!) marks a time measured while other processes used more than "
                  f"{100 * result['settings']['max_others']:.0f}% of the CPU: unreliable.", ""]
        if s.get("reduced"):
            lines += [f"Lengths reduced from the defaults: {s['reduced']}", ""]
        lines += ["| policy | percent | decode tok/s | prefill s | vs HF | "
                  "weights MB/step | KV cache MB/step | activations MB/step | "
                  "peak device GB | peak host GB | peak disk GB | others' CPU |",
                  "|---|---|---:|---:|---:|---|---|---|---:|---:|---:|---:|"]
        for r in entry["rows"]:
            bpt = r["bytes_per_token"]
            pk = r["peak_memory_bytes"]
            pct = " ".join(f"{p:g}" for p in r["percent"]) + (" +4bit" if r["compress_weight"]
                                                             else "")
            lines.append(f"| {r['policy']} | {pct} | {r['decode_tokens_per_s']:.2f} | "
                         f"{r['prefill_s']:.2f} | {_num(r['ratio_vs_transformers'])} | "
                         f"{_links(bpt, 'weights')} | {_links(bpt, 'kv_cache')} | "
                         f"{_links(bpt, 'activations')} | {_gb(pk['device'])} | "
                         f"{_gb(pk['host'])} | {_gb(pk['disk'])} | "
                         f"{_busy(r)} |")
        hf = entry["transformers"]
        if hf is not None:
            lines.append(f"| transformers generate | - | {hf['decode_tokens_per_s']:.2f} | "
                         f"{hf['prefill_s']:.2f} | 1.00 | - | - | - | - | - | - | "
                         f"{_busy(hf)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def bar_chart(result: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(result["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        entry = result["models"][model]
        names = [r["policy"] for r in entry["rows"]]
        values = [r["decode_tokens_per_s"] for r in entry["rows"]]
        colors = ["tab:blue"] * len(entry["rows"])
        if entry["transformers"] is not None:
            names.append("transformers generate")
            values.append(entry["transformers"]["decode_tokens_per_s"])
            colors.append("tab:gray")
        ax.bar(range(len(names)), values, color=colors)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        s = entry["settings"]
        ax.set_title(f"{model} (batch {s['batch']}, prompt {s['prompt_len']}, "
                     f"gen {s['gen_len']})", fontsize=10)
        ax.set_ylabel("decode tokens/s")
    fig.suptitle(f"Decode throughput, {result['machine']['device_name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---- main -------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON file (the .md and .png go "
                   "next to it)")
    p.add_argument("--quick", action="store_true",
                   help="smoke configuration: smollm2-135m only, short lengths, two policies")
    p.add_argument("--models", nargs="+", default=None, choices=list(MODELS),
                   help=f"default: all ({' '.join(MODELS)}); --quick: smollm2-135m")
    p.add_argument("--policies", nargs="+", default=None, choices=list(POLICIES),
                   metavar="NAME", help="default: all; quote each name: "
                   + ", ".join(repr(n) for n in POLICIES))
    p.add_argument("--prompt-len", type=int, default=None, help="default 256 (--quick: 32); "
                   "opt-1.3b uses 64 unless this is given")
    p.add_argument("--gen-len", type=int, default=None, help="default 32 (--quick: 8); "
                   "opt-1.3b uses 16 unless this is given")
    p.add_argument("--batch", type=int, default=None, help="prompts per run = GPU batch size "
                   "(default 4; --quick: 2)")
    p.add_argument("--warmup-gen-len", type=int, default=2,
                   help="tokens generated by the warm-up run (prefill + decode paths both run)")
    p.add_argument("--repeats", type=int, default=None,
                   help="measured runs per configuration, fastest reported (default: "
                        + ", ".join(f"{m} {v['repeats']}" for m, v in MODELS.items())
                        + "; --quick: 2)")
    p.add_argument("--max-others", type=float, default=0.10,
                   help="a run counts as quiet when other processes used at most this share "
                        "of the machine's CPU during it (default 0.10)")
    p.add_argument("--extra-runs", type=int, default=2,
                   help="more runs per configuration when none of the first was quiet")
    p.add_argument("--no-transformers", action="store_true",
                   help="skip the transformers reference (ratios become null)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    quick = a.quick
    models = a.models or (["smollm2-135m"] if quick else list(MODELS))
    policies = a.policies or (["all on device", "weights + cache in CPU memory"] if quick
                              else list(POLICIES))
    base = {"prompt_len": a.prompt_len or (32 if quick else 256),
            "gen_len": a.gen_len or (8 if quick else 32),
            "batch": a.batch or (2 if quick else 4)}
    if a.repeats is not None and a.repeats < 1:
        p.error("--repeats must be at least 1")
    if base["gen_len"] < 2:
        p.error("--gen-len must be at least 2 (decode throughput needs a decode step)")

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info(),
              "settings": {**base, "quick": quick, "models": models, "policies": policies,
                           "warmup_gen_len": a.warmup_gen_len, "seed": a.seed,
                           "max_others": a.max_others, "extra_runs": a.extra_runs,
                           "num_gpu_batches": 1, "sampling": "greedy",
                           "stop_token_id": None, "kv_policy": "full",
                           "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:])},
              "models": {}}

    plan = []
    for model in models:
        s = dict(base)
        reduced = []
        for key in ("prompt_len", "gen_len"):
            override = MODELS[model][key]
            given = getattr(a, key)
            if override is not None and given is None and not quick:
                reduced.append(f"{key.replace('_', '-')} {s[key]} -> {override}")
                s[key] = override
        s["reduced"] = ("; ".join(reduced) + " to keep a full run near 15 minutes on 2 CPU "
                        "cores") if reduced else None
        s["warmup_gen_len"] = min(a.warmup_gen_len, s["gen_len"])
        s["repeats"] = a.repeats or (2 if quick else MODELS[model]["repeats"])
        s["dtype"] = "float16" if torch.cuda.is_available() else "float32"
        result["models"][model] = {"settings": s, "rows": [], "transformers": None}
        plan += [(model, name) for name in policies]
        if not a.no_transformers:
            plan.append((model, None))

    started = time.perf_counter()
    bar = tqdm(plan, desc="configurations", unit="config")
    for model, name in bar:
        entry = result["models"][model]
        s = entry["settings"]
        bar.set_postfix_str(f"{model}: {name or 'transformers'}")
        retry = Retry(s["repeats"], a.max_others, a.extra_runs)
        if name is None:
            entry["transformers"] = run_transformers(model, s["prompt_len"], s["gen_len"],
                                                     s["batch"], retry, a.seed)
        else:
            row = run_policy(model, name, s["prompt_len"], s["gen_len"], s["batch"],
                             s["warmup_gen_len"], retry, a.seed)
            entry["model_bytes"] = row.pop("model_bytes")
            entry["cache_bytes"] = row.pop("cache_bytes")
            entry["rows"].append(row)
        gc.collect()
    bar.close()
    result["settings"]["wall_time_s"] = time.perf_counter() - started

    for entry in result["models"].values():
        hf = entry["transformers"]
        for row in entry["rows"]:
            if hf is not None:
                ratio = row["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
                row["ratio_vs_transformers"] = ratio

    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    md = out.with_suffix(".md")
    md.write_text(markdown(result))
    png = out.with_suffix(".png")
    made = bar_chart(result, png)
    print(md.read_text())
    print(f"wrote {out}, {md}" + (f", {png}" if made else " (no matplotlib: no chart)"))
    print(f"total {result['settings']['wall_time_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
