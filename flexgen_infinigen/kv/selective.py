"""What the selective policies (InfiniGen, H2O) share: moving a chosen subset of K/V rows to
the compute device, laid out per KV head for attention."""
from __future__ import annotations

import torch

from .full import FullCache, row_buffers


def fetch_selected(cache: FullCache, order: torch.Tensor, counts: torch.Tensor):
    """The selected K and V rows in buffers ``[top + 1, b*KV, d]`` on the compute device, each
    KV head's own rows first (the rest zero, the last row free for the new token); only
    ``counts.sum()`` rows cross the links.

    ``order`` [b, KV, n], ``counts`` [b, KV] on the CPU. Returns (k, v, moved rows)."""
    cols = order.shape[0] * order.shape[1]
    n = order.shape[2]
    counts = counts.reshape(cols)
    top = int(counts.max()) if cols else 0
    rank = torch.arange(n)
    use = rank[None, :] < counts[:, None]  # [cols, n]
    rows = order.reshape(cols, n)[use]
    col = torch.arange(cols)[:, None].expand(cols, n)[use]
    tiers = cache.spec.tiers
    # where each fetched row goes in the buffer viewed as [(top + 1) * cols, d]
    place = tiers.index_to_device(rank[None, :].expand(cols, n)[use] * cols + col)
    buffers = row_buffers(cache.spec, top + 1, "selected")
    for tensor, buf in zip((cache.k, cache.v), buffers):
        if tiers.is_cuda:  # padding is masked, but must be finite (0 x NaN is NaN); on a CPU
            buf.zero_()    # the reused scratch holds only earlier K/V values (zeros at first)
        buf.view(-1, buf.shape[-1]).index_copy_(0, place, tensor.take(rows, col))
    return buffers[0], buffers[1], int(rows.shape[0])


def gather_on_device(cache: FullCache, order: torch.Tensor):
    """A cache held whole on the compute device: the ranked rows gathered there, no host round
    trip. Buffers ``[n + 1, b*KV, d]`` with every head padded to ``order``'s width ``n`` (rows
    past a head's count are masked by attention)."""
    b, kv, n = order.shape
    index = order.reshape(b * kv, n).t()[..., None].expand(n, b * kv, cache.spec.head_dim)
    buffers = row_buffers(cache.spec, n + 1, "selected")
    for tensor, buf in zip((cache.k, cache.v), buffers):
        torch.gather(tensor.segments[0].data, 0, index, out=buf[:n])
    return buffers
