"""Pipeline parallelism: 1 against 2 stages on this CPU, and the cost model's OPT-175B on
4 and 8 GPUs.

Measured: OPT-1.3B (dummy weights, fp32, 5.3 GB) under a host-memory budget per process
(default 3.5 GB of weights): one process must leave a third of its weights on disk (read
with O_DIRECT, as a model that does not fit memory would be), while each of two stages holds
its half in memory. Each setting is one ``run --json`` (``torchrun --standalone`` for two
stages); reported: decode tokens/s, bytes per link summed over the ranks, bytes between
ranks, and each rank's time spent waiting for the other.

On paper: OPT-175B, prompt 512, 32 new tokens, on 1, 4 and 8 GPUs of the built-in
``t4-pcie3`` profile (FlexGen's machine: T4 16 GB, 208 GB of host memory per GPU), each
stage planned by the optimizer for its own layers (:func:`on_paper`; the embedding and head
counted on every stage, pessimistic by two small stages), against FlexGen's published
figures.

    python benchmarks/pipeline.py [--offload-dir DIR] [--budget-gb 3.5] [--gen-len 6]

Appends the run (its measured and its on-paper rows) to results/pipeline_cpu.json's ``runs``
(``--fresh`` starts them anew) and rewrites pipeline_cpu.md (median, min-max over the runs)
and .png from all of them; ``--report-only`` only rewrites those two. Run it alone (other
processes distort the timings).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import artifacts  # noqa: E402

OUT = HERE / "results" / "pipeline_cpu"
GB = 1e9
# FlexGen's published figure on this profile's machine (../shared/docs/flexgen.md): OPT-175B,
# one T4, prompt 512, 32 new tokens, generation throughput in tokens/s
FLEXGEN_ONE_T4 = {"fp16": 0.69, "4-bit": 1.12}
# FlexGen's paper, Table 3 (pipeline parallelism, OPT-175B, prompt 512, 32 new tokens, fp16,
# T4 GPUs), as quoted by a third-party summary: github.com/bzhng-development/
# summary-of-some-paper-in-cuda, docs/inference-optimization/FlexGen-High-
# ThroughputGenerativeInferenceofLargeLanguageMod.md (commit dae082bf); the paper itself is
# not readable on this offline machine. It gives no 8-GPU figure.
FLEXGEN_PIPELINE = {1: {"generation": 0.69, "decode": 0.83},
                    4: {"generation": 2.33, "decode": 3.86}}


def stage_weight_bytes(model: str, stages: int, item: int = 4) -> list[int]:
    """Weight bytes each rank places, under the split the run itself chooses."""
    from flexgen_infinigen.config import get_config
    from flexgen_infinigen.models import family_of
    from flexgen_infinigen.pipeline.partition import check_stages, split_layers

    cfg = get_config(model)
    check_stages(stages, cfg)
    shapes = family_of(cfg).weight_shapes(cfg)
    if stages == 1:
        from flexgen_infinigen.engine.stages import LayerSlice
        parts = [LayerSlice.whole(cfg)]
    else:  # the split is recomputed here with the run's default profile
        from flexgen_infinigen.pipeline.partition import stage_costs
        from flexgen_infinigen.planner.hardware import BUILTIN
        from flexgen_infinigen.placement import Placement
        parts = split_layers(cfg.num_layers, stages, *stage_costs(
            cfg, Placement(), 32, 6, item, BUILTIN["t4-pcie3"]))
    return [sum(math.prod(shapes[n]) * item for n in p.weight_names(cfg)) for p in parts]


def measure(stages: int, a) -> dict:
    """One run under the budget: the weight percent in memory that fits, the rest on disk."""
    per_rank = stage_weight_bytes(a.model, stages)
    keep = min(1.0, a.budget_gb * GB / max(per_rank))
    wg = math.floor(100 * keep)
    out = Path(tempfile.mkdtemp()) / "report.json"
    args = ["--model", a.model, "--dummy", "--percent", str(wg), "0", "100", "0", "100", "0",
            "--gpu-batch-size", str(a.batch), "--num-gpu-batches", str(a.gpu_batches),
            "--prompt-len", str(a.prompt_len), "--gen-len", str(a.gen_len), "--no-stop",
            "--direct-io", "true", "--offload-dir", a.offload_dir, "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // stages)))
    if stages == 1:
        cmd = [sys.executable, "-m", "flexgen_infinigen.run", *args]
    else:
        cmd = ["torchrun", "--standalone", "--nproc-per-node", str(stages), "-m",
               "flexgen_infinigen.run", *args, "--pipeline-stages", str(stages)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    r = json.loads(out.read_text())
    links = {link: sum(kinds.values()) for link, kinds in r["bytes_moved"].items()}
    pipe = r.get("pipeline")
    # what each rank placed in memory, from its own report (the split is the run's)
    placed = [sum(x["weights_by_tier_bytes"][t] for t in ("device", "host"))
              for x in pipe["ranks"]] if pipe else \
        [sum(r["weights_by_tier_bytes"][t] for t in ("device", "host"))]
    if max(placed) > a.budget_gb * GB * 1.01:
        print(f"warning: a rank placed {max(placed) / GB:.2f} GB in memory, over the "
              f"{a.budget_gb} GB budget (the run split the layers differently)", file=sys.stderr)
    return {"stages": stages, "weights_in_memory_percent": wg,
            "rank_weight_bytes": per_rank, "budget_bytes": a.budget_gb * GB,
            "rank_weight_bytes_in_memory": placed,
            "command": " ".join(cmd), "wall_s": time.perf_counter() - start,
            "decode_tokens_per_s": r["decode_throughput"],
            "total_tokens_per_s": r["total_throughput"],
            "decode_step_s": r["decode_latency_s"] / max(r["gen_len"] - 1, 1),
            "bytes_per_link": links,
            "between_ranks_bytes": pipe["between_ranks_bytes"] if pipe else 0,
            "waiting_s": [x["waiting_s"] for x in pipe["ranks"]] if pipe else [],
            "layers": [x["layers"] for x in pipe["ranks"]] if pipe else None}


def on_paper(gpus: int) -> dict:
    """Predicted OPT-175B throughput on ``gpus`` T4s, one stage each, as this runtime runs a
    pipeline: S = ``gpus`` micro-batches of n GPU batches of b sequences in flight. A stage
    is planned by the optimizer as a rank's ``--percent auto`` is: for its layers, the KV
    cache of all S x n GPU batches, and each offloaded weight read once per micro-batch
    (``weight_reads`` = S); the prefill fills and drains the pipeline (2S - 1 micro-batch
    prefills, S of which are the stage's own). The best (b, n) wins."""
    import dataclasses

    from flexgen_infinigen.config import ConfigError, get_config
    from flexgen_infinigen.planner.auto import search
    from flexgen_infinigen.planner.hardware import BUILTIN
    from flexgen_infinigen.placement import Placement

    cfg, hw = get_config("opt-175b"), BUILTIN["t4-pcie3"]
    layers = math.ceil(cfg.num_layers / gpus)
    mine = dataclasses.replace(cfg, num_layers=layers)
    best = None
    for n in (1, 2, 4, 8, 16) if gpus > 1 else (None,):
        try:
            plan, _ = search(mine, 512, 32, hw, Placement(), "full",
                             num_gpu_batches=None if n is None else gpus * n, progress=False,
                             weight_reads=gpus)
        except ConfigError:
            continue
        p, pred = plan.policy, plan.prediction
        step = pred["decode_step_s"]
        prefill = pred["prefill_s"] * (2 * gpus - 1) / gpus
        row = {"gpus": gpus, "layers_per_stage": layers, "percent": plan.percent(),
               "gpu_batch_size": p.gpu_batch_size,
               "gpu_batches_per_micro_batch": p.num_gpu_batches // gpus,
               "sequences_in_flight": p.block_size,
               "generation_tokens_per_s": p.block_size * 32 / (prefill + 31 * step),
               "decode_tokens_per_s": p.block_size / step, "stage_decode_step_s": step}
        if best is None or row["generation_tokens_per_s"] > best["generation_tokens_per_s"]:
            best = row
    return best


PUBLISHED_NOTE = ("FlexGen published: its paper's Table 3 (fp16, T4s, prompt 512, 32 new "
                  "tokens), as quoted by a third-party summary of the paper (the paper is not "
                  "readable on this offline machine); no 8-GPU figure is published. The "
                  "single-T4 row matches ../shared/docs/flexgen.md (0.69 tokens/s; 1.12 with "
                  "4-bit compression).")
KEYS = ["setting", "stages"]
# (header, field, format); a None format is a text field, shown as the latest run's
COLUMNS = [("placement", "placement", None),
           ("sequences in flight", "sequences_in_flight", None),
           ("generation tokens/s", "generation_tokens_per_s", "{:.3g}"),
           ("decode tokens/s", "decode_tokens_per_s", "{:.3g}"),
           ("decode step s", "decode_step_s", "{:.3g}"),
           ("disk->host GB", "disk_to_host_gb", "{:.3g}"),
           ("between ranks MB", "between_ranks_mb", "{:.3g}"),
           ("FlexGen published (generation, decode)", "flexgen_published", None)]


def measured_row(r: dict, a) -> dict:
    """The table's fields of one measured setting (``measure``'s dict, kept whole)."""
    return {**r, "setting": f"{a.model} (dummy, fp32), this CPU, {a.budget_gb:g} GB a process",
            "placement": f"{r['weights_in_memory_percent']} 0 100 0 100 0",
            "sequences_in_flight": a.batch * a.gpu_batches,
            "generation_tokens_per_s": r["total_tokens_per_s"],
            "disk_to_host_gb": r["bytes_per_link"]["disk->host"] / GB,
            "between_ranks_mb": r["between_ranks_bytes"] / 1e6}


def paper_row(r: dict) -> dict:
    """The table's fields of one on-paper setting (``on_paper``'s dict, kept whole)."""
    pub = FLEXGEN_PIPELINE.get(r["gpus"])
    return {**r, "setting": "opt-175b on T4s (cost model, t4-pcie3)", "stages": r["gpus"],
            "placement": " ".join(map(str, r["percent"])),
            "decode_step_s": r["stage_decode_step_s"],
            "flexgen_published": f"{pub['generation']}, {pub['decode']}" if pub else "-"}


def table(runs: list[dict]) -> str:
    """``artifacts.table`` with a format per column and text columns."""
    lines = ["| " + " | ".join([*KEYS, *(h for h, _, _ in COLUMNS)]) + " |",
             "|" + "---|" * (len(KEYS) + len(COLUMNS))]
    for key, rows in artifacts.grouped(runs, KEYS).items():
        cells = [str(k) for k in key]
        for _, f, fmt in COLUMNS:
            if fmt is None:
                text = [r[f] for r in rows if r.get(f) is not None]
                cells.append(str(text[-1]) if text else "")
            else:
                cells.append(artifacts.spread((r.get(f) for r in rows), fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(doc: dict) -> str:
    runs = doc["runs"]
    lines = ["# Pipeline parallelism", "", artifacts.meta_line(runs), "",
             "Measured: each run's settings are in its JSON entry (by default batch 4 x 2, "
             "prompt 32, 6 new tokens); weights beyond the host budget on disk, read with "
             "O_DIRECT. On paper: OPT-175B, prompt 512, 32 new tokens, T4 16 GB + 208 GB host "
             "per GPU (built-in `t4-pcie3`), each stage planned by the optimizer; placement and "
             "sequences in flight are the latest run's. Each cell: median (min-max, N runs).",
             "", table(runs), "", PUBLISHED_NOTE]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = artifacts.grouped(doc["runs"], KEYS)

    def med_err(rows, field):
        v = [r[field] for r in rows]
        m = statistics.median(v)
        return m, (m - min(v), max(v) - m)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    measured = [(k, rows) for k, rows in groups.items() if "weights_in_memory_percent"
                in rows[0]]
    for i, (_, rows) in enumerate(measured):
        m, e = med_err(rows, "decode_tokens_per_s")
        ax1.bar(i, m, yerr=[[e[0]], [e[1]]], capsize=4)
    ax1.set_xticks(range(len(measured)), [f"{k[1]} stage(s)\n{k[0].split(' (')[0]}"
                                          for k, _ in measured])
    ax1.set_ylabel("decode tokens/s (median, min-max over runs)")
    ax1.set_title("measured on this CPU")
    paper = [(k, rows) for k, rows in groups.items() if "gpus" in rows[0]]
    for field, mark, label in (("generation_tokens_per_s", "o-", "cost model (generation)"),
                               ("decode_tokens_per_s", "s-", "cost model (decode)")):
        ax2.plot([k[1] for k, _ in paper], [med_err(rows, field)[0] for _, rows in paper],
                 mark, label=label)
    for kind, mark in (("generation", "o"), ("decode", "s")):
        ax2.plot(list(FLEXGEN_PIPELINE), [v[kind] for v in FLEXGEN_PIPELINE.values()], mark,
                 color="gray", mfc="none", label=f"FlexGen published ({kind})")
    ax2.set_xlabel("T4 GPUs (one stage each)")
    ax2.set_ylabel("tokens/s")
    ax2.set_title("OPT-175B, prompt 512, 32 new tokens")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(doc: dict, out: Path) -> None:
    text = markdown(doc)
    out.with_suffix(".md").write_text(text)
    plot(doc, out.with_suffix(".png"))
    print(text)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="opt-1.3b")
    p.add_argument("--budget-gb", type=float, default=3.5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--gpu-batches", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=6)
    p.add_argument("--offload-dir", default=None)
    p.add_argument("--paper-only", action="store_true",
                   help="only the cost model's part (the measured rows of earlier runs stay)")
    p.add_argument("--out", type=Path, default=OUT,
                   help="STEM: this run is appended to STEM.json's runs; STEM.md and STEM.png "
                        "are rewritten from all of them")
    p.add_argument("--fresh", action="store_true", help="start STEM.json's runs anew")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: rewrite STEM.md and STEM.png from STEM.json")
    a = p.parse_args(argv)
    if a.report_only:
        write(artifacts.load(a.out), a.out)
        return
    a.offload_dir = a.offload_dir or tempfile.mkdtemp(prefix="pipeline_bench_")
    from machine import machine_info

    rows = []
    if not a.paper_only:
        for stages in (1, 2):
            row = measure(stages, a)
            print(json.dumps({k: v for k, v in row.items() if k != "command"}))
            rows.append(measured_row(row, a))
    rows += [paper_row(on_paper(g)) for g in (1, 4, 8)]
    meta = artifacts.run_meta(["benchmarks/pipeline.py", *(argv or sys.argv[1:])],
                              machine_info=machine_info())
    run = {"meta": meta, "rows": rows,
           "settings": {"model": a.model, "budget_gb": a.budget_gb, "batch": a.batch,
                        "gpu_batches": a.gpu_batches, "prompt_len": a.prompt_len,
                        "gen_len": a.gen_len, "paper_only": a.paper_only}}
    doc = artifacts.append_run(a.out, run, fresh=a.fresh,
                               benchmark=__doc__.splitlines()[0],
                               flexgen_published=FLEXGEN_PIPELINE,
                               flexgen_published_one_t4=FLEXGEN_ONE_T4,
                               published_note=PUBLISHED_NOTE)
    write(doc, a.out)


if __name__ == "__main__":
    main()
