"""The decode step's CPU kernels alone, at one step's shapes, on cold buffers: time per call
beside the bytes the call must read and this machine's read bandwidth.

    python benchmarks/decode_kernels.py                        # SmolLM2, batch 8 x 8,180
    PYTHONPATH=path/to/other/checkout python benchmarks/decode_kernels.py --tag before

Kernels, at SmolLM2-135M's shapes (30 layers, 3 KV heads of 64, 9 query heads):
``speculate_mass`` (InfiniGen's scoring and selection of one layer, its default 20%; with
keys of every column and of half of them), ``attend_rows`` (every cached row of one
layer), ``attend_indexed`` (20% of them, sorted, read where they are), and a step's linear
layers in float32 and in 4 bits (``linear``/``linear_q4``: every weight once). Inputs are
random (the selection's work depends on its scores: random scores are flatter than a real
model's, so this times its worst case). Each input set is several times the last-level
cache and the calls cycle through the sets, so every call reads from memory, as in a
decode step. Buffers of 32 MB or more ask for 2 MB pages, as the runtime's KV cache does.
Beside the bandwidth it records torch's float32 matrix product (2048 x 2048, from cache):
the arithmetic a linear layer's flops would need at that rate.

The kernels are whatever ``flexgen_infinigen`` imports: point ``PYTHONPATH`` at another
checkout to time its kernels with the same inputs, and compare the two tags' files. Writes
``decode_kernels_<tag>.json`` under ``--out-dir`` (default the temporary folder's
``flexgen_infinigen_investigations``: a kernel timing is an investigation, not a result
kept under ``benchmarks/results/``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
OUT = Path(tempfile.gettempdir()) / "flexgen_infinigen_investigations"
SETS = 6  # input sets cycled through: 6 x 100 MB of K and V is far past any cache here


def _big(*shape, dtype=torch.float32, generator=None) -> torch.Tensor:
    from flexgen_infinigen.memory.huge_pages import advise_huge_pages
    t = torch.empty(*shape, dtype=dtype)
    advise_huge_pages(t)
    if dtype.is_floating_point:
        t.normal_(generator=generator)
    else:
        t.random_(0, 256, generator=generator)
    return t


def _time(calls, repeats: int) -> float:
    """Median seconds of one call, cycling through ``calls`` (one per input set)."""
    for c in calls:
        c()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for c in calls:
            c()
        times.append((time.perf_counter() - start) / len(calls))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=8180)
    p.add_argument("--fraction", type=float, default=0.2, help="rows InfiniGen reads")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tag", default="after")
    p.add_argument("--out-dir", default=str(OUT), help="where the JSON goes")
    a = p.parse_args(argv)

    import flexgen_infinigen
    from long_context import read_bandwidth
    from machine import machine_info

    from flexgen_infinigen.kernels import cpu_kernels as ck
    from flexgen_infinigen.memory.codes import PackedWeight, compress
    try:  # the layers' own math (linear) moved to cpu_layers; older checkouts keep it here
        from flexgen_infinigen.kernels import layers as layers
    except ImportError:
        layers = ck

    if ck.library() is None:
        print("error: the CPU kernels did not build here (no C compiler?)", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    kv, group, d, t = 3, 3, 64, a.context
    cols = a.batch * kv
    n = int(a.fraction * t)
    rows = {}

    # InfiniGen's speculation: 4-bit keys (32 bytes, a minimum and a scale per row)
    codes = [_big(cols, t + 12, 32, dtype=torch.uint8, generator=g) for _ in range(SETS)]
    scale = [torch.rand(cols, t + 12, generator=g) * 0.05 + 0.01 for _ in range(SETS)]
    lo = [-torch.rand(cols, t + 12, generator=g) for _ in range(SETS)]
    q = torch.randn(cols, group, 2 * 32, generator=g)
    visible = torch.ones(a.batch, t, dtype=torch.bool)
    caps = torch.full((a.batch,), n)
    rows["speculate_mass"] = (_time([
        lambda i=i: ck.speculate_mass(codes[i], scale[i], lo[i], q, 4, visible, caps, n)
        for i in range(SETS)], a.repeats), cols * t * (32 + 8))
    half, qh = [c[..., :16].contiguous() for c in codes], q[..., :32].contiguous()
    rows["speculate_mass, half keys"] = (_time([  # keys of half the columns
        lambda i=i: ck.speculate_mass(half[i], scale[i], lo[i], qh, 4, visible, caps, n)
        for i in range(SETS)], a.repeats), cols * t * (16 + 8))

    # attention over every row, and over 20% of them, head-major [C, T, D] caches
    ks = [_big(cols, t, d, generator=g) for _ in range(SETS)]
    vs = [_big(cols, t, d, generator=g) for _ in range(SETS)]
    qa = torch.randn(cols, group, d, generator=g) * d ** -0.5
    bias = torch.zeros(cols, t)
    kr = [k.transpose(0, 1) for k in ks]  # the [T, C, D] view the runtime passes
    vr = [v.transpose(0, 1) for v in vs]
    rows["attend_rows"] = (_time([lambda i=i: ck.attend_rows(qa, kr[i], vr[i], bias)
                                  for i in range(SETS)], a.repeats), 2 * cols * t * d * 4)
    index = torch.stack([torch.sort(torch.randperm(t, generator=g)[:n]).values
                         for _ in range(cols)])
    counts = torch.full((cols,), n)
    k_new, v_new = torch.randn(cols, d), torch.randn(cols, d)
    rows["attend_indexed"] = (_time([
        lambda i=i: ck.attend_indexed(qa, kr[i], vr[i], index, counts, k_new, v_new)
        for i in range(SETS)], a.repeats), 2 * cols * n * d * 4)

    # a step's linear layers: 30 layers of SmolLM2 and the tied head, every weight once
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576),
              (576, 1536)] * 30 + [(49152, 576)]
    weights = [torch.randn(o, i, generator=g) * 0.05 for o, i in shapes]
    xs = {i: torch.randn(a.batch, i, generator=g) for i in (576, 1536)}
    rows["linear (a step)"] = (_time([lambda: [layers.linear(xs[w.shape[1]], w) for w in weights]],
                                     max(3, a.repeats // 2)),
                               sum(w.numel() for w in weights) * 4)
    packed = [PackedWeight(compress(w)) for w in weights]
    rows["linear_q4 (a step)"] = (_time([lambda: [layers.linear(xs[w.packed.shape[1]], w)
                                                  for w in packed]], max(3, a.repeats // 2)),
                                  sum(w.packed.nbytes for w in packed))

    bandwidth = read_bandwidth(1 << 30)
    square = torch.randn(2048, 2048, generator=g)  # the CPU's float32 arithmetic, from cache
    peak = 2 * 2048 ** 3 / _time([lambda: torch.mm(square, square)], a.repeats)
    flops = {"linear (a step)": 2 * a.batch * sum(o * i for o, i in shapes)}
    flops["linear_q4 (a step)"] = flops["linear (a step)"]
    result = {"machine": machine_info(), "tag": a.tag, "code": flexgen_infinigen.__file__,
              "batch": a.batch, "context": t, "fraction": a.fraction,
              "read_bandwidth_bytes_s": bandwidth, "matmul_peak_flops_s": peak,
              "kernels": {name: {"seconds": s, "bytes": b} for name, (s, b) in rows.items()}}
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, float32 matrix product (2048^2) "
          f"{peak / 1e9:.0f} GFLOP/s; kernels from {result['code']}")
    for name, (s, b) in rows.items():
        work = f", {flops[name] / s / 1e9:.0f} GFLOP/s (arithmetic alone " \
               f"{flops[name] / peak * 1e3:.1f} ms)" if name in flops else ""
        print(f"{name:20s} {1e3 * s:8.2f} ms  {b / 1e6:8.1f} MB  {b / s / 1e9:5.1f} GB/s  "
              f"({s / (b / bandwidth):.1f}x its read bound{work})")
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"decode_kernels_{a.tag}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
