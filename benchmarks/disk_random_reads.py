"""Random reads of small pieces from one large file, one at a time and several in flight:
what a disk gives a MoE step that reads its routed experts (each under 1 MB) from disk.

    sync; echo 3 > /proc/sys/vm/drop_caches   # as root: read the disk, not the page cache
    python benchmarks/disk_random_reads.py --file path/to/large.gguf --piece 884736

Prints MB/s for each thread count (a line each; ``--json`` for one JSON object). With
``--out STEM`` the run is also appended to STEM.json's ``runs`` (``--fresh`` starts them
anew), and STEM.md (median, min-max over the runs) and STEM.png are rewritten from all of them.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import artifacts  # noqa: E402

KEYS = ["piece KB", "reads in flight"]


def rate(fd: int, size: int, piece: int, reads: int, threads: int, seed: int) -> float:
    rng = random.Random(seed)
    offsets = [rng.randrange(0, size - piece) // 4096 * 4096 for _ in range(reads)]
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(len(b) for b in pool.map(lambda o: os.pread(fd, piece, o), offsets))
    return got / (time.perf_counter() - start) / 1e6


def report(doc: dict, out: Path) -> str:
    """The markdown table and the plot of every run in ``doc``; returns the markdown."""
    runs = doc["runs"]
    text = "\n".join(["# Random reads of small pieces", "", artifacts.meta_line(runs), "",
                      "Each cell: median (min-max, N runs).", "",
                      artifacts.table(runs, KEYS, [("MB/s", "mb_per_s")], fmt="{:.0f}")])
    out.with_suffix(".md").write_text(text)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    by_piece: dict = {}
    for (piece, threads), rows in artifacts.grouped(runs, KEYS).items():
        by_piece.setdefault(piece, []).append(
            (threads, [r["mb_per_s"] for r in rows]))
    for piece, points in by_piece.items():
        med = [statistics.median(v) for _, v in points]
        err = [[m - min(v) for m, (_, v) in zip(med, points)],
               [max(v) - m for m, (_, v) in zip(med, points)]]
        ax.errorbar([t for t, _ in points], med, yerr=err, marker="o", capsize=3,
                    label=f"{piece} KB pieces")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("reads in flight")
    ax.set_ylabel("MB/s (median, min-max over runs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", required=True, help="a file much larger than the page cache holds")
    p.add_argument("--piece", type=int, default=884736, help="bytes a read (default: one "
                   "Qwen3-30B-A3B expert matrix's Q4_0 codes)")
    p.add_argument("--reads", type=int, default=200)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, default=None,
                   help="STEM: append this run to STEM.json's runs and rewrite STEM.md and "
                        "STEM.png from all of them")
    p.add_argument("--fresh", action="store_true", help="start STEM.json's runs anew")
    a = p.parse_args()
    size = os.path.getsize(a.file)
    if size < 2 * a.piece:
        p.error(f"--file {a.file} is smaller than two pieces; pass a large file")
    fd = os.open(a.file, os.O_RDONLY)
    try:  # a new seed per thread count: no piece is read twice from the cache
        out = {t: rate(fd, size, a.piece, a.reads, t, seed=t) for t in a.threads}
    finally:
        os.close(fd)
    if a.json:
        print(json.dumps({"file": a.file, "piece": a.piece, "mb_per_s": out}))
    else:
        for t, r in out.items():
            print(f"{t} threads: {r:.0f} MB/s")
    if a.out is not None:
        rows = [{"piece KB": round(a.piece / 1000), "reads in flight": t, "piece_bytes": a.piece,
                 "reads": a.reads, "mb_per_s": r} for t, r in out.items()]
        meta = artifacts.run_meta(file=a.file, file_bytes=size)
        doc = artifacts.append_run(a.out, {"meta": meta, "rows": rows}, fresh=a.fresh,
                                   benchmark=__doc__.splitlines()[0])
        report(doc, a.out)


if __name__ == "__main__":
    main()
