"""A block's prefill from the prefix pages, and a finished block's rows kept as pages.

A block's rows are left-padded to one length, so a row's token ``i`` sits at column
``pad + i``. The prefill can skip the first ``S`` columns when every row's tokens in them
are held (``S <= pad + cached`` for every row); padding columns are zeros there, as no
token ever attends to them. At least the last column is always computed: its logits are
the first token's.

When the block ends, each row's sequence (its prompt and the tokens fed back since, from
the column its first token sits in) is read back from the caches and its whole pages are
kept, so the next turn of a chat finds its history.
"""
from __future__ import annotations

import torch

from .block import PrefixKV
from .prefix_pages import PrefixPages


def whole(engine) -> bool:
    """One process runs every layer of the engine's model (not a pipeline rank)."""
    part = engine.part
    return part.start == 0 and part.stop == engine.cfg.num_layers and part.embed and part.head


def usable(engine) -> bool:
    """The engine's caches can start from known keys and values: its policy does not read
    the prompt's queries at prefill (H2O, a per-prompt skew), one process runs every
    layer, and no layer keeps a recurrent state (a state holds no columns to start from)."""
    return not engine.kv_policy.needs_prompt_queries and whole(engine) \
        and not engine.policy.compress_cache and not engine.cfg.linear_layers


def block_prefix(pages: PrefixPages | None, engine, prompts: list[list[int]],
                 batches: list[tuple[torch.Tensor, torch.Tensor]]) -> PrefixKV | None:
    """The known first columns of a block whose rows hold ``prompts`` (every row, dummy
    rows included, in order) padded into ``batches``; None when nothing is known. Without
    pages (None) only padding that every row has is known (a block's free columns)."""
    width = batches[0][0].shape[1]
    pads = [width - len(p) for p in prompts]
    found = [pages.longest(p, limit=len(p) - 1) if pages is not None else 0 for p in prompts]
    known = min(pad + n for pad, n in zip(pads, found))
    if known <= 0 or known >= width:
        return None
    per_row = []
    for prompt, pad in zip(prompts, pads):
        tokens = known - pad
        got = pages.gather(prompt, -(-tokens // pages.page_tokens) * pages.page_tokens) \
            if tokens > 0 else None
        if tokens > 0 and got is None:
            return None  # a page was damaged since it was found: prefill everything
        per_row.append(None if got is None else (got[0][:, :tokens], got[1][:, :tokens]))
    cfg = engine.cfg
    if all(r is None for r in per_row):  # padding only: zeros that take no memory
        zero = torch.zeros((), dtype=engine.dtype, device=engine.tiers.device)
        return PrefixKV(known, {(layer, b): (zero.expand(ids.shape[0], known, cfg.num_kv_heads,
                                                         cfg.head_dim),) * 2
                                for layer in range(cfg.num_layers)
                                for b, (ids, _) in enumerate(batches)})
    sample = next(r for r in per_row if r is not None)[0]  # [layers, tokens, KV, d]
    layers, _, kv_heads, dim = sample.shape
    kv, first = {}, 0
    for b, (ids, _) in enumerate(batches):
        rows = ids.shape[0]
        for layer in range(layers):
            k = sample.new_zeros(rows, known, kv_heads, dim)
            v = sample.new_zeros(rows, known, kv_heads, dim)
            for r in range(rows):
                got = per_row[first + r]
                if got is not None:
                    n = got[0].shape[1]
                    k[r, known - n:] = got[0][layer]
                    v[r, known - n:] = got[1][layer]
            kv[(layer, b)] = (k, v)
        first += rows
    return PrefixKV(known, kv)


def keep_rows(pages: PrefixPages, engine, rows: list[tuple[int, list[int]]]) -> int:
    """Keep the whole pages of every row of the running block, read from its caches:
    ``rows[i]`` is (the column of row ``i``'s first token, the tokens it fed since, in
    order), rows in block order; tokens past the columns the caches hold are left out.
    Returns the pages added (0 where the caches do not hold exact rows)."""
    layers = engine.cfg.num_layers
    added, first, batch = 0, 0, 0
    size = engine.block.states[0].valid.shape[0]  # rows a GPU batch
    while first < len(rows):
        wanted = [r for r in range(size) if len(rows[first + r][1]) >= pages.page_tokens]
        if not wanted:
            first, batch = first + size, batch + 1  # nothing whole to keep: nothing read
            continue
        # only the rows with a whole page are read (one row when a request ends)
        per_layer = [engine.cached_kv(layer, batch, wanted) for layer in range(layers)]
        if any(x is None for x in per_layer):
            return added
        columns = per_layer[0][0].shape[1]
        for at, r in enumerate(wanted):
            column, seq = rows[first + r]
            n = min(len(seq), columns - column)
            n -= n % pages.page_tokens
            if n <= 0:
                continue
            k = torch.stack([kv[0][at, column:column + n] for kv in per_layer])
            v = None if engine.cfg.values_are_keys else \
                torch.stack([kv[1][at, column:column + n] for kv in per_layer])
            added += pages.add(seq[:n], k, v)
        first += size
        batch += 1
    return added
