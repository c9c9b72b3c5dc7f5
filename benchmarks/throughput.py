"""Decode throughput and bytes moved per token for several offloading policies.

For each model and policy: load the model, run one warm-up generation, reset the byte
counters, run the measured generation (``stop_token_id=None`` so every row generates
exactly ``gen_len`` tokens) and record decode tokens/s, prefill latency, bytes moved per
generation step by link and kind, and peak memory per tier. Hugging Face transformers'
``generate`` on the same machine, model and lengths is the reference.

    python benchmarks/throughput.py            # full run: both models, every policy
    python benchmarks/throughput.py --quick    # smoke configuration (about 10 seconds)

Each run is appended to the ``runs`` list of ``--out`` (``--fresh`` starts it anew); the
markdown table (medians over every run) and the chart are rebuilt from all runs
(``throughput_report.py``, or ``--report-only``). See benchmarks/README.md for what each
column means.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from artifacts import append_run, load, run_meta  # noqa: E402
from machine import Retry, machine_info, repeat_until_quiet  # noqa: E402
from throughput_report import write_outputs  # noqa: E402

from flexgen_infinigen import OffloadedLM, Placement  # noqa: E402
from flexgen_infinigen.cli.report import build_report  # noqa: E402
from flexgen_infinigen.config import get_config  # noqa: E402
from flexgen_infinigen.run import synthesize_prompts  # noqa: E402
from flexgen_infinigen.engine.loading import find_weights  # noqa: E402
from flexgen_infinigen.memory.tiers import KINDS, LINKS, TIERS  # noqa: E402
from flexgen_infinigen.text.tokenizer import load_tokenizer  # noqa: E402

DEFAULT_OUT = HERE / "results" / "throughput_cpu.json"

# name -> (percent WG WC CG CC HG HC, extra Placement switches)
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


# ---- our runtime ------------------------------------------------------------------------------
def run_policy(model: str, name: str, prompt_len: int, gen_len: int, batch: int,
               warmup_gen_len: int, retry: Retry, seed: int) -> dict:
    """Load, warm up, then the measured generations; the fastest quiet one is reported."""
    percent, switches = POLICIES[name]
    policy = Placement.from_percent(percent, gpu_batch_size=batch, num_gpu_batches=1, **switches)
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

        runs, usable = repeat_until_quiet(one_run, retry)
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


def hf_opt(name: str, seed: int):
    """OPTForCausalLM in the shapes of our config for ``name``, with seeded random weights."""
    from transformers import OPTConfig, OPTForCausalLM
    c = get_config(name)
    hf_cfg = OPTConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                       num_hidden_layers=c.num_layers, ffn_dim=c.intermediate_size,
                       num_attention_heads=c.num_heads, max_position_embeddings=c.max_positions,
                       word_embed_proj_dim=c.embed_dim,
                       do_layer_norm_before=c.do_layer_norm_before,
                       tie_word_embeddings=c.tie_word_embeddings, pad_token_id=c.pad_token_id,
                       bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    torch.manual_seed(seed)
    return OPTForCausalLM(hf_cfg).float().eval()


def hf_prompts(model: str, prompt_len: int, batch: int, seed: int) -> torch.Tensor:
    """The token ids our runtime is given: ``synthesize_prompts`` on the config and tokenizer
    that ``OffloadedLM.load`` finds for the model, without placing any weights."""
    load = MODELS[model]["load"]
    cfg, _, store = find_weights(load["model"], None, load.get("dummy", False), seed,
                                 progress=False)
    tokenizer = load_tokenizer(store.path, cfg) if store is not None else None
    prompts = synthesize_prompts(SimpleNamespace(cfg=cfg, tokenizer=tokenizer), prompt_len,
                                 batch, seed)
    return torch.tensor(prompts)


def run_transformers(model: str, prompt_len: int, gen_len: int, batch: int, retry: Retry,
                     seed: int) -> dict:
    """decode tokens/s = batch * (gen_len - 1) / (time(gen_len tokens) - time(1 token)).

    Each of the two times is the best quiet one of ``retry.repeats`` (or more) runs, after
    one warm-up generation.
    """
    start = time.perf_counter()
    hf = hf_smollm2() if model == "smollm2-135m" else hf_opt(model, seed)
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
    ones, ones_ok = repeat_until_quiet(lambda: {"s": timed(1)}, retry)
    fulls, fulls_ok = repeat_until_quiet(lambda: {"s": timed(gen_len)}, retry)
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
    p.add_argument("--fresh", action="store_true",
                   help="start the JSON's runs list anew instead of appending this run")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the markdown and the chart from the JSON's runs; measure nothing")
    a = p.parse_args(argv)
    out = Path(a.out).with_suffix(".json")
    if a.report_only:
        written = write_outputs(load(out), out)
        print("wrote " + ", ".join(map(str, written)))
        return 0
    if not a.fresh:
        try:  # a JSON written before runs were appended stops here, not after the runs
            load(out)
        except ValueError as e:
            p.error(f"{e} (or pass --fresh)")

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

    rows = []
    for model, entry in result["models"].items():
        st = entry["settings"]
        shape = {"model": model, "batch": st["batch"], "prompt_len": st["prompt_len"],
                 "gen_len": st["gen_len"]}
        rows += [{**shape, **row, "model_bytes": entry.get("model_bytes"),
                  "cache_bytes": entry.get("cache_bytes")} for row in entry["rows"]]
        if entry["transformers"] is not None:
            rows.append({**shape, **entry["transformers"]})
    run = {"meta": run_meta(machine=result["machine"]),
           "settings": {**result["settings"],
                        "models": {m: e["settings"] for m, e in result["models"].items()}},
           "rows": rows}
    doc = append_run(out, run, fresh=a.fresh, device=result["machine"]["device_name"],
                     benchmark="throughput.py: decode throughput and bytes moved per "
                     "offloading policy, against transformers' generate")
    written = write_outputs(doc, out)
    print(out.with_suffix(".md").read_text())
    print("wrote " + ", ".join(map(str, [out, *written])))
    print(f"total {result['settings']['wall_time_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
