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
        """``index`` [cols, n] fetched token positions, of which the first ``counts`` were used."""
        self.step += 1
        used = torch.arange(index.shape[1], device=index.device) < counts[:, None]
        pos = index.masked_select(used)
        col = torch.arange(index.shape[0], device=index.device)[:, None].expand_as(index)
        col = col.masked_select(used)
        self.last_used[col, pos] = self.step
        self.uses[col, pos] += 1

    def evict(self, valid: torch.Tensor) -> None:
        """Enforce the budget over the first ``length`` rows; ``valid`` is [cols, length]."""
        length = valid.shape[1]
        alive = self.alive[:, :length] & valid
        held = alive.sum(-1)
        budget = torch.ceil(valid.sum(-1).float() * self.capacity).long()
        excess = (held - budget).clamp(min=0)
        top = int(excess.max())
        if top == 0:
            return
        window = min(self.window, max(1, int(budget.min()) // 2))
        pos = torch.arange(length, device=valid.device)
        eligible = alive & (pos < length - window)
        if self.eviction == "fifo":
            priority = pos.expand_as(alive).clone()
        elif self.eviction == "lru":
            priority = self.last_used[:, :length] * length + pos
        else:  # counter: least often fetched among the older half (the newer half only if short)
            newer = pos >= (length - window) // 2
            priority = self.uses[:, :length] * length + pos + newer * (BIG // 2)
        priority = priority.masked_fill(~eligible, BIG)
        worst = priority.topk(min(top, length), dim=-1, largest=False)
        drop = (torch.arange(worst.indices.shape[1], device=valid.device) < excess[:, None])
        drop &= worst.values < BIG
        rows = torch.arange(alive.shape[0], device=valid.device)[:, None].expand_as(drop)
        self.alive[rows[drop], worst.indices[drop]] = False
        self.evicted += int(drop.sum())


def check_pool_options(capacity: float, eviction: str) -> None:
    from ..config import ConfigError
    if not (0 < capacity <= 1) or math.isnan(capacity):
        raise ConfigError(f"--kv-pool-capacity must be in (0, 1] (got {capacity})")
    if eviction not in EVICTIONS:
        raise ConfigError(f"unknown --eviction {eviction!r}; pick one of: {', '.join(EVICTIONS)}")
