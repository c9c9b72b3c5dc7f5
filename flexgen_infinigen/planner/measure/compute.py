"""Compute on the device and the host: matmuls, attention through the runtime's own
:func:`~flexgen_infinigen.attention.attend`, dequantization, copies and gathers in memory,
and the fixed cost of one small operator."""
from __future__ import annotations

import torch

from ...kernels.attention import attend, mask_bias
from ...memory.codes import compress, decompress
from .timing import rate_table, run_each, timed

MATMUL_ROWS = [1, 4, 16, 64, 256, 1024, 4096]


def matmul_table(dev: torch.device, dtype: torch.dtype, size: int,
                 working_set: int) -> dict[int, float]:
    """Achieved flop/s by rows m, cycling through enough weight matrices that they stream
    from memory as a model's weights do (one matrix would sit in the CPU's cache)."""
    item = torch.tensor([], dtype=dtype).element_size()
    count = max(1, working_set // (size * size * item))
    ws = [torch.randn(size, size, device=dev).to(dtype) for _ in range(count)]
    table = {}
    for m in MATMUL_ROWS:
        x = torch.randn(m, size, device=dev).to(dtype)
        reps = max(1, min(count, int(4e9 / (2 * m * size * size))))
        t = timed(lambda x=x, r=reps: run_each([(lambda w=w: x @ w, 0) for w in ws[:r]]), dev,
                  repeat=3) / reps
        table[m] = 2 * m * size * size / t
    return table


def attention_rates(dev: torch.device, dtype: torch.dtype, ws: int) -> dict[int, float]:
    """Decode attention (one query per sequence) through the runtime's own ``attend``."""
    item = torch.tensor([], dtype=dtype).element_size()
    b, kv, group, d = 4, 4, 2, 64

    def case(size):
        t = max(1, size // (2 * b * kv * d * item))
        q = torch.randn(b, 1, kv * group, d, device=dev).to(dtype)
        k = torch.randn(b, t, kv, d, device=dev).to(dtype)
        v = torch.randn_like(k)
        bias = torch.zeros(b, 1, 1, t, device=dev, dtype=dtype)
        return (lambda: attend(q, k, v, bias)), 2 * k.numel() * item

    return rate_table(case, dev, ws)


def prefill_attention_rates(dev: torch.device, dtype: torch.dtype, ws: int) -> dict[int, float]:
    """Prompt attention (scores, mask, softmax, weighted sum) through ``attend``, by the bytes
    of its float32 scores."""
    b, heads, d = 2, 8, 64

    def case(size):
        p = max(8, int((size / (4 * b * heads)) ** 0.5))
        q, k, v = (torch.randn(b, p, heads, d, device=dev).to(dtype) for _ in range(3))
        bias = mask_bias(torch.ones(b, p, dtype=torch.bool, device=dev), p, dtype)
        return (lambda: attend(q, k, v, bias)), 4 * b * heads * p * p

    return rate_table(case, dev, ws)


def dequant_rates(dev: torch.device, dtype: torch.dtype, ws: int) -> dict[int, float]:
    """4-bit decompression, by output bytes."""
    def case(size):
        x = torch.randn(max(1, size // (4 * 1024)), 1024, device=dev).to(dtype)
        packed = compress(x)
        return (lambda: decompress(packed)), x.numel() * x.element_size()

    return rate_table(case, dev, ws)


def device_copy_rates(dev: torch.device, ws: int) -> dict[int, float]:
    """Joining two segments of a tensor split across tiers (what a split read costs)."""
    def case(size):
        half = torch.randn(max(1, size // 8), device=dev)
        return (lambda: torch.cat([half, half])), 2 * half.numel() * 4

    return rate_table(case, dev, ws)


def host_gather_rates(ws: int) -> dict[int, float]:
    """A row gather on the host, as a selective KV fetch does before the link."""
    def case(size):
        rows = max(2, size // (4 * 256))
        src = torch.randn(rows, 256)
        index = torch.randperm(rows)[: rows // 2, None].expand(-1, 256).contiguous()
        out = torch.empty(index.shape)
        return (lambda: torch.gather(src, 0, index, out=out)), 2 * out.numel() * 4

    return rate_table(case, torch.device("cpu"), ws)


def op_overhead(dev: torch.device) -> float:
    """Seconds of one small operator (dispatch, and a kernel launch on a GPU)."""
    x = torch.randn(4, 64, device=dev)
    return timed(lambda: [x.add(1.0) for _ in range(200)], dev) / 200
