"""Page summaries for InfiniGen's speculation (``--speculation-keys pages16``): instead of a
4-bit copy of every key, a page of ``page`` consecutive tokens keeps the element-wise minimum
and maximum of its projected (skewed) keys, as Quest does with the raw keys. For a query q,
``sum_w max(q_w min_w, q_w max_w)`` bounds q.k of every key of the page; the pages with the
most softmax mass of those bounds (summed over the KV head's query heads) are chosen, and
attention reads all their tokens.

Scoring costs pages, not tokens (a sixteenth of the work at 16 tokens a page), and the
chosen rows come in runs of ``page`` consecutive tokens, which a head-major cache streams.
What it costs in accuracy is measured by ``benchmarks/long_context_accuracy.py``
(``infinigen-pages`` labels). Summaries are kept head-major, ``[columns, pages, width]``,
over the tokens a sequence may see (padding never widens a page's bounds).
"""
from __future__ import annotations

import math

import torch

from ...kernels.cpu_kernels import speculate_pages

PAGE_KINDS = {"pages16": 16, "pages8": 8, "pages32": 32}


class SpeculationPages:
    def __init__(self, kind: str, max_len: int, columns: int, width: int, dtype: torch.dtype,
                 tiers):
        self.kind, self.page, self.width = kind, PAGE_KINDS[kind], width
        self.tiers = tiers
        pages = -(-max_len // self.page)
        dev = tiers.device
        self.lo = tiers.track(torch.full((columns, pages, width), math.inf, device=dev),
                              "device")
        self.hi = tiers.track(torch.full((columns, pages, width), -math.inf, device=dev),
                              "device")
        self.use_kernel = not tiers.is_cuda

    def write(self, rows: torch.Tensor, start: int, valid: torch.Tensor | None = None) -> None:
        """Projected keys ``[s, columns, width]`` of positions ``start..start+s``; ``valid``
        ``[s, columns]`` marks the ones a sequence sees (padding does not count)."""
        x = rows.float().transpose(0, 1)  # [columns, s, width]
        cols, s, w = x.shape
        if valid is not None:
            keep = valid.t()[..., None]
            lo_x, hi_x = x.masked_fill(~keep, math.inf), x.masked_fill(~keep, -math.inf)
        else:
            lo_x = hi_x = x
        p = self.page
        first, last = start // p, (start + s - 1) // p
        pad_front, pad_back = start - first * p, (last + 1) * p - (start + s)
        lo_x = torch.nn.functional.pad(lo_x, (0, 0, pad_front, pad_back), value=math.inf)
        hi_x = torch.nn.functional.pad(hi_x, (0, 0, pad_front, pad_back), value=-math.inf)
        n = last - first + 1
        pages = slice(first, last + 1)
        self.lo[:, pages] = torch.minimum(self.lo[:, pages], lo_x.view(cols, n, p, w).amin(2))
        self.hi[:, pages] = torch.maximum(self.hi[:, pages], hi_x.view(cols, n, p, w).amax(2))

    def bounds(self, pq: torch.Tensor, length: int) -> torch.Tensor:
        """Upper bounds ``[b, KV, G, pages]`` of the queries ``pq [b, KV, G, w]`` against the
        pages of the first ``length`` tokens."""
        b, kv, g, w = pq.shape
        n = -(-length // self.page)
        q = pq.float().reshape(b * kv, g, 1, w)
        lo, hi = self.lo[:, None, :n], self.hi[:, None, :n]
        lo, hi = torch.nan_to_num(lo, posinf=0.0), torch.nan_to_num(hi, neginf=0.0)
        return torch.maximum(q * lo, q * hi).sum(-1).view(b, kv, g, n)

    def scores(self, pq: torch.Tensor, length: int) -> torch.Tensor:
        """Token-level scores ``[b, KV, G, length]``: every token its page's bound (what the
        other selection rules take)."""
        return self.bounds(pq, length).repeat_interleave(self.page, -1)[..., :length]

    def select_mass(self, pq: torch.Tensor, visible: torch.Tensor, caps: torch.Tensor,
                    width: int):
        """The mass rule over pages: ``(order [b, KV, width], counts [b, KV])``: whole pages,
        enough for ``caps`` tokens a KV head (at most a page's worth more); by a CPU kernel,
        else torch."""
        b, kv, g, w = pq.shape
        length = visible.shape[1]
        width = min(length, width + self.page)
        if self.use_kernel:
            out = speculate_pages(self.lo, self.hi, pq.float().reshape(b * kv, g, w), visible,
                                  caps, self.page, width)
            if out is not None:
                order, counts = out
                return order.view(b, kv, width), counts.view(b, kv)
        return self._select_torch(pq, visible, caps, width)

    def _select_torch(self, pq, visible, caps, width):
        b, kv, g, _ = pq.shape
        length, p = visible.shape[1], self.page
        n = -(-length // p)
        padded = torch.nn.functional.pad(visible, (0, n * p - length))
        held = padded.view(b, n, p).sum(-1)  # visible tokens of each page
        open_ = held > 0
        bounds = self.bounds(pq, length).masked_fill(~open_[:, None, None, :], -math.inf)
        mass = torch.softmax(bounds, -1).nan_to_num(0.0).sum(2)  # [b, KV, pages]
        order = torch.zeros(b, kv, width, dtype=torch.long, device=pq.device)
        counts = torch.zeros(b, kv, dtype=torch.long, device=pq.device)
        for i in range(b):  # a reference path: clarity over speed
            pages = open_[i].nonzero().flatten().tolist()
            for h in range(kv):
                # best first (ties: the earlier page), until the pages hold caps[i] tokens
                ranked = sorted(pages, key=lambda q: (-float(mass[i, h, q]), q))
                chosen, total = [], 0
                for q in ranked:
                    if total >= int(caps[i]) and chosen:
                        break
                    chosen.append(q)
                    total += int(held[i, q])
                tokens = [t for q in sorted(chosen) for t in range(q * p, min((q + 1) * p, length))
                          if visible[i, t]][:width]
                counts[i, h] = len(tokens)
                row = (tokens * (width // max(1, len(tokens)) + 1))[:width] if tokens \
                    else [0] * width
                order[i, h] = torch.tensor(row)
        return order, counts
