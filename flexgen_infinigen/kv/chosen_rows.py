"""What the selective policies (InfiniGen, H2O, the oracle) share: a cache and a policy base
that count the rows each step reads, and moving a chosen subset of K/V rows to the compute
device, laid out per KV head for attention."""
from __future__ import annotations

import math

import torch

from ..kernels import cpu_kernels
from ..kernels.attention import column_sinks
from .base import CacheSpec
from .full import FullCache, FullPolicy, row_buffers, to_rows
from .stats import FetchStats


class SelectiveCache(FullCache):
    """A full cache whose decode steps read a chosen subset of rows in ``selecting`` layers
    (every visible row elsewhere); each read is counted in the policy's :class:`FetchStats`."""

    def __init__(self, spec: CacheSpec, policy: "SelectivePolicy", selecting: bool = True):
        super().__init__(spec)
        self.policy, self.selecting = policy, selecting
        # a selecting layer's attention reads the rows its load chose (never in place; loads
        # run on a lane); a layer that reads every row reads it where it is when it can
        self.in_place = self.inline = (not selecting and self.k.addressable
                                       and not self.cpu_compute)
        # 4-bit codes in CPU memory that the CPU computes on: a selecting layer attends over
        # them where they are too (a step that reads the layer whole, or the rows it chose)
        self.packed_here = self.packed_in_place
        self.packed_in_place = self.packed_in_place and not selecting
        # bytes of one token's K and V for one KV head column, as stored (compressed or not)
        self.row_bytes = sum(self.bytes_by_tier().values()) / (
            spec.max_len * spec.batch_size * spec.kv_heads)
        self.mapped_layout = None  # gather_mapped's view of the cache, made at its first use

    def count(self, moved, selected, length: int) -> None:
        """A selecting step: ``moved`` rows crossed, ``selected`` were used (device counts are
        kept unsynchronized), of ``length`` cached per KV head column."""
        cached = length * self.spec.batch_size * self.spec.kv_heads
        self.policy.stats.add(self.spec.layer, moved, selected, cached, self.row_bytes)

    def count_full_read(self, length: int) -> None:
        """A step of a layer that reads every visible row."""
        cols = self.spec.batch_size * self.spec.kv_heads
        n = (length - self.spec.first_visible(length)) * cols
        self.policy.stats.add(self.spec.layer, n, n, n, self.row_bytes, speculative=False)


class SelectivePolicy(FullPolicy):
    """Counts what its caches read (``kv_fetch_fraction`` and the others in the report) and
    refuses attention on the CPU (its selected rows go to the compute device)."""

    attends_on_cpu = False

    def __init__(self):
        self.stats = FetchStats()

    def reset_stats(self) -> None:
        self.stats = FetchStats()

    def settings(self) -> dict:
        """The policy's own settings, for the report."""
        return {}

    def report(self) -> dict:
        return {"kv_policy": self.name, **self.settings(), **self.stats.report()}


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
    for tensor, buf in zip(cache.parts, buffers):  # one buffer where values are the keys
        if tiers.is_cuda:  # padding is masked, but must be finite (0 x NaN is NaN); on a CPU
            buf.zero_()    # the reused scratch holds only earlier K/V values (zeros at first)
        buf.view(-1, buf.shape[-1]).index_copy_(0, place, tensor.take(rows, col))
    return buffers[0], buffers[1], int(rows.shape[0])


def attend_packed_rows(cache: FullCache, q, k_new, v_new, order, counts,
                       length: int, sinks=None) -> torch.Tensor | None:
    """Attention over the chosen rows ``order[b, KV, :counts]`` of a 4-bit cache in CPU memory
    (``packed_here``) plus the new token: ``attend_rows_q4`` reads each chosen row's codes
    where they are (by index, nothing gathered), the rows past each column's count masked.
    None without the kernel."""
    cols = q.shape[0] * cache.spec.kv_heads
    top = int(counts.max())
    # [cols, top]; past a column's count ``order`` holds anything: a written row stands in
    rows = order.reshape(cols, -1)[:, :top].clamp(0, length - 1)
    bias = torch.zeros(cols, top)
    bias.masked_fill_(torch.arange(top)[None, :] >= counts.reshape(cols, 1), float("-inf"))
    return cache.attend_codes(q, cache.k.packed(), cache.v.packed(), bias, k_new, v_new,
                              index=rows, sinks=sinks)


def attend_chosen_in_place(cache: FullCache, q, k_new, v_new, order,
                           counts, sinks=None) -> torch.Tensor:
    """Attention over the chosen rows ``order[b, KV, :counts]`` read where a float32 cache in
    CPU memory lives (``attend_indexed``), plus the new token."""
    b, heads, d = q.shape[0], q.shape[2], q.shape[3]
    cols = b * cache.spec.kv_heads
    qc = q.reshape(cols, heads // cache.spec.kv_heads, d) * (1.0 / math.sqrt(d))
    out = cpu_kernels.attend_indexed(qc, cache.k.view(), cache.v.view(), order, counts,
                                     to_rows(k_new)[0], to_rows(v_new)[0],
                                     sinks=column_sinks(sinks, b))
    return out.view(b, 1, heads * d).to(q.dtype)


def gather_on_device(cache: FullCache, order: torch.Tensor):
    """A cache the compute device can address (on the device, or in CPU memory on a CPU): the
    ranked rows gathered where they are, one pass, no host round trip. Buffers
    ``[n + 1, b*KV, d]`` with every head padded to ``order``'s width ``n`` (rows past a head's
    count are masked by attention)."""
    b, kv, n = order.shape
    cols, d = b * kv, cache.spec.head_dim
    buffers = row_buffers(cache.spec, n + 1, "selected")
    for tensor, buf in zip(cache.parts, buffers):
        rows, token, column = tensor.flat_rows()
        flat = order.reshape(cols, n).t() * token + \
            torch.arange(cols, device=order.device) * column
        torch.index_select(rows, 0, flat.reshape(-1), out=buf[:n].view(-1, d))
    return buffers


def gather_mapped(cache: SelectiveCache, order: torch.Tensor, counts: torch.Tensor):
    """A cache in host memory that the compute device reads by index (``SplitTensor.mapped``):
    the ranked rows read by the device itself (:mod:`..memory.mapped_rows`), the indices
    never on the host. Buffers ``[n + 1, b*KV, d]`` laid out as :func:`gather_on_device`'s;
    the bytes of the ``counts`` rows are counted (the device reads only those; summed when
    the step has synchronized). None where
    the device cannot read them (the caller gathers on the host)."""
    b, kv, n = order.shape
    cols, d = b * kv, cache.spec.head_dim
    tiers = cache.spec.tiers
    if cache.mapped_layout is None or cache.mapped_layout[0].device != order.device:
        (rows_k, token, column), rows_v = cache.k.flat_rows(), cache.v.flat_rows()[0]
        offsets = torch.arange(cols, device=order.device) * column
        cache.mapped_layout = (offsets, token, rows_k, rows_v)  # the same every step
    offsets, token, rows_k, rows_v = cache.mapped_layout
    # output row rank * cols + c holds column c's rank-th choice (K and V share one layout)
    flat = torch.add(offsets, order.view(cols, n).t(), alpha=token).reshape(-1)
    buffers = row_buffers(cache.spec, n + 1, "selected")
    sources = (rows_k,) if cache.v is cache.k else (rows_k, rows_v)
    for src, buf in zip(sources, buffers):  # counts [b, KV]: one per column
        if not tiers.gather_mapped(src, flat, counts, cols, buf.view(-1, d)[:n * cols]):
            return None
    tiers.count_deferred("host->device", "kv_cache", counts, cache.row_bytes)
    return buffers
