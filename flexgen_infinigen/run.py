"""Command line: ``python -m flexgen_infinigen.run [--model M] [--percent ...] ...``."""
from __future__ import annotations

import argparse
import json
import sys

from .api import OffloadedLM, check_lengths
from .config import DEFAULT_MODEL, ConfigError, read_text
from .guards import check_output_path, run_command
from .kv import add_kv_args, kv_policy_from_args
from .loading import model_config
from .offload_dir import offload_root
from .pipeline.args import add_pipeline_args, check_pipeline_args
from .policy import Policy
from .prompts import FILLER_TEXT, chat_prompts, synthesize_prompts  # noqa: F401 (re-exported)
from .report import build_report, print_report
from .sampling import SamplingConfig


def str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


def int_or_auto(v: str) -> int | str:
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or auto, got {v!r}") from None


def add_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("placement and schedule")
    g.add_argument("--percent", nargs="+", default=["100", "0", "100", "0", "100", "0"],
                   metavar="P",
                   help="six numbers WG WC CG CC HG HC: weights, KV cache and activations on GPU "
                        "/ CPU in percent, disk gets the rest (on a CPU-only machine 'GPU' is the "
                        "compute device); or 'auto' to let the optimizer choose")
    g.add_argument("--gpu-batch-size", type=int_or_auto, default=1, metavar="N|auto")
    g.add_argument("--num-gpu-batches", type=int_or_auto, default=None, metavar="N|auto",
                   help="default 1, or auto when --gpu-batch-size is auto")
    g.add_argument("--hw", default=None,
                   help="hardware profile for auto choices: a JSON from `python -m "
                        "flexgen_infinigen.profile` or a built-in name (default: this machine); "
                        "with --pipeline-stages, one for all ranks or one per rank, "
                        "comma-separated in rank order")
    g.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="prompt tokens a layer's MLP and attention take at a time (default: "
                        "the memory plan's choice, which keeps each chunk's temporaries near "
                        "256 MB); nothing prompt x prompt is ever held")
    g.add_argument("--host-in-place", type=str2bool, default=True,
                   help="CPU-only machines: read a KV cache held in CPU memory where it is "
                        "(default); false copies it every step as a GPU's link would (to "
                        "test or measure the transfer path without a GPU)")
    g.add_argument("--sep-layer", type=str2bool, default=True)
    g.add_argument("--pin-weight", type=str2bool, default=True)
    g.add_argument("--cpu-cache-compute", action="store_true")
    g.add_argument("--compress-weight", action="store_true")
    g.add_argument("--compress-cache", action="store_true")
    g.add_argument("--overlap", type=str2bool, default=None,
                   help="overlap transfers with compute (default: on with CUDA; on a CPU on when "
                        "anything is on disk, whose reads wait on the disk, and off otherwise, "
                        "where a copy thread only competes with compute for the cores)")
    g.add_argument("--direct-io", type=str2bool, default=False,
                   help="read the disk tier with O_DIRECT, bypassing the page cache (default "
                        "false: buffered reads measured faster on the machines we tried; see "
                        "the README's disk tier)")
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    g.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default: float16 on CUDA, float32 on CPU")
    g.add_argument("--offload-dir", default=None, help="folder for the disk tier (removed on exit)")
    add_kv_args(p)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help=f"a registry name (default {DEFAULT_MODEL}), a .gguf file or a Hugging "
                        "Face checkpoint folder (converted into the cache on first use)")
    g.add_argument("--path", default=None, help="a converted weight store folder")
    g.add_argument("--dummy", action="store_true", help="seeded random weights in true shapes")
    g.add_argument("--seed", type=int, default=0)


def parse_percent(values: list[str]) -> list[float] | None:
    """Six percentages, or None for ``--percent auto``."""
    if [v.lower() for v in values] == ["auto"]:
        return None
    if len(values) != 6:
        raise ConfigError(f"--percent takes six numbers (wg wc cg cc hg hc) or auto, "
                          f"got {len(values)} values")
    try:
        return [float(v) for v in values]
    except ValueError:
        raise ConfigError(f"--percent takes six numbers or auto, got {' '.join(values)}") from None


def wants_plan(a) -> bool:
    return "auto" in ([v.lower() for v in a.percent] + [a.gpu_batch_size, a.num_gpu_batches])


def policy_from_args(a, cfg=None, lengths: tuple[int, int] | None = None,
                     weight_reads: int = 1) -> tuple[Policy, dict | None]:
    """(policy, plan): the policy the flags give, or with ``auto`` anywhere the optimizer's
    choice for ``cfg`` at ``lengths`` = (prompt, generated) tokens and its prediction
    (``weight_reads``: see :func:`~.planner.auto.search`)."""
    percent = parse_percent(a.percent)
    switches = dict(overlap=a.overlap, sep_layer=a.sep_layer, pin_weight=a.pin_weight,
                    cpu_cache_compute=a.cpu_cache_compute, compress_weight=a.compress_weight,
                    compress_cache=a.compress_cache, direct_io=a.direct_io,
                    prefill_chunk=a.prefill_chunk, host_in_place=a.host_in_place)
    if not wants_plan(a):
        return Policy.from_percent(percent, gpu_batch_size=a.gpu_batch_size,
                                   num_gpu_batches=1 if a.num_gpu_batches is None
                                   else a.num_gpu_batches, **switches), None
    if cfg is None or lengths is None:
        raise ConfigError("auto placement needs the model and lengths; it is available in "
                          "`run`, or use `python -m flexgen_infinigen.optimize`")
    from .loading import resolve_device, resolve_dtype
    from .kv import policy_class
    from .planner.auto import check_possible, profile_for, search, summary

    policy_class(a.kv_policy, plannable=True)  # before a minute of profiling

    b = None if a.gpu_batch_size == "auto" else a.gpu_batch_size
    n = a.num_gpu_batches
    n = None if n == "auto" or (n is None and b is None) else (1 if n is None else n)
    item = resolve_dtype(a.dtype, resolve_device(a.device)).itemsize
    if a.hw is None:  # before a minute of profiling, what needs no profile
        check_possible(cfg, *lengths, item, a.offload_dir)
    hw = profile_for(a.hw, offload_dir=a.offload_dir)
    fraction = kv_policy_from_args(a).kv_fraction
    base = Policy(**switches)
    if percent is not None:
        base = Policy.from_percent(percent, **switches)
    best, _ = search(cfg, *lengths, hw, base, a.kv_policy, fraction, b, n, item,
                     fixed_placement=percent is not None, weight_reads=weight_reads)
    print(f"auto policy ({hw.name} profile): --percent {' '.join(map(str, best.percent()))} "
          f"--gpu-batch-size {best.policy.gpu_batch_size} --num-gpu-batches "
          f"{best.policy.num_gpu_batches}" + (" --cpu-cache-compute" if
                                               best.policy.cpu_cache_compute else "")
          + f"; predicted {best.prediction['throughput']:.2f} tokens/s")
    return best.policy, {"hardware": hw.name, "hardware_source": hw.source, **summary(best)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flexgen_infinigen.run",
                                description="Generate text with an offloaded model and report "
                                            "latency, throughput, memory and bytes moved.")
    add_model_args(p)
    add_policy_args(p)
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    g.add_argument("--prompt-file", default=None, help="a text file used as one prompt")
    g.add_argument("--prompt-len", type=int, default=None,
                   help="synthesize prompts of this many tokens (throughput runs; default 64 "
                        "when a model has no chat template)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each --prompt in the model's own chat template (default: on when "
                        "the model has one); with no prompt, ask an example question")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="synthesized prompts (default: one block of "
                        "gpu-batch-size x num-gpu-batches)")
    g.add_argument("--gen-len", type=int, default=32)
    g.add_argument("--cut-gen-len", type=int, default=None,
                   help="run only this many steps and project decode latency to --gen-len")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already in the sequence by this (> 1 "
                        "discourages repeats; 1 = off)")
    g.add_argument("--no-stop", action="store_true", help="ignore the end-of-sequence token")
    g.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    g.add_argument("--verbose", action="store_true",
                   help="also print the memory plan per tier and the time of every step")
    add_pipeline_args(p)
    return p


def check_policy_args(a) -> None:
    """Placement checks that need no weights (every command with policy flags runs them)."""
    parse_percent(a.percent)
    if a.offload_dir:
        offload_root(a.offload_dir)  # created, and checked writable, before any loading
    kv_policy_from_args(a).check_placement(a.cpu_cache_compute)


def check_args(a) -> list[str]:
    """Cheap checks that run before any weight is touched; returns the prompt texts given
    (``--prompt`` and ``--prompt-file``), empty when prompts are to be synthesized."""
    # synthesized prompts were asked for (a throughput run), rather than a chat
    a.synthesize = a.prompt_len is not None or a.num_prompts is not None or a.dummy
    a.prompt_len = 64 if a.prompt_len is None else a.prompt_len
    for flag, v in [("--gen-len", a.gen_len), ("--prompt-len", a.prompt_len),
                    ("--cut-gen-len", 1 if a.cut_gen_len is None else a.cut_gen_len)]:
        if v < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {v})")
    if a.num_prompts is not None and a.num_prompts < 1:
        raise ConfigError(f"--num-prompts must be at least 1 (got {a.num_prompts})")
    texts = list(a.prompt or [])
    if any(not t.strip() for t in texts):
        raise ConfigError("--prompt is empty; give some text (or drop --prompt to use "
                          "synthesized prompts of --prompt-len tokens)")
    if a.prompt_file:
        texts.append(read_text(a.prompt_file, "--prompt-file"))
    check_output_path(a.json, "--json")
    check_policy_args(a)
    check_pipeline_args(a)
    if a.dummy and (a.prompt or a.prompt_file):
        raise ConfigError("--dummy weights have no tokenizer; drop --prompt/--prompt-file and "
                          "use --prompt-len")
    if a.model is not None and not a.path:
        cfg = model_config(a.model)
        if not texts:
            check_lengths(cfg, a.prompt_len, a.gen_len)
    return texts


def _print_verbose(lm: OffloadedLM, gen) -> None:
    from . import memory_plan
    need = memory_plan.plan(lm.cfg, lm.policy, lm.engine.dtype, gen.prompt_tokens,
                            gen.generated_tokens, kv=lm.engine.kv_policy)
    print("memory plan (bytes):")
    for what in ("weights", "kv_cache", "activations", "total"):
        print(f"  {what:<12}" + "".join(f"{t} {n / 1e9:8.3f} GB  "
                                         for t, n in need[what].items()))
    print("step times (s): " + " ".join(f"{t:.3f}" for t in gen.step_times))


def planned_policy(a, model: str, texts: list[str]) -> tuple[Policy, dict]:
    """Run the optimizer for ``--percent auto`` / ``--gpu-batch-size auto`` before loading."""
    from .loading import find_weights

    cfg, _, store = find_weights(model, a.path, a.dummy, a.seed, progress=True)
    prompt_len = a.prompt_len
    if texts and store is not None:
        from .tokenizer import load_tokenizer
        tok = load_tokenizer(store.path, cfg)
        if tok is not None:
            prompt_len = max(len(tok.encode(t)) for t in texts)
    check_lengths(cfg, prompt_len, a.gen_len)
    return policy_from_args(a, cfg, (prompt_len, a.gen_len))


def make_prompts(lm: OffloadedLM, a, texts: list[str]) -> list[list[int]]:
    """Token ids of the run's prompts: the texts (through the chat template when the model
    has one), or synthesized prompts of ``--prompt-len`` tokens."""
    prompts = chat_prompts(lm, a, texts)
    if prompts is None and texts:
        prompts = lm.encode(texts)
    elif prompts is None:
        policy = lm.policy
        count = a.num_prompts or policy.block_size
        prompts = synthesize_prompts(lm, a.prompt_len, count, a.seed)
        print(f"running {count} synthesized prompts of {a.prompt_len} tokens (one block "
              f"of {policy.gpu_batch_size} x {policy.num_gpu_batches}; --num-prompts "
              "sets the count)", file=sys.stderr)
    return prompts


def main(argv=None) -> int:
    return run_command(_main, argv)


def _main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    texts = check_args(a)  # --percent included: reported before the model is found
    if a.pipeline_stages > 1:
        from .pipeline.launch import run_pipeline
        return run_pipeline(a, texts)
    kv = kv_policy_from_args(a)
    sampling = SamplingConfig(a.temperature, a.top_p, a.seed,
                              a.repetition_penalty).validate()
    model = a.model if (a.model or a.path) else DEFAULT_MODEL
    policy, plan = planned_policy(a, model, texts) if wants_plan(a) else policy_from_args(a)
    hint = None if texts else (a.prompt_len, a.gen_len)
    lm = OffloadedLM.load(model=model, path=a.path, dummy=a.dummy, policy=policy,
                          device=a.device, dtype=a.dtype, kv_policy=kv,
                          offload_dir=a.offload_dir, seed=a.seed, max_len_hint=hint)
    with lm:
        gen = lm.generate(make_prompts(lm, a, texts), a.gen_len, sampling,
                          stop_token_id=None if a.no_stop else -1,
                          cut_gen_len=a.cut_gen_len, progress=True)
        report = build_report(lm, gen, str(lm.tiers.device),
                              {"auto_plan": plan} if plan else None)
        if a.verbose:
            _print_verbose(lm, gen)
    print_report(report)
    write_json(a.json, report)
    return 0


def write_json(path: str | None, data: dict) -> None:
    """The ``--json FILE`` output of every command."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        print(f"written to {path}")


if __name__ == "__main__":
    sys.exit(main())
