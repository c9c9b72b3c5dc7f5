"""Long-context accuracy: RULER-style retrieval (single needle, multi-key, multi-value,
variable tracking) at 4K-32K, every KV policy against the full cache and transformers.

    python benchmarks/long_context_accuracy.py --quick     # SmolLM2, 4K and 8K, 4 prompts each
    python benchmarks/long_context_accuracy.py             # SmolLM2, 4K and 8K, every policy
    python benchmarks/long_context_accuracy.py --model path/to/qwen2.5-coder-0.5b-instruct.gguf \\
        --lengths 4096 8192 16384 32768 --tag qwen

Prompts come from :mod:`flexgen_infinigen.retrieval_tasks` (seeded; filler from PG-19 and
WikiText-2 in ``../shared/data``, or ``--data-dir``), in plain completion form. Each prompt
goes through the real path (prefill, then greedy decode) and is scored by the share of its
answers found, as whole numbers or words, in the generated tokens. transformers' greedy
``generate`` on the same token ids (its own GGUF loader) is the full cache's reference.

Every (policy, prompt) result is appended to ``<out>.jsonl`` as it finishes, so an
interrupted run resumes where it stopped; the summary, table and plot are rebuilt from it.
A policy label is ``NAME`` or ``NAME@FRACTION``: ``infinigen@0.05`` reads at most 5% of the
cached tokens per KV head in its selecting layers, ``infinigen#1024`` at most 1,024 tokens
whatever the length (``--max-num-kv``), ``infinigen@0.05:L1`` selects from layer 1 on
(``--first-layer``; default 2); ``infinigen-pages@0.1`` chooses whole
pages of 16 tokens from page summaries (``--speculation-keys pages16``);
``infinigen-fp`` speculates with float keys of every column (only the query is guessed);
``infinigen-int8`` with 8-bit keys of every column (``--speculation-keys int8``);
``infinigen-half`` with 4-bit keys of half the skewed columns (``--partial-weight-ratio 0.5``);
``h2o@0.2`` keeps 10% heavy hitters and 10% recent tokens; ``full-4bit`` and
``infinigen-4bit`` store the cache in 4 bits (the runtime's groups of 64 channels of a token);
``kivi`` in 4 bits in KIVI's layout (keys per channel over 32 tokens, values per token, the
newest 128-159 tokens in float: ``--kv-policy kivi``); a ``-w4`` suffix (``infinigen@0.1-w4``) runs
the policy with 4-bit weights.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
OUT = ROOT / "benchmarks" / "results"

KINDS = ("full", "full-4bit", "infinigen", "infinigen-4bit", "infinigen-pages", "infinigen-fp",
         "infinigen-half", "infinigen-int8", "infinigen-renorm", "infinigen-own",
         "infinigen-own-int8", "oracle", "h2o", "kivi")
DEFAULT_POLICIES = ["full", "infinigen", "infinigen@0.1", "infinigen@0.05", "infinigen@0.02",
                    "infinigen-pages@0.1", "oracle@0.1", "oracle@0.05", "h2o@0.2", "h2o@0.1",
                    "full-4bit", "infinigen-4bit"]
QUICK_POLICIES = ["full", "infinigen", "h2o@0.2"]


def parse_policy(label: str):
    """``label`` -> (kv policy name, its options, 4-bit cache)."""
    from flexgen_infinigen.kv import InfiniGenOptions, SelectionOptions

    label = label.removesuffix("-w4")  # 4-bit weights: see weights_4bit
    label, _, first = label.partition(":L")  # the first layer that selects (default 2)
    kind, _, tokens = label.partition("#")  # a cap in tokens (--max-num-kv), no fraction
    kind, _, budget = kind.partition("@")
    if kind not in KINDS or (tokens and (budget or kind not in ("infinigen", "oracle"))):
        raise SystemExit(f"unknown policy {label!r}: use one of {', '.join(KINDS)}, "
                         "optionally @FRACTION, or infinigen#TOKENS / oracle#TOKENS")
    f = float(budget) if budget else None
    if kind.startswith("full"):
        return "full", {}, kind.endswith("4bit")
    if kind == "kivi":  # KIVI's 4-bit layout, groups of 32, at least 128 float tokens
        return "kivi", {}, False
    if kind == "h2o":
        f = f or 0.2
        return "h2o", {"hh_ratio": f / 2, "recent_ratio": f / 2}, False
    # a label keeps its meaning across runs (results are resumed by label): a fraction alone,
    # no floor in rows; without one, 0.18, the runtime's default before it became 4% with a
    # floor of 256 rows (2026-11-28; at these lengths the two read the same rows at 4%)
    opts = {"max_kv_fraction": 0.18 if f is None else f, "min_num_kv": 4}
    if tokens:
        opts = {"max_kv_fraction": 1.0, "max_num_kv": int(tokens), "min_num_kv": 4}
    if first:
        opts["first_layer"] = int(first)
    if kind == "oracle":
        return "oracle", {"options": SelectionOptions(**opts).validate()}, False
    if kind == "infinigen-pages":  # page summaries of 16 tokens, whole pages chosen
        opts["speculation_keys"] = "pages16"
    if kind == "infinigen-half":  # 4-bit speculation keys of half the (skewed) columns
        opts["partial_weight_ratio"] = 0.5
    if kind == "infinigen-int8":  # 8-bit speculation keys of every skewed column
        opts["speculation_keys"] = "int8"
    if kind == "infinigen-renorm":  # the rehearsal's input through the next layer's norm
        opts["speculation_query"] = "renorm"
    if kind in ("infinigen-own", "infinigen-own-int8"):  # each layer's own query, no guess
        opts["speculation_query"] = "own"
    if kind == "infinigen-own-int8":
        opts["speculation_keys"] = "int8"
    if kind == "infinigen-fp":  # float speculation keys, every column: only the query guessed
        opts.update(speculation_keys="partial", partial_weight_ratio=1.0)
    # without a named query it is the paper's, the runtime's default before it became auto
    opts.setdefault("speculation_query", "input")
    # select at every length (the speed default reads small layers whole: not what is measured)
    return "infinigen", {"options": InfiniGenOptions(select_from_mb=0.0, **opts).validate()}, \
        kind.endswith("4bit")


def weights_4bit(label: str) -> bool:
    """``LABEL-w4``: the same policy with the model's weights in 4 bits (``--compress-weight``),
    as the speed benchmark's fastest settings run."""
    return label.endswith("-w4")


def load_done(path: Path) -> dict:
    done = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                done[(row["policy"], row["sample"])] = row
    return done


def append(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _batches(samples, size):
    by_task: dict[str, list] = {}
    for s in samples:
        by_task.setdefault(s.task, []).append(s)
    for group in by_task.values():
        for i in range(0, len(group), size):
            yield group[i:i + size]


def _cut(tokens: list[int], stops: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1]
    return tokens


def _row(label, s, tokens, text, seconds, report=None) -> dict:
    from flexgen_infinigen.evals.retrieval_tasks import score

    return {"policy": label, "sample": s.key, "task": s.task, "length": s.length,
            "depth": s.depth, "seed": s.seed, "answers": s.answers, "tokens": tokens,
            "output": text, "score": score(text, s.answers), "seconds": seconds,
            "relative_kv_size": (report or {}).get("relative_kv_size", 1.0),
            "kv_fetch_fraction": (report or {}).get("kv_fetch_fraction", 1.0)}


def run_policies(a, model, samples, labels, done, path, bar, kept) -> None:
    """Every policy in ``labels`` on ``samples``: one load per cache format; each batch of
    prompts is prefilled once (``kept``, a PrefillCache) and every policy that needs no
    prompt queries decodes from that prefill."""
    from flexgen_infinigen import OffloadedLM, Placement
    from flexgen_infinigen.evals.retrieval_tasks import GEN_LEN
    from flexgen_infinigen.kv import make_kv_policy

    gen = max(GEN_LEN[s.task] for s in samples)
    length = samples[0].length
    for compress, w4 in ((False, False), (True, False), (False, True), (True, True)):
        group = [lab for lab in labels if parse_policy(lab)[2] == compress
                 and weights_4bit(lab) == w4
                 and any((lab, s.key) not in done for s in samples)]
        if not group:
            continue
        policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=a.batch,
                                     compress_cache=compress, compress_weight=w4)
        with OffloadedLM.load(model=model, policy=policy, max_len_hint=(length, gen),
                              progress=False) as lm:
            for label in group:
                kv, kw, _ = parse_policy(label)
                lm.use_kv_policy(make_kv_policy(kv, **kw))
                for batch in _batches([s for s in samples if (label, s.key) not in done],
                                      a.batch):
                    start = time.perf_counter()
                    out = lm.generate([s.ids for s in batch], batch[0].gen_len,
                                      prefill_cache=kept)
                    seconds = (time.perf_counter() - start) / len(batch)
                    report = lm.engine.kv_policy.report()
                    for s, tokens, text in zip(batch, out.token_ids, out.texts):
                        row = _row(label, s, tokens, text, seconds, report)
                        append(path, row)
                        done[(label, s.key)] = row
                    bar.update(len(batch))


def run_reference(a, gguf: Path, samples, tokenizer, stops, done, path, bar) -> None:
    """transformers' greedy generation from the same token ids."""
    import torch
    from transformers import AutoModelForCausalLM

    todo = [s for s in samples if ("transformers", s.key) not in done]
    if not todo:
        return
    model = _REFERENCE.get(gguf)  # loaded once for every round of a run
    if model is None:
        _REFERENCE.clear()
        model = _REFERENCE[gguf] = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    for batch in _batches(todo, a.batch):
        start = time.perf_counter()
        with torch.no_grad():
            ids = torch.tensor([s.ids for s in batch])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=batch[0].gen_len, min_new_tokens=1,
                                 pad_token_id=tokenizer.pad_token_id)
        seconds = (time.perf_counter() - start) / len(batch)
        for s, row in zip(batch, out[:, len(batch[0].ids):].tolist()):
            tokens = _cut(row, stops)
            r = _row("transformers", s, tokens, tokenizer.decode(tokens), seconds)
            append(path, r)
            done[("transformers", s.key)] = r
        bar.update(len(batch))


_REFERENCE: dict = {}


def rounds(samples, size: int):
    """``samples`` in rounds of at most ``size`` prompts: seed by seed, task by task (so the
    first rounds already cover every task), the depths of one task and seed together."""
    from flexgen_infinigen.evals.retrieval_tasks import TASKS

    order = sorted(samples, key=lambda s: (s.seed, TASKS.index(s.task), s.depth))
    chunk: list = []
    for s in order:
        if chunk and (len(chunk) == size or (chunk[0].seed, chunk[0].task) != (s.seed, s.task)):
            yield chunk
            chunk = []
        chunk.append(s)
    if chunk:
        yield chunk


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="registry name or .gguf / folder")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--tasks", nargs="+", default=None, help="default: all four")
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--seeds", type=int, default=1, help="prompts per task and depth")
    p.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES)
    p.add_argument("--batch", type=int, default=4, help="prompts per generate call")
    p.add_argument("--reference-gguf", default=None,
                   help="the GGUF transformers loads (default: --model when it is a .gguf, "
                        "the embedded SmolLM2 GGUF for the default model)")
    p.add_argument("--reference-max-length", type=int, default=16384,
                   help="longest prompt given to transformers (its attention at 32K may not fit)")
    p.add_argument("--data-dir", default=None, help="folder with pg19_firstbook.txt etc.")
    p.add_argument("--tag", default="smollm2")
    p.add_argument("--prefill-dir", default=None,
                   help="keep the prompts' prefills there (default: a temporary folder, "
                        "deleted at the end)")
    p.add_argument("--quick", action="store_true",
                   help="4K and 8K, depth 0.5, one prompt per task, full/infinigen/h2o")
    a = p.parse_args(argv)
    if a.quick:
        a.lengths, a.depths, a.seeds, a.policies = [4096, 8192], [0.5], 1, QUICK_POLICIES
    for label in a.policies:
        parse_policy(label)  # bad labels fail before any loading

    from long_context_accuracy_report import write_outputs
    from long_prompts import SHARED, source_text
    from tqdm.auto import tqdm

    from flexgen_infinigen.evals.retrieval_tasks import GEN_LEN, TASKS, Filler, make_samples
    from flexgen_infinigen.engine.loading import find_weights
    from flexgen_infinigen.text.tokenizer import load_tokenizer

    tasks = a.tasks or list(TASKS)
    _, _, store = find_weights(a.model, None, False, progress=True)
    gguf = a.reference_gguf or (a.model if a.model.endswith(".gguf") else None)
    if gguf is None and store.config.name == "smollm2-135m":
        from flexgen_infinigen.weights.embedded import default_cache_dir, default_gguf

        gguf = str(default_gguf(default_cache_dir()))  # the file the default store came from
    tokenizer = load_tokenizer(store.path, store.config)
    stops = {store.config.eos_token_id, *tokenizer.stop_token_ids}
    text, source = source_text(Path(a.data_dir) if a.data_dir else SHARED)
    filler = Filler(tokenizer, text)
    gen = max(GEN_LEN[t] for t in tasks)
    lengths = [min(n, store.config.max_positions - gen) for n in a.lengths]
    path = OUT / f"long_context_accuracy_{a.tag}.jsonl"
    done = load_done(path)
    plan = {n: make_samples(filler, tasks, n, a.depths, range(a.seeds)) for n in lengths}
    refs = [n for n in lengths if gguf and n <= a.reference_max_length]
    total = sum(len(v) for v in plan.values()) * len(a.policies) + \
        sum(len(plan[n]) for n in refs)
    total -= sum(1 for k in done if k[0] in a.policies + ["transformers"]
                 and any(k[1] == s.key for n in plan for s in plan[n]))
    print(f"{store.config.name}: {len(tasks)} tasks x {len(a.depths)} depths x {a.seeds} "
          f"seeds at {lengths}; filler: {source}; {len(done)} results already in {path}",
          flush=True)
    import shutil
    import tempfile

    from flexgen_infinigen.engine.prefill_cache import PrefillCache
    from flexgen_infinigen.weights.embedded import default_cache_dir

    folder = a.prefill_dir or tempfile.mkdtemp(prefix="prefills-", dir=default_cache_dir())
    try:
        with tqdm(total=max(total, 0), desc="prompts", unit="prompt") as bar:
            for n in lengths:
                # a round at a time (one seed of one task: ``--batch`` prompts), every policy
                # on it before the next, so a stopped run has whole rounds for all policies
                for chunk in rounds(plan[n], a.batch):
                    run_policies(a, a.model, chunk, a.policies, done, path, bar,
                                 PrefillCache(folder, keep=1))
                    if n in refs:
                        run_reference(a, Path(gguf), chunk, tokenizer, stops, done, path, bar)
    finally:
        if a.prefill_dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    # every result of this tag so far (runs with other lengths or depths add up)
    rows = list(done.values())
    summary = write_outputs(rows, OUT / f"long_context_accuracy_{a.tag}",
                            {"model": store.config.name, "filler": source, "tag": a.tag,
                             "tasks": sorted({r["task"] for r in rows}, key=TASKS.index),
                             "depths": sorted({r["depth"] for r in rows}),
                             "seeds": len({r["seed"] for r in rows}),
                             "lengths": sorted({r["length"] for r in rows}),
                             "policies": sorted({r["policy"] for r in rows}),
                             "reference": bool(refs)})
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
