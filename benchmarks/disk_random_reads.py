"""Random reads of small pieces from one large file, one at a time and several in flight:
what a disk gives a MoE step that reads its routed experts (each under 1 MB) from disk.

    sync; echo 3 > /proc/sys/vm/drop_caches   # as root: read the disk, not the page cache
    python benchmarks/disk_random_reads.py --file path/to/large.gguf --piece 884736

Prints MB/s for each thread count (a line each; ``--json`` for one JSON object).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor


def rate(fd: int, size: int, piece: int, reads: int, threads: int, seed: int) -> float:
    rng = random.Random(seed)
    offsets = [rng.randrange(0, size - piece) // 4096 * 4096 for _ in range(reads)]
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(len(b) for b in pool.map(lambda o: os.pread(fd, piece, o), offsets))
    return got / (time.perf_counter() - start) / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--file", required=True, help="a file much larger than the page cache holds")
    p.add_argument("--piece", type=int, default=884736, help="bytes a read (default: one "
                   "Qwen3-30B-A3B expert matrix's Q4_0 codes)")
    p.add_argument("--reads", type=int, default=200)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--json", action="store_true")
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


if __name__ == "__main__":
    main()
