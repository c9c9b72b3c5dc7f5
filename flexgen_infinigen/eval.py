"""Command line: accuracy through the real decode path.

    python -m flexgen_infinigen.eval perplexity --text wiki.txt --seq-len 2048 \\
        --prefill-len 1024 --kv-policy infinigen --json out.json

Each window of ``--seq-len`` tokens: prefill the first ``--prefill-len``, then feed the rest
one token at a time through the decode path with the KV policy active (teacher forcing)
and score every next token.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
from tqdm.auto import tqdm

from .cli.args import add_model_args, add_policy_args, policy_from_args, write_json
from .config import DEFAULT_MODEL, ConfigError, get_config, read_text
from .evals.metrics import teacher_forced_nll
from .kv import kv_policy_from_args
from .guards import check_output_path, run_command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flexgen_infinigen.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="task", required=True)
    ppl = sub.add_parser("perplexity", help="teacher-forced perplexity over text windows")
    add_model_args(ppl)
    add_policy_args(ppl)
    g = ppl.add_argument_group("perplexity")
    g.add_argument("--text", required=True, help="a UTF-8 text file")
    g.add_argument("--seq-len", type=int, default=2048)
    g.add_argument("--prefill-len", type=int, default=1024)
    g.add_argument("--max-windows", type=int, default=None)
    g.add_argument("--json", default=None, metavar="FILE")
    return p


def check_args(a) -> tuple[list[int], object]:
    """Every check that needs no weights: the text, the lengths, and the window count.

    Returns the text's token ids and the model's config."""
    text = read_text(a.text, "--text")
    if a.prefill_len < 1:
        raise ConfigError(f"--prefill-len must be at least 1 (got {a.prefill_len})")
    if a.prefill_len >= a.seq_len:
        raise ConfigError(f"--prefill-len ({a.prefill_len}) must be below --seq-len "
                          f"({a.seq_len}) so that some tokens are decoded")
    if a.max_windows is not None and a.max_windows < 1:
        raise ConfigError(f"--max-windows must be at least 1 (got {a.max_windows})")
    if a.dummy:
        raise ConfigError("perplexity needs a tokenizer; drop --dummy")
    from .weights.local_model import is_model_path, store_for
    if is_model_path(a.model) and not a.path:  # a GGUF or HF folder: converted on first use
        a.path, a.model = str(store_for(a.model)), None
    if a.path:
        from .weights.store import WeightStore
        store_path = a.path
        cfg = WeightStore(a.path).config
    else:
        cfg = get_config(a.model or DEFAULT_MODEL)
        if cfg.name != DEFAULT_MODEL:
            raise ConfigError(f"no weights for {cfg.name}: pass --model with a .gguf file or "
                              "a Hugging Face folder, or --path to a converted store")
        from .weights.embedded import default_model_store
        store_path = default_model_store()
    if a.seq_len > cfg.max_positions:
        raise ConfigError(f"--seq-len {a.seq_len} is over {cfg.name}'s maximum of "
                          f"{cfg.max_positions} positions; lower it")
    from .text.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(store_path, cfg)
    if tokenizer is None:
        raise ConfigError(f"the store at {store_path} has no tokenizer; perplexity needs one")
    ids = tokenizer.encode(text)
    if len(ids) < a.seq_len:
        raise ConfigError(f"--text has {len(ids)} tokens, fewer than one window of "
                          f"--seq-len {a.seq_len}; give a longer text or a shorter window")
    return ids, cfg


def perplexity(a) -> dict:
    from .api import OffloadedLM

    ids, cfg = check_args(a)
    policy, _ = policy_from_args(a, cfg, (a.prefill_len, a.seq_len - a.prefill_len))
    kv = kv_policy_from_args(a)
    lm = OffloadedLM.load(model=a.model or (None if a.path else DEFAULT_MODEL), path=a.path,
                          policy=policy, device=a.device, dtype=a.dtype, kv_policy=kv,
                          offload_dir=a.offload_dir, seed=a.seed,
                          max_len_hint=(a.prefill_len, a.seq_len - a.prefill_len))
    with lm:
        count = len(ids) // a.seq_len
        count = min(count, a.max_windows or count)
        nll, fractions, per_layer = [], [], []
        for w in tqdm(range(count), desc="windows", unit="window"):
            window = ids[w * a.seq_len:(w + 1) * a.seq_len]
            nll.append(teacher_forced_nll(lm, [window[:a.prefill_len]],
                                          [window[a.prefill_len:]])[0])
            report = lm.engine.kv_policy.report()
            fractions.append((report.get("relative_kv_size", 1.0),
                              report.get("relative_kv_size_speculative"),
                              report.get("kv_fetch_fraction", 1.0)))
            per_layer.append(report.get("kv_selected_fraction_per_layer",
                                        [1.0] * lm.cfg.num_layers))
        all_nll = torch.cat(nll)
        return {
            "perplexity": math.exp(all_nll.mean().item()),
            "mean_nll": all_nll.mean().item(),
            # rows attention used over rows cached: all layers (those reading everything at
            # 1.0), the selecting layers only (the InfiniGen paper's count), rows moved
            "relative_kv_size": sum(f[0] for f in fractions) / len(fractions),
            "relative_kv_size_speculative": None if fractions[0][1] is None
            else sum(f[1] for f in fractions) / len(fractions),
            "kv_fetch_fraction": sum(f[2] for f in fractions) / len(fractions),
            "relative_kv_size_per_layer": [sum(col) / len(col) for col in zip(*per_layer)],
            "windows": count, "tokens_scored": int(all_nll.numel()),
            "model": lm.cfg.name, "kv_policy": lm.engine.kv_policy.report(),
            "settings": {k: v for k, v in vars(a).items() if k != "task"},
        }


def main(argv=None) -> int:
    return run_command(_main, argv)


def _main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    check_output_path(a.json, "--json")
    result = perplexity(a)
    print(f"perplexity {result['perplexity']:.3f} over {result['tokens_scored']} tokens in "
          f"{result['windows']} windows; relative KV size {result['relative_kv_size']:.3f} "
          f"({result['kv_policy']['kv_policy']})")
    write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
