"""Command line: ``python -m flexgen_infinigen.run [--model M] [--percent ...] ...``."""
from __future__ import annotations

import argparse
import sys

from .api import OffloadedLM, check_lengths
from .cli.args import (
    add_model_args,
    add_policy_args,
    check_policy_args,
    check_sampling_args,
    policy_from_args,
    wants_plan,
    write_json,
)
from .cli.prompts import FILLER_TEXT, make_prompts, synthesize_prompts  # noqa: F401
from .cli.report import build_report, print_report
from .config import DEFAULT_MODEL, ConfigError, read_text
from .kv import kv_policy_from_args
from .pipeline.args import add_pipeline_args, check_pipeline_args
from .placement import Placement
from .guards import check_output_path, run_command
from .engine.loading import model_config


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
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print the tokens as they come (one prompt; default: on when the "
                        "output is a terminal and one prompt runs)")
    g.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    g = p.add_argument_group("mixture-of-experts placement")
    g.add_argument("--record-routing", default=None, metavar="FILE",
                   help="count how often each routed expert is read in this run and write the "
                        "counts (a routing profile, JSON) to FILE")
    g.add_argument("--experts-profile", default=None, metavar="FILE",
                   help="a routing profile from --record-routing: each layer's most-read "
                        "experts take the fastest tiers of --experts-percent")
    g.add_argument("--verbose", action="store_true",
                   help="also print the memory plan per tier and the time of every step")
    add_pipeline_args(p)
    return p


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
    check_output_path(a.record_routing, "--record-routing")
    check_policy_args(a)
    check_sampling_args(a)
    check_pipeline_args(a)
    if a.stream and (len(texts) > 1 or a.synthesize):
        raise ConfigError("--stream prints one prompt's tokens as they come; give one --prompt "
                          "(or drop --stream)")
    if a.dummy and (a.prompt or a.prompt_file):
        raise ConfigError("--dummy weights have no tokenizer; drop --prompt/--prompt-file and "
                          "use --prompt-len")
    if a.model is not None and not a.path:
        cfg = model_config(a.model, shapes_only=a.dummy)
        if not texts:
            check_lengths(cfg, a.prompt_len, a.gen_len)
    return texts


def _print_verbose(lm: OffloadedLM, gen) -> None:
    from .engine import memory_plan
    need = memory_plan.plan(lm.cfg, lm.policy, lm.engine.dtype, gen.prompt_tokens,
                            gen.generated_tokens, kv=lm.engine.kv_policy,
                            device=lm.engine.tiers.device, layouts=lm.weight_layouts)
    print("memory plan (bytes):")
    for what in ("weights", "kv_cache", "activations", "total"):
        print(f"  {what:<12}" + "".join(f"{t} {n / 1e9:8.3f} GB  "
                                         for t, n in need[what].items()))
    print("step times (s): " + " ".join(f"{t:.3f}" for t in gen.step_times))


class _StreamPrinter:
    """``--stream``: prints the one prompt's text to stdout as its tokens come."""

    def __init__(self, lm: OffloadedLM):
        from .text.incremental import TextStream
        self.text, self.stops = TextStream(lm.tokenizer), lm.stop_token_ids

    def __call__(self, first: int, tokens: list[int | None]) -> None:
        token = tokens[0]
        if token is not None and token not in self.stops:
            print(self.text.add(token), end="", flush=True)

    def finish(self) -> None:
        print(self.text.finish(), flush=True)


def planned_policy(a, model: str, texts: list[str]) -> tuple[Placement, dict]:
    """Run the optimizer for ``--percent auto`` / ``--gpu-batch-size auto`` before loading."""
    from .engine.loading import find_weights

    cfg, _, store = find_weights(model, a.path, a.dummy, a.seed, progress=True)
    prompt_len = a.prompt_len
    if texts and store is not None:
        from .text.tokenizer import load_tokenizer
        tok = load_tokenizer(store.path, cfg)
        if tok is not None:
            prompt_len = max(len(tok.encode(t)) for t in texts)
    check_lengths(cfg, prompt_len, a.gen_len)
    return policy_from_args(a, cfg, (prompt_len, a.gen_len))


def main(argv=None) -> int:
    return run_command(_main, argv)


def _main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    texts = check_args(a)  # --percent included: reported before the model is found
    if a.pipeline_stages > 1:
        from .pipeline.launch import run_pipeline
        return run_pipeline(a, texts)
    kv = kv_policy_from_args(a)
    sampling = check_sampling_args(a)
    model = a.model if (a.model or a.path) else DEFAULT_MODEL
    policy, plan = planned_policy(a, model, texts) if wants_plan(a) else policy_from_args(a)
    hint = None if texts else (a.prompt_len, a.gen_len)
    lm = OffloadedLM.load(model=model, path=a.path, dummy=a.dummy, policy=policy,
                          device=a.device, dtype=a.dtype, kv_policy=kv,
                          offload_dir=a.offload_dir, seed=a.seed, max_len_hint=hint,
                          expert_profile=a.experts_profile)
    with lm:
        if a.record_routing:
            if not lm.cfg.num_experts:
                raise ConfigError(f"--record-routing needs a mixture-of-experts model; "
                                  f"{lm.cfg.name} has no routed experts")
            lm.engine.routing_counts = {}
        prompts = make_prompts(lm, a, texts)
        stream = a.stream if a.stream is not None else \
            sys.stdout.isatty() and len(prompts) == 1 and lm.tokenizer is not None
        printer = _StreamPrinter(lm) if stream and lm.tokenizer is not None else None
        gen = lm.generate(prompts, a.gen_len, sampling,
                          stop_token_id=None if a.no_stop else -1,
                          cut_gen_len=a.cut_gen_len, progress=printer is None,
                          on_tokens=printer)
        if printer is not None:
            printer.finish()
        if a.record_routing:
            from .engine.routing_profile import save
            save(a.record_routing, lm.cfg, lm.engine.routing_counts)
        report = build_report(lm, gen, str(lm.tiers.device),
                              {"auto_plan": plan} if plan else None)
        if a.verbose:
            _print_verbose(lm, gen)
    print_report(report)
    write_json(a.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
