"""The full KV cache: every cached token's key and value is read at every decode step."""
from __future__ import annotations

import torch

from ..attention import attend
from ..tiered import TieredTensor
from ..tiers import DEVICE, HOST
from .base import CacheSpec, KVCache, KVPolicy


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """[b, s, KV, d] -> [s, b*KV, d], the token-major layout the cache is stored in."""
    b, s, kv, d = x.shape
    return x.permute(1, 0, 2, 3).reshape(s, b * kv, d)


def from_rows(x: torch.Tensor, batch: int) -> torch.Tensor:
    """[s, b*KV, d] -> [b, s, KV, d]."""
    s, _, d = x.shape
    return x.view(s, batch, -1, d).permute(1, 0, 2, 3)


def attend_selected(q, k_rows, v_rows, k_new, v_new, counts, return_key_mass: bool = False):
    """Attention over per-KV-head selected rows plus the new token.

    ``k_rows``/``v_rows``: [n, b*KV, d] fetched rows; for KV head column c only the first
    ``counts[c]`` rows are its own (the rest were fetched for a neighbour and are masked).
    ``counts`` is [b, KV].
    """
    b, kv = counts.shape
    k = torch.cat([from_rows(k_rows, b), k_new], dim=1)
    v = torch.cat([from_rows(v_rows, b), v_new], dim=1)
    rank = torch.arange(k_rows.shape[0], device=q.device)
    keep = torch.cat([rank < counts[..., None],
                      torch.ones(b, kv, 1, dtype=torch.bool, device=q.device)], -1)
    bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device)
    bias = bias.masked_fill(~keep, torch.finfo(q.dtype).min)[:, :, None, :]
    return attend(q, k, v, bias, return_key_mass=return_key_mass)


class FullCache(KVCache):
    def __init__(self, spec: CacheSpec):
        self.spec = spec
        shape = (spec.max_len, spec.batch_size * spec.kv_heads, spec.head_dim)
        self.k, self.v = (TieredTensor(spec.tiers, shape, spec.dtype, spec.fractions, "kv_cache",
                                       split_dim=1, compress=spec.compress) for _ in range(2))
        # attention on the CPU, where the cache lives (only q and the output cross the link)
        self.cpu_compute = spec.cpu_compute
        # all on the device, uncompressed: the new token is written in place before attention
        self.resident = self.k.resident and not self.cpu_compute

    def store_prompt(self, q, k, v, valid) -> None:
        self.k.write(to_rows(k), slice(0, k.shape[1]))
        self.v.write(to_rows(v), slice(0, v.shape[1]))

    def load(self, length: int):
        if self.cpu_compute or self.resident:
            return None
        rows = slice(0, length)
        return self.k.read(rows), self.v.read(rows)

    def attend(self, loaded, q, k_new, v_new, valid, bias) -> torch.Tensor:
        b = self.spec.batch_size
        length = valid.shape[1] - q.shape[1]
        if self.resident:
            self._store(k_new, v_new, length)
            rows = slice(0, length + q.shape[1])
            k, v = from_rows(self.k.read(rows), b), from_rows(self.v.read(rows), b)
            return attend(q, k, v, bias)
        tiers = self.spec.tiers
        if self.cpu_compute:
            q, k_new, v_new = (tiers.to_host(t, DEVICE, "activations") for t in (q, k_new, v_new))
            rows = slice(0, length)
            loaded = self.k.read(rows, to=HOST), self.v.read(rows, to=HOST)
            bias = bias.cpu()
        k = torch.cat([from_rows(loaded[0], b), k_new], dim=1)
        v = torch.cat([from_rows(loaded[1], b), v_new], dim=1)
        out = attend(q, k, v, bias)
        if self.cpu_compute:
            out = tiers.to_compute(out, HOST, "activations")
        return out

    def _store(self, k_new, v_new, position: int) -> None:
        rows = slice(position, position + k_new.shape[1])
        self.k.write(to_rows(k_new), rows)
        self.v.write(to_rows(v_new), rows)

    def store_token(self, k_new, v_new, position: int) -> None:
        if not self.resident:  # a resident cache stored the token during attention
            self._store(k_new, v_new, position)

    def bytes_by_tier(self) -> dict[str, int]:
        a, b = self.k.bytes_by_tier(), self.v.bytes_by_tier()
        return {t: a[t] + b[t] for t in a}


class FullPolicy(KVPolicy):
    name = "full"

    def make_cache(self, spec: CacheSpec) -> KVCache:
        return FullCache(spec)
