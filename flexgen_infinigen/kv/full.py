"""The full KV cache: every cached token's key and value is read at every decode step."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..kernels.attention import attend_rows, column_sinks
from ..memory.split_tensor import SplitTensor
from ..memory.tiers import DEVICE, HOST
from .base import CacheSpec, KVCache, KVPolicy, Loaded, Read

if TYPE_CHECKING:
    from ..kernels.layer_call import LayerCall


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """[b, s, KV, d] -> [s, b*KV, d], the token-major layout the cache is stored in."""
    b, s, kv, d = x.shape
    return x.permute(1, 0, 2, 3).reshape(s, b * kv, d)


def from_rows(x: torch.Tensor, batch: int) -> torch.Tensor:
    """[s, b*KV, d] -> [b, s, KV, d]."""
    s, _, d = x.shape
    return x.view(s, batch, -1, d).permute(1, 0, 2, 3)


def attend_selected(q, k_rows, v_rows, k_new, v_new, counts, return_key_mass: bool = False,
                    bias: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
    """Attention over per-KV-head selected rows plus the new token.

    ``k_rows``/``v_rows``: [n + 1, b*KV, d] buffers of fetched rows with the last row free for
    the new token (written here); for KV head column c only the first ``counts[c]`` rows are
    its own (the rest belong to a neighbour, or are zero, and are masked). ``counts``: [b, KV].
    ``bias``: :func:`selected_bias` of these counts, when the caller has it already.
    """
    top, d = k_rows.shape[0] - 1, k_rows.shape[-1]
    k_rows.select(0, top).copy_(k_new.reshape(-1, d))  # [b, 1, KV, d]: b*KV rows, in order
    v_rows.select(0, top).copy_(v_new.reshape(-1, d))
    if bias is None:
        bias = selected_bias(counts, top)
    return attend_rows(q, k_rows, v_rows, bias, return_key_mass=return_key_mass, sinks=sinks)


def selected_bias(counts: torch.Tensor, top: int) -> torch.Tensor:
    """``[b, KV, 1, top + 1]`` float32: 0 for each column's first ``counts`` rows and the new
    token's row (the last), the most negative float elsewhere."""
    skip = _ranks(top, counts.device) >= counts.unsqueeze(-1)  # the new row's rank is -1
    return skip.to(torch.float32).mul_(torch.finfo(torch.float32).min).unsqueeze(2)


_RANKS: dict = {}


def _ranks(top: int, device) -> torch.Tensor:
    """``[0, 1, ..., top - 1, -1]`` on ``device``, made once per size (a decode step's
    selected rows then cost no op to rank)."""
    key = (top, str(device))
    ranks = _RANKS.get(key)
    if ranks is None:
        ranks = torch.arange(top + 1, device=device)
        ranks[top] = -1
        if len(_RANKS) > 256:
            _RANKS.clear()
        _RANKS[key] = ranks
    return ranks


def row_buffers(spec: CacheSpec, rows: int, tag: str, to: str = DEVICE):
    """K and V buffers [rows, b*KV, d] for one decode step (reused between steps); one buffer
    twice where the values are the keys."""
    shape = (rows, spec.batch_size * spec.kv_heads, spec.head_dim)
    parts = "k" if spec.values_are_keys else "kv"
    if to == HOST:
        made = tuple(torch.empty(shape, dtype=spec.dtype) for _ in parts)
    else:
        made = tuple(spec.tiers.scratch(f"{tag}.{part}", shape, spec.dtype) for part in parts)
    return made if len(made) == 2 else (made[0], made[0])


class FullCache(KVCache):
    def __init__(self, spec: CacheSpec):
        self.spec = spec
        shape = (spec.max_len, spec.batch_size * spec.kv_heads, spec.head_dim)
        # what is kept: K and V, or (values_are_keys) K alone, which ``v`` then names too
        self.parts = tuple(SplitTensor(spec.tiers, shape, spec.dtype, spec.fractions, "kv_cache",
                                       split_dim=1, compress=spec.compress, head_major=True)
                           for _ in range(1 if spec.values_are_keys else 2))
        self.k, self.v = self.parts[0], self.parts[-1]
        # attention on the CPU, where the cache lives (only q and the output cross the link)
        self.cpu_compute = spec.cpu_compute
        # where the compute device can read it (on the device, or in CPU memory when the CPU
        # computes), uncompressed: attention reads the cache where it is, the new token
        # written in place first, and load and store move nothing (run inline)
        self.in_place = self.k.addressable and not self.cpu_compute
        # 4-bit codes in CPU memory that the CPU computes on: a kernel attends over them where
        # they are (nothing is expanded or moved; the new token is stored after attention)
        self.packed_in_place = (self.k.packed_in_place and not self.cpu_compute
                                and spec.head_dim % 64 == 0)
        self.inline = self.in_place or self.packed_in_place

    @property
    def takes_rows(self) -> bool:
        """Float rows (4-bit groups would mix another row's values into the codes)."""
        return not self.k.compressed

    def take_row(self, row: int, start: int, other: KVCache, length: int) -> None:
        kv = self.spec.kv_heads
        rows, cols = slice(start, start + length), slice(row * kv, (row + 1) * kv)
        for mine, theirs in zip(self.parts, other.parts):
            mine.write_columns(theirs.read(slice(0, length)), rows, cols)

    def store_prompt(self, q, k, v, valid) -> None:
        for tensor, rows in zip(self.parts, (k, v)):
            tensor.write(to_rows(rows), slice(0, rows.shape[1]))

    def _read_rows(self, length: int, to: str = DEVICE):
        """The visible rows of the first ``length`` (all, without a sliding window) of K and V
        in buffers with one more row, for the new token."""
        first = self.spec.first_visible(length)
        n = length - first
        buffers = row_buffers(self.spec, n + 1, "kv", to)
        rows = slice(first, length)
        for tensor, buf in zip(self.parts, buffers):
            tensor.read(rows, to=to, out=buf[:n])
        return buffers

    def prompt_reader(self, length: int, batch_size: int):
        if self.k.compressed:  # 4-bit: not the values the prompt made
            return None

        def read():  # where the compute device can read it, a view; else a copy to the host
            rows = slice(0, length)
            got = tuple(from_rows(t.view(rows) if t.addressable else t.read(rows, to=HOST),
                                  batch_size) for t in self.parts)
            return got[0], got[-1]
        return read

    def load(self, length: int) -> Loaded:
        if self.cpu_compute or self.in_place or self.packed_in_place:
            return Loaded.later()
        return Loaded.rows(self._read_rows(length))

    def attend(self, loaded: Loaded, q, k_new, v_new, valid, bias, sinks=None) -> torch.Tensor:
        length = valid.shape[1] - q.shape[1]
        first = self.spec.first_visible(length)  # rows before it are outside the window
        bias = bias[..., first:]
        if self.in_place:
            self._store(k_new, v_new, length)
            rows = slice(first, length + q.shape[1])
            return attend_rows(q, self.k.view(rows), self.v.view(rows), bias, sinks=sinks)
        if self.packed_in_place:
            out = self._attend_packed(q, k_new, v_new, bias, first, length, sinks)
            if out is not None:
                return out
            loaded = Loaded.rows(self._read_rows(length))  # no kernel: expand, as a copy would
        tiers = self.spec.tiers
        if self.cpu_compute:
            q, k_new, v_new = (tiers.to_host(t, DEVICE, "activations") for t in (q, k_new, v_new))
            loaded = Loaded.rows(self._read_rows(length, to=HOST))
            bias = bias.cpu()
        if loaded.read is not Read.ROWS:
            raise RuntimeError(f"the full cache attends over rows its load read, not "
                               f"{loaded.read.value!r}")
        k, v = loaded.k, loaded.v
        k[length - first] = to_rows(k_new)[0]
        if v is not k:
            v[length - first] = to_rows(v_new)[0]
        out = attend_rows(q, k, v, bias, sinks=sinks)
        if self.cpu_compute:
            out = tiers.to_compute(out, HOST, "activations")
        return out

    def _attend_packed(self, q, k_new, v_new, bias, first: int, length: int, sinks=None):
        """Attention over the 4-bit rows ``first .. length`` read where they are, plus the new
        token (exact), by a CPU kernel; None without it."""
        from ..memory.codes import Packed

        b, s = q.shape[:2]
        if s != 1:
            return None
        rows = slice(first, length)
        k, v = (Packed(*(p[rows] for p in t.packed().parts), t.shape) for t in (self.k, self.v))
        # (where the values are the keys, both read the one copy's codes)
        flat = bias[..., :length - first].float().expand(b, self.spec.kv_heads, 1,
                                                         length - first)
        return self.attend_codes(q, k, v, flat.reshape(b * self.spec.kv_heads, -1), k_new,
                                 v_new, sinks=sinks)

    def attend_codes(self, q, k, v, bias, k_new, v_new, index=None, sinks=None):
        """``attend_rows_q4`` of the decode query ``q [b, 1, H, d]`` over 4-bit rows ``k``/``v``
        (:class:`Packed` ``[t, b*KV, ...]``; with ``index [b*KV, n]`` only those rows of each
        column) with ``bias [b*KV, t or n]``, plus the new token; ``[b, 1, H*d]``, or None
        without the kernel."""
        from ..kernels import cpu_kernels

        b, _, heads, d = q.shape
        cols = b * self.spec.kv_heads
        qc = q.reshape(cols, heads // self.spec.kv_heads, d) * (1.0 / math.sqrt(d))
        out = cpu_kernels.attend_rows_q4(qc, k, v, bias, to_rows(k_new)[0], to_rows(v_new)[0],
                                         index, sinks=column_sinks(sinks, b))
        return None if out is None else out.view(b, 1, heads * d).to(q.dtype)

    def _store(self, k_new, v_new, position: int) -> None:
        rows = slice(position, position + k_new.shape[1])
        for tensor, new in zip(self.parts, (k_new, v_new)):
            tensor.write(to_rows(new), rows)

    def store_token(self, k_new, v_new, position: int) -> None:
        if not self.in_place:  # stored during attention otherwise
            self._store(k_new, v_new, position)

    def bytes_by_tier(self) -> dict[str, int]:
        counts = [t.bytes_by_tier() for t in self.parts]
        return {tier: sum(c[tier] for c in counts) for tier in counts[0]}

    # ---- the fused decode layer -------------------------------------------------------------
    def fused_attention(self, call: "LayerCall", next_cache: KVCache | None):
        """The whole layer in one call, attention over every visible row read in place: the
        plain full cache only (a subclass chooses its rows), float32 where the CPU reads it,
        and a next layer that takes nothing from this one's attention input."""
        if (type(self) is not FullCache or not call.ok or not self.in_place
                or self.k.dtype != torch.float32
                or (next_cache is not None and next_cache.speculates)):
            return None
        self.read_in_place(call)
        return WholeLayer(call)

    def read_in_place(self, call: "LayerCall") -> None:
        """Point ``call``'s attention at this cache's rows where they are; the new token's row
        the call writes is counted as :meth:`store_token`'s write would count it."""
        counter = None
        if self.k.segments[0].tier != DEVICE:  # its row crosses to host memory
            tiers = self.spec.tiers
            n = len(self.parts) * call.batch * call.cfg.kv_dim * 4

            def counter() -> None:
                tiers.count("device->host", "kv_cache", n)
        call.read_rows_in_place(self.k.view(), self.v.view(), self.spec.max_len,
                                self.spec.first_visible, counter)


class WholeLayer:
    """The full cache's part of a fused decode layer: all of it (see
    :meth:`FullCache.fused_attention`); the next layer speculates on nothing."""

    def __init__(self, call: "LayerCall"):
        self.call = call

    def layer(self, h: torch.Tensor, state, loaded: Loaded):
        return self.call.whole_layer(h, state), None


class FullPolicy(KVPolicy):
    name = "full"
    computes_sinks = True
    summary = "every cached token's key and value is read at every step (default)"

    def make_cache(self, spec: CacheSpec) -> KVCache:
        return FullCache(spec)
