"""A request joins a running block between two decode steps, in a row whose request has
ended, and from its next step on is computed as its own block would compute it.

Its prompt is prefilled alone: the same prefill a block of that one prompt runs (one row,
the same chunks and attention calls), into one-row caches made for it. Each of the running
block's caches then takes those columns into the row (``KVCache.take_row``: the keys and
values, and what the policy keeps per token and per row, such as a selecting policy's
speculation keys and per-prompt projection), placed so that they end at the block's last
column; the row's older columns become invisible to it. Its first token comes from the
prefill's logits, and its next token goes in at the next step at position ``len(prompt)``.

Why this is exact: a row's decode attention starts at its first visible key and walks its
keys in ranges counted from there (:mod:`flexgen_infinigen.kernels.attention`), positions
count visible columns only, and every other kernel treats rows independently; so the row's
steps are its lone steps. A prompt longer than the block's columns cannot end at the last
column: it waits until the block has run long enough (or for the next block).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .block import BatchState, Block, BlockMode, Pass, PrefixKV


def takes_rows(engine) -> bool:
    """Every cache of the running block can take a row's columns."""
    caches = engine.block.caches
    return engine.running and bool(caches) and all(c.takes_rows for c in caches.values())


def can_join(engine, prompt_len: int) -> bool:
    """A prompt of ``prompt_len`` tokens can join the running block now: its caches take
    rows, and it holds at least as many columns as the prompt."""
    return takes_rows(engine) and 0 < prompt_len <= engine.block.columns()


def join_row(engine, lanes, batch: int, row: int, ids: list[int],
             choose: Callable[[torch.Tensor], int], prefix: PrefixKV | None = None) -> int:
    """Row ``row`` of GPU batch ``batch`` takes the prompt ``ids`` (``can_join`` must hold):
    its prefill alone, its columns into the row, and its first token, which ``choose`` picks
    from the prefill's logits ``[vocab]`` and which the row feeds at the next step. Returns
    that token. ``prefix``: the prompt's first columns, known (prefix pages)."""
    running = engine.block
    start = running.columns() - len(ids)
    logits, caches = _prefill_alone(engine, lanes, ids, prefix)
    for (stage, b), cache in running.caches.items():
        if b == batch:
            cache.take_row(row, start, caches[(stage, 0)], len(ids))
    token = int(choose(logits))
    running.place_row(batch, row, start, token)
    return token


def _prefill_alone(engine, lanes, ids: list[int], prefix: PrefixKV | None):
    """The prefill of a block of the one prompt ``ids``: its logits ``[vocab]`` and its caches
    by (stage, 0). The running block is set aside meanwhile and put back after."""
    running, dev = engine.block, engine.tiers.device
    engine.block = alone = Block()
    try:
        tokens = torch.tensor([ids])
        valid = torch.ones_like(tokens, dtype=torch.bool).to(dev)
        positions = valid.long().cumsum(-1) - 1
        known = 0
        if prefix is not None and 0 < prefix.length < len(ids):
            alone.prefix, known = prefix, prefix.length
        alone.states.append(engine._prepare(BatchState(tokens[:, known:].to(dev), valid,
                                                       positions[:, known:])))
        engine._make_caches(1, len(ids))
        mode = BlockMode(prefill_chunk=engine._prefill_chunk(1, len(ids)))
        engine._iteration(Pass(False, (0,), mode), lanes)
        return engine._logits(0)[0], alone.caches
    finally:
        engine.block = running
