"""The disk tier at the disk's speed: OPT-13B (dummy weights, bf16) with every weight on disk.

For each setting a fresh process loads the model, generates, and reports its decode step
times, the bytes each link moved, and its peak resident memory beside the planned host
memory. The same run measures the raw disk (sequential 16 MB reads of a 2 GB file, with
O_DIRECT and through the page cache) and the engine's own read path by read size (the
profile's ``disk_bandwidths``). Bounds:

* disk: weight bytes read per decode step / the profiled direct (or buffered) read rate;
* compute: the same step with the weights in memory, from OPT-13B's shapes at 4 and 8
  layers (what fits this machine's memory), extrapolated to 40 layers.

Also the KV cache on disk at a 4k context (SmolLM2-135M, batch 4; weights in memory).

    python benchmarks/disk_tier.py [--offload-dir DIR] [--quick]

Appends the run to results/disk_tier_cpu.json's ``runs`` (``--fresh`` starts them anew) and
rewrites disk_tier_cpu.md (median, min-max over the runs) and .png from all of them;
``--from-json`` only rewrites those two. Needs ~27 GB free in the offload folder and runs for
a long time; run it alone (other processes distort the timings).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import artifacts  # noqa: E402

OUT = HERE / "results" / "disk_tier_cpu"
GB = 1e9


def raw_disk(folder: str, size: int = 2 << 30, request: int = 16 << 20) -> dict:
    """Sequential cold reads of one file, as ``dd bs=16M [iflag=direct]`` would make them."""
    import mmap

    path = os.path.join(folder, "raw_disk_test.bin")
    block = os.urandom(request)
    with open(path, "wb") as f:
        for _ in range(size // request):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    buf = mmap.mmap(-1, request)  # page aligned, as O_DIRECT wants
    out = {}
    try:
        for name, flags in (("direct", os.O_DIRECT), ("buffered", 0)):
            fd = os.open(path, os.O_RDONLY | flags)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start, done = time.perf_counter(), 0
            while done < size:
                done += os.preadv(fd, [buf], done)
            out[name] = size / (time.perf_counter() - start)
            os.close(fd)
    finally:
        os.unlink(path)
    return out


def child(spec: dict) -> dict:
    """One setting, in this process: load, generate, report."""
    import torch

    from flexgen_infinigen import OffloadedLM, Placement
    from flexgen_infinigen.cli.prompts import synthesize_prompts
    from flexgen_infinigen.config import KNOWN_MODELS, get_config
    from flexgen_infinigen.engine.memory_plan import plan

    if spec.get("layers"):  # OPT-13B's shapes, fewer layers: what fits in memory
        cfg = dataclasses.replace(get_config(spec["model"]), num_layers=spec["layers"],
                                  name=f"{spec['model']}-{spec['layers']}l")
        KNOWN_MODELS[cfg.name] = cfg
        spec = {**spec, "model": cfg.name}
    policy = Placement.from_percent(spec["percent"], gpu_batch_size=spec["batch"],
                                 num_gpu_batches=spec["batches"], overlap=spec["overlap"],
                                 direct_io=spec["direct_io"])
    dtype = getattr(torch, spec["dtype"])
    with OffloadedLM.load(model=spec["model"], dummy=True, policy=policy, device="cpu",
                          dtype=spec["dtype"], offload_dir=spec["offload_dir"],
                          progress=False) as lm:
        prompts = synthesize_prompts(lm, spec["prompt_len"], policy.block_size, 0)
        lm.tiers.reset_counters()
        gen = lm.generate(prompts, spec["gen_len"], stop_token_id=None)
        moved = {k: sum(v.values()) for k, v in lm.tiers.bytes_moved.items()}
        weights_on_disk = lm.weight_bytes_by_tier()["disk"]
        planned = plan(lm.cfg, policy, dtype, spec["prompt_len"], spec["gen_len"])["total"]
        direct = lm.tiers.disk.direct_bytes
    decode = gen.step_times[1:]
    return {"step_times": gen.step_times, "decode_step_s": statistics.median(decode),
            "prefill_s": gen.step_times[0], "bytes_moved": moved,
            "prefill_link_bytes": gen.prefill_link_bytes, "direct_read_bytes": direct,
            "weights_on_disk": weights_on_disk,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "planned_host": planned["host"] + planned["device"],  # one memory on a CPU
            "tokens_per_step": policy.block_size}


def run(spec: dict) -> dict:
    line = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                          check=True, capture_output=True, text=True).stdout.splitlines()[-1]
    return {**spec, **json.loads(line)}


def settings(offload_dir: str, quick: bool) -> list[dict]:
    base = dict(model="opt-13b", dtype="bfloat16", offload_dir=offload_dir, prompt_len=16,
                gen_len=3, batch=1, batches=1, layers=None)
    on_disk = [0, 0, 100, 0, 100, 0]
    rows = [dict(base, name="weights on disk, direct I/O, overlap", percent=on_disk,
                 direct_io=True, overlap=True),
            dict(base, name="weights on disk, buffered, overlap", percent=on_disk,
                 direct_io=False, overlap=True),
            dict(base, name="weights on disk, direct I/O, no overlap", percent=on_disk,
                 direct_io=True, overlap=False)]
    if not quick:
        rows += [dict(base, name="weights on disk, buffered, no overlap", percent=on_disk,
                      direct_io=False, overlap=False),
                 dict(base, name="weights on disk, batch 8 x 4, direct I/O, overlap",
                      percent=on_disk, direct_io=True, overlap=True, batch=8, batches=4,
                      gen_len=2),
                 dict(base, name="weights on disk, batch 8 x 4, buffered, overlap",
                      percent=on_disk, direct_io=False, overlap=True, batch=8, batches=4,
                      gen_len=2)]
    compute = [dict(base, name=f"compute: {n} layers in memory, batch {b} x {k}",
                    percent=[100, 0, 100, 0, 100, 0],
                    direct_io=False, overlap=False, layers=n, batch=b, batches=k,
                    gen_len=3 if b == 1 else 2)
               for n in (4, 8) for b, k in ((1, 1),) + (() if quick else ((8, 4),))]
    kv = [dict(base, name=f"KV cache on disk at 4k, {io}", model="smollm2-135m",
               percent=[100, 0, 0, 0, 100, 0], direct_io=io == "direct I/O", overlap=True,
               prompt_len=4096, gen_len=4, batch=4)
          for io in ("direct I/O", "buffered")]
    return rows + compute + kv


def compute_bound(rows: list[dict], batch: int, batches: int) -> float | None:
    """Decode step seconds of OPT-13B with its weights in memory, from 4 and 8 layers."""
    got = {r["layers"]: r["decode_step_s"] for r in rows
           if r["layers"] and r["batch"] == batch and r["batches"] == batches}
    if len(got) < 2:
        return None
    per_layer = (got[8] - got[4]) / 4
    return got[4] + per_layer * (40 - 4)


def summarize(run: dict) -> None:
    """Per disk setting of one run: bytes a decode step reads from disk, the bound they give
    at the profiled direct-read rate (the goal's yardstick) and at the raw disk's, the compute
    bound, and the step against the larger bound."""
    rows, profiled = run["rows"], run["engine_read_by_size"]
    direct_bw = max(profiled["disk_read"].values())
    raw_bw = max(run["raw_disk"].values())
    for r in rows:
        r["setting"] = r["name"]
        r["tokens_per_s"] = r["tokens_per_step"] / r["decode_step_s"]
        r["peak_rss_gb"] = r["peak_rss"] / GB
        r["planned_gb"] = r["planned_host"] / GB
        if r["layers"]:
            continue
        steps = len(r["step_times"]) - 1
        # bytes read per decode step (OPT's tied embedding is read twice: embedding and head)
        per_step = (r["bytes_moved"]["disk->host"] - r["prefill_link_bytes"]["disk->host"]) \
            / steps
        r["disk_read_per_step"] = per_step
        r["disk_bound_s"] = per_step / direct_bw
        r["raw_disk_bound_s"] = per_step / raw_bw
        r["achieved_read_gb_per_s"] = per_step / statistics.mean(r["step_times"][1:]) / GB
        comp = compute_bound(rows, r["batch"], r["batches"]) if r["model"] == "opt-13b" else None
        r["compute_bound_s"] = comp
        r["step_over_bound"] = r["decode_step_s"] / max(r["disk_bound_s"], comp or 0.0)


KEYS = ["setting"]
COLUMNS = [("decode step s", "decode_step_s", "{:.3g}"),
           ("disk bound s", "disk_bound_s", "{:.3g}"),
           ("compute bound s", "compute_bound_s", "{:.3g}"),
           ("step / bound", "step_over_bound", "{:.2f}"),
           ("read GB/s", "achieved_read_gb_per_s", "{:.2f}"),
           ("tokens/s", "tokens_per_s", "{:.3g}"),
           ("peak RSS GB", "peak_rss_gb", "{:.1f}"),
           ("planned GB", "planned_gb", "{:.1f}")]


def table(runs: list[dict]) -> str:
    """``artifacts.table`` with a format per column."""
    return artifacts.table(runs, KEYS, COLUMNS)


def markdown(doc: dict) -> str:
    runs = doc["runs"]

    def rate(get):
        return artifacts.spread((get(r) / GB for r in runs), "{:.2f}")
    lines = ["# Disk tier", "", artifacts.meta_line(runs), "",
             "Raw disk (2 GB file, 16 MB sequential reads), GB/s: direct "
             f"{rate(lambda r: r['raw_disk']['direct'])}, buffered "
             f"{rate(lambda r: r['raw_disk']['buffered'])}. The engine's own read path at its "
             "best read size, GB/s: direct "
             f"{rate(lambda r: max(r['engine_read_by_size']['disk_read'].values()))}, buffered "
             f"{rate(lambda r: max(r['engine_read_by_size']['disk_buffered_read'].values()))}.",
             "", "Each cell: median (min-max, N runs). Disk bound: the bytes a decode step reads "
             "from disk over the engine's best direct-read rate. Compute bound: OPT-13B with its "
             "weights in memory, from 4 and 8 layers. Peak RSS is the process's whole life; "
             "planned: the memory plan's device + host.", "", table(runs)]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(k[0], rows) for k, rows in artifacts.grouped(
        doc["runs"], KEYS, where=lambda x: "disk_bound_s" in x).items()]
    fig, ax = plt.subplots(figsize=(9, 4))
    x = range(len(groups))

    def bar(offset, get, label):
        vals = [[get(r) for r in rows] for _, rows in groups]
        med = [statistics.median(v) for v in vals]
        err = [[m - min(v) for m, v in zip(med, vals)], [max(v) - m for m, v in zip(med, vals)]]
        ax.bar([i + offset for i in x], med, 0.4, yerr=err, label=label)
    bar(-0.2, lambda r: r["decode_step_s"], "decode step (median, min-max over runs)")
    bar(0.2, lambda r: max(r["disk_bound_s"], r["compute_bound_s"] or 0),
        "max(disk, compute) bound")
    ax.set_yscale("log")
    ax.set_xticks(list(x), [n.replace(", ", "\n") for n, _ in groups], fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title(f"weights (OPT-13B bf16) or KV cache (4k) on disk, CPU; "
                 f"{len(doc['runs'])} run(s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--offload-dir", default=str(HERE.parent / "offload_bench"))
    p.add_argument("--quick", action="store_true", help="fewer settings (no batch 8 x 4)")
    p.add_argument("--out", default=str(OUT),
                   help="STEM: this run is appended to STEM.json's runs; STEM.md and STEM.png "
                        "are rewritten from all of them")
    p.add_argument("--fresh", action="store_true", help="start STEM.json's runs anew")
    p.add_argument("--from-json", action="store_true",
                   help="measure nothing: recompute the summary, markdown and plot from --out's "
                        "JSON")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return 0
    out = Path(a.out)
    if a.from_json:
        doc = artifacts.load(out)
        for run_ in doc["runs"]:
            summarize(run_)
        artifacts.save(out, doc)
        write(doc, out)
        return 0
    import torch
    from tqdm.auto import tqdm

    from flexgen_infinigen.planner.measure.transfers import disk_bandwidths

    os.makedirs(a.offload_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=a.offload_dir) as tmp:
        raw = raw_disk(tmp)
    engine = disk_bandwidths(torch.device("cpu"), a.offload_dir, 1 << 30)
    rows = [run(s) for s in tqdm(settings(a.offload_dir, a.quick), desc="settings")]
    meta = artifacts.run_meta(["benchmarks/disk_tier.py", *(argv or sys.argv[1:])],
                              host=os.uname().nodename,
                              raw_disk_gb_s={k: v / GB for k, v in raw.items()})
    new = {"meta": meta, "rows": rows, "raw_disk": raw,
           "engine_read_by_size": engine["rates"], "disk_write_bw": engine["disk_write_bw"]}
    summarize(new)
    doc = artifacts.append_run(out, new, fresh=a.fresh, benchmark=__doc__.split("\n")[0])
    write(doc, out)
    return 0


def write(doc: dict, out: Path) -> None:
    text = markdown(doc)
    out.with_suffix(".md").write_text(text)
    plot(doc, out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    sys.exit(main())
