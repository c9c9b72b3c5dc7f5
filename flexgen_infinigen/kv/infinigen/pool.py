"""InfiniGen's KV pool manager: a host-side budget on how many tokens each KV head keeps.

When a head holds more than ``capacity`` x its context, tokens are evicted for good
(they are never selected again): ``fifo`` drops the oldest, ``lru`` the one fetched
least recently, ``counter`` the least often fetched among the older half. The most
recent window is never evicted. Eviction masks rows; it does not compact the storage.
"""
from __future__ import annotations

import math

import torch

EVICTIONS = ("fifo", "lru", "counter")
BIG = 1 << 40


class KVPool:
    def __init__(self, capacity: float, eviction: str, columns: int, max_len: int,
                 device: torch.device, window: int = 16):
        self.capacity, self.eviction, self.window = capacity, eviction, window
        self.alive = torch.ones(columns, max_len, dtype=torch.bool, device=device)
        self.last_used = torch.full((columns, max_len), -1, dtype=torch.long, device=device)
        self.uses = torch.zeros(columns, max_len, dtype=torch.long, device=device)
        self.step = 0
        self.evicted = 0

    def record_fetch(self, index: torch.Tensor, counts: torch.Tensor) -> None:
        """``index`` [cols, n] fetched token positions (distinct per column), of which the
        first ``counts`` were used. No host sync."""
        self.step += 1
        used = torch.arange(index.shape[1], device=index.device) < counts[:, None]
        now = torch.where(used, self.step, self.last_used.gather(1, index))
        self.last_used.scatter_(1, index, now)
        self.uses.scatter_add_(1, index, used.long())

    def evict(self, valid: torch.Tensor) -> None:
        """Enforce the budget over the first ``length`` rows; ``valid`` is [cols, length].
        Every column ranks all its tokens (no host sync to learn how many must go)."""
        length = valid.shape[1]
        alive = self.alive[:, :length] & valid
        held = alive.sum(-1)
        budget = torch.ceil(valid.sum(-1).float() * self.capacity).long()
        excess = (held - budget).clamp(min=0)
        window = (budget // 2).clamp(min=1, max=self.window)[:, None]  # [cols, 1]
        pos = torch.arange(length, device=valid.device)
        eligible = alive & (pos < length - window)
        if self.eviction == "fifo":
            priority = pos.expand_as(alive)
        elif self.eviction == "lru":
            priority = self.last_used[:, :length] * length + pos
        else:  # counter: least often fetched among the older half (the newer half only if short)
            newer = pos >= (length - window) // 2
            priority = self.uses[:, :length] * length + pos + newer * (BIG // 2)
        priority = priority.masked_fill(~eligible, BIG)
        ranked = priority.sort(dim=-1, stable=True)
        drop = (pos < excess[:, None]) & (ranked.values < BIG)
        rank_drop = torch.zeros_like(drop).scatter_(1, ranked.indices, drop)
        self.alive[:, :length] &= ~rank_drop
        self.evicted = self.evicted + drop.sum()

    def record_step(self, index: torch.Tensor, counts: torch.Tensor, valid: torch.Tensor,
                    b: int, kv: int):
        """A decode step of ``b`` sequences and ``kv`` KV heads: record the rows it used
        (``index`` [b, KV, n], the first ``counts`` [b, KV]), then evict past the budget
        (the new token included: ``valid`` [b, length + 1]). The rows evicted now."""
        self.record_fetch(index.reshape(b * kv, -1), counts.reshape(b * kv))
        per_col = valid[:, None, :].expand(b, kv, valid.shape[1]).reshape(b * kv, -1)
        before = self.evicted
        self.evict(per_col)
        return self.evicted - before


def check_pool_options(capacity: float, eviction: str) -> None:
    from ...config import ConfigError
    if not (0 < capacity <= 1) or math.isnan(capacity):
        raise ConfigError(f"--kv-pool-capacity must be in (0, 1] (got {capacity})")
    if eviction not in EVICTIONS:
        raise ConfigError(f"unknown --eviction {eviction!r}; pick one of: {', '.join(EVICTIONS)}")
