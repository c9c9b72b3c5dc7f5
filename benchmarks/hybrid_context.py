"""Where a hybrid's decode step goes as the context grows: Qwen3-Next-80B-A3B's layers (three
Gated DeltaNet layers to one gated attention layer, in their real widths), a layer cut.

A DeltaNet layer reads and replaces a fixed state per row at each step, so its time should
not move with the context; an attention layer reads every cached row, so its time grows
with it. This runs the engine on seeded random weights (``--dummy``) at each context and
times each layer kind's token mixing at every decode step (the engine's own calls, wrapped),
beside the whole step. The cut replaces the routed experts by a dense MLP of the same
active width (10 experts of 512 and the shared expert: 5,632), which weighs the same at
every context and keeps the cut in memory.

    python benchmarks/hybrid_context.py --contexts 1024 4096 16384 --runs 2 \\
        --out benchmarks/results/hybrid_context --docs

Prints a table (``--json`` for one JSON object). With ``--out STEM`` the run is appended to
STEM.json's ``runs`` (``--fresh`` starts them anew), STEM.md and STEM.png are rewritten
from all of them, and ``--docs`` replaces the section of docs/results.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import artifacts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["layers", "context"]
HEADING = "## A hybrid's decode step against the context"


def cut_config(layers: int):
    from flexgen_infinigen.config import KNOWN_MODELS, get_config

    full = get_config("qwen3-next-80b-a3b")
    active = full.experts_per_token * full.expert_intermediate_size + full.shared_expert_size
    cfg = dataclasses.replace(
        full, name=f"qwen3-next-80b-a3b-cut{layers}", num_layers=layers,
        linear_layers=tuple(i for i in range(layers) if (i + 1) % 4),
        num_experts=0, experts_per_token=0, expert_intermediate_size=0,
        shared_expert_size=0, norm_topk_prob=False, intermediate_size=active)
    KNOWN_MODELS[cfg.name] = cfg  # --dummy weights by name
    return cfg


class MixerClock:
    """Seconds in each layer kind's token mixing during decode passes (the engine's
    ``StageCompute._attention``, which runs a DeltaNet layer's recurrence or attention)."""

    def __init__(self, cfg):
        from flexgen_infinigen.engine.stage_compute import StageCompute

        self.cfg, self.seconds = cfg, {"deltanet": 0.0, "attention": 0.0}
        original = StageCompute._attention
        clock = self

        def timed(compute, block, p, stage, batch, w, h, loaded):
            start = time.perf_counter()
            out = original(compute, block, p, stage, batch, w, h, loaded)
            if p.decode:
                kind = "deltanet" if cfg.is_linear(compute.stages[stage].layer) else "attention"
                clock.seconds[kind] += time.perf_counter() - start
            return out

        StageCompute._attention = timed

    def reset(self):
        self.seconds = {k: 0.0 for k in self.seconds}


def measure(lm, cfg, clock: MixerClock, context: int, steps: int) -> dict:
    torch.manual_seed(context)
    ids = torch.randint(10, cfg.vocab_size - 10, (1, context))
    batches = [(ids, torch.ones_like(ids, dtype=torch.bool))]
    clock.reset()
    times = []
    for i, step in enumerate(lm.engine.generate_block(batches, steps + 1,
                                                      lambda x, s, b: x.argmax(-1))):
        if i > 0:
            times.append(step.seconds)
    linear = len(cfg.linear_layers)
    attention = cfg.num_layers - linear
    step_ms = 1e3 * statistics.median(times)
    per = {k: 1e3 * v / steps for k, v in clock.seconds.items()}
    return {"layers": f"{linear} DeltaNet + {attention} attention", "context": context,
            "step_ms": step_ms, "deltanet_ms": per["deltanet"], "attention_ms": per["attention"],
            "deltanet_layer_ms": per["deltanet"] / linear,
            "attention_layer_ms": per["attention"] / attention,
            "deltanet_share": per["deltanet"] / (1e3 * sum(times) / steps),
            "attention_share": per["attention"] / (1e3 * sum(times) / steps)}


COLUMNS = [("step ms", "step_ms"), ("DeltaNet ms / layer", "deltanet_layer_ms"),
           ("attention ms / layer", "attention_layer_ms"),
           ("DeltaNet share", "deltanet_share"), ("attention share", "attention_share")]


def report(doc: dict, out: Path) -> str:
    runs = doc["runs"]
    text = "\n".join([HEADING[3:], "", artifacts.meta_line(runs), "",
                      "Each cell: median (min-max, N runs).", "",
                      artifacts.table(runs, KEYS, COLUMNS, fmt="{:.3g}")])
    out.with_suffix(".md").write_text(f"# {text}\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    rows = [r for run in runs for r in run["rows"]]
    contexts = sorted({r["context"] for r in rows})
    for key, label in (("deltanet_layer_ms", "a DeltaNet layer"),
                       ("attention_layer_ms", "an attention layer")):
        med = [statistics.median(r[key] for r in rows if r["context"] == c) for c in contexts]
        lo = [m - min(r[key] for r in rows if r["context"] == c) for m, c in zip(med, contexts)]
        hi = [max(r[key] for r in rows if r["context"] == c) - m for m, c in zip(med, contexts)]
        ax.errorbar(contexts, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms a decode step (median, min-max)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)
    return text


def write_docs(text: str, out: Path, results_md: Path) -> None:
    """Replace this benchmark's section of ``results_md`` (heading to the next ``## ``), or
    add it at the end."""
    rel = out.relative_to(results_md.parent.parent) if out.is_absolute() else out
    body = text.split("\n", 1)[1]
    section = (f"{HEADING}\n{body}\n\nArtifacts: `{rel.with_suffix('.json')}`, "
               f"`{rel.with_suffix('.png')}`.\n")
    page = results_md.read_text()
    if HEADING in page:
        start = page.index(HEADING)
        end = page.find("\n## ", start + len(HEADING))
        page = page[:start] + section + ("" if end < 0 else page[end:])
    else:
        page = page.rstrip("\n") + "\n\n" + section
    results_md.write_text(page)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="the cut's layers (every fourth is "
                   "attention; default 4)")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--steps", type=int, default=8, help="decode steps timed at each context")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--docs", nargs="?", const=str(ROOT / "docs" / "results.md"), default=None)
    a = p.parse_args()
    if a.layers < 4:
        p.error("--layers must be 4 or more (every fourth layer is the attention layer)")
    from flexgen_infinigen import OffloadedLM, Placement

    cfg = cut_config(a.layers)
    clock = MixerClock(cfg)
    rows = []
    with OffloadedLM.load(model=cfg.name, dummy=True, policy=Placement(), progress=False,
                          max_len_hint=(max(a.contexts), a.steps + 1)) as lm:
        for run in range(a.runs):
            for context in a.contexts:
                row = measure(lm, cfg, clock, context, a.steps)
                rows.append({**row, "run": run})
                if not a.json:
                    print(f"run {run} context {context}: step {row['step_ms']:.1f} ms, "
                          f"DeltaNet {row['deltanet_layer_ms']:.2f} ms/layer, "
                          f"attention {row['attention_layer_ms']:.2f} ms/layer", flush=True)
    if a.json:
        print(json.dumps({"config": cfg.name, "rows": rows}))
    if a.out is not None:
        meta = artifacts.run_meta(model=cfg.name, steps=a.steps)
        for run in range(a.runs):  # each repeat is a run of the artifact set
            doc = artifacts.append_run(a.out, {"meta": meta, "rows": [
                {k: v for k, v in r.items() if k != "run"} for r in rows if r["run"] == run]},
                fresh=a.fresh and run == 0, benchmark=__doc__.splitlines()[0])
        text = report(doc, a.out)
        if a.docs:
            write_docs(text, a.out, Path(a.docs))


if __name__ == "__main__":
    main()
