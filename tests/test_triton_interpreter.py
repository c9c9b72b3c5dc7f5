"""The package's Triton kernel (memory.mapped_rows: chosen K/V rows read by index from host
memory) run by Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, against torch:
rows at the edges of the cache, heads with every count from none to all (a GQA batch's
columns), head sizes that fill and do not fill a power of two, float32, float16 and bfloat16.
Skipped where ``triton`` is not installed."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from flexgen_infinigen.memory import mapped_rows  # noqa: E402


@pytest.fixture()
def interpreted(monkeypatch):
    """The kernel built under the interpreter (and forgotten after, for a real device)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(mapped_rows, "_kernel", None)
    yield
    mapped_rows._kernel = None


def _reference(src, index, counts, cols):
    out = src[index].clone()
    rank = torch.arange(index.shape[0]) // cols
    out[rank >= counts[torch.arange(index.shape[0]) % cols]] = 0
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols,d", [(1, 64), (4, 64), (6, 80), (8, 128)],
                         ids=["one-head", "gqa-4", "odd-d", "eight"])
def test_chosen_rows_equal_torch(interpreted, dtype, cols, d):
    g = torch.Generator().manual_seed(cols * d)
    tokens, rank = 37, 5
    src = torch.randn(tokens * cols, d, generator=g).to(dtype)
    # each column's chosen rows of its own stripe, the first and the last row among them
    index = torch.randint(0, tokens * cols, (rank * cols,), generator=g)
    index[0], index[-1] = 0, tokens * cols - 1
    counts = torch.tensor([(c * 3) % (rank + 1) for c in range(cols)], dtype=torch.int64)
    counts[-1] = rank  # one column reads all its rows, another (if any) none
    out = torch.full((rank * cols, d), 7.0).to(dtype)  # stale values: all overwritten
    mapped_rows.launch(src, index, counts, cols, out)
    assert torch.equal(out, _reference(src, index, counts, cols))


def test_the_cpu_call_reads_what_the_kernel_reads_where_it_reads(interpreted):
    """On a CPU, ``gather`` is ``index_select`` over every row; the kernel's rows within each
    column's count are the same rows."""
    src = torch.randn(40, 32)
    index = torch.randint(0, 40, (12,))
    counts = torch.tensor([3, 2, 1, 0])
    by_kernel = torch.empty(12, 32)
    mapped_rows.launch(src, index, counts, 4, by_kernel)
    on_cpu = torch.empty(12, 32)
    mapped_rows.gather(src, index, counts, 4, on_cpu)
    kept = (torch.arange(12) // 4) < counts[torch.arange(12) % 4]
    assert torch.equal(by_kernel[kept], on_cpu[kept]) and not by_kernel[~kept].any()
