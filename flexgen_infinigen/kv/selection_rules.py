"""Turning per-token scores into the rows each KV head reads: the selection rules.

Every selective policy (InfiniGen from approximate scores, the oracle from exact ones) ends
here. Input: scores ``[b, KV, G, t]`` (one row per query head of each KV head's group; -inf
where a token may not be chosen) and a :class:`Budget`. Output: ``order [b, KV, n]``, the
chosen token positions of each KV head ranked first, and ``counts [b, KV]``: a head uses the
first ``counts`` entries of its ``order``. Rules (``--selection``):

* ``margin``: a token counts when any query head of the group scores it above its own best
  minus ``alpha``; the count is capped by the budget and floored (the first rule we shipped).
* ``cap``: always the budget's cap, ranked by the best margin over the group.
* ``artifact``: the research artifact's rule: the number of tokens above ``max - alpha``,
  averaged over every query head and batch row, gives one ``k``; each query head takes its
  own top ``k`` and a KV head reads their union (which may exceed the cap under GQA).
* ``head-union``: each query head contributes its best tokens in turn (every head's first
  choice, then every head's second, ...) until the KV head holds as many as the margin rule
  allows, capped; no query head of a group is starved by another's strong preferences.
* ``mass``: the budget's cap of tokens with the most softmax mass summed over the group.

``keep_sink`` first and ``keep_recent`` last valid tokens are always chosen, inside the budget
(the count grows only when they alone exceed it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

RULES = ("margin", "cap", "artifact", "head-union", "mass")
FORCED = 1e30  # the priority of a token that is always kept


@dataclass(frozen=True)
class Budget:
    fraction: float = 0.2  # of each sequence's cached (valid) tokens
    max_num: int | None = None
    min_num: int = 4
    keep_sink: int = 0
    keep_recent: int = 0

    def caps(self, n_valid: torch.Tensor) -> torch.Tensor:
        """Most tokens a KV head of each row may read: ``[b]`` long."""
        cap = torch.floor(n_valid.double() * self.fraction).long().clamp(min=1)
        if self.max_num is not None:
            cap = cap.clamp(max=self.max_num)
        return torch.maximum(cap, n_valid.clamp(max=self.min_num)).minimum(n_valid)

    def most(self, length: int) -> int:
        """An upper bound of ``caps`` for any row of ``length`` cached tokens (no host sync)."""
        cap = max(1, math.floor(length * self.fraction))
        if self.max_num is not None:
            cap = min(cap, self.max_num)
        return min(length, max(cap, self.min_num, self.keep_sink + self.keep_recent))


def forced_mask(valid: torch.Tensor, budget: Budget) -> torch.Tensor | None:
    """``[b, t]`` True for the sink and recent tokens of each row (None when neither is kept)."""
    if budget.keep_sink <= 0 and budget.keep_recent <= 0:
        return None
    from_start = valid.long().cumsum(-1)
    from_end = valid.long().flip(-1).cumsum(-1).flip(-1)
    return valid & ((from_start <= budget.keep_sink) | (from_end <= budget.keep_recent))


def select(scores: torch.Tensor, valid: torch.Tensor, rule: str, alpha: float,
           budget: Budget, allowed: torch.Tensor | None = None):
    """``(order, counts)`` for ``scores [b, KV, G, t]`` (see the module docstring).

    ``valid`` [b, t]: real cached tokens; ``allowed`` [b, KV, t]: a further per-head mask
    (tokens a KV pool evicted).
    """
    b, kv, g, t = scores.shape
    ok = valid[:, None, :].expand(b, kv, t)
    if allowed is not None:
        ok = ok & allowed
    scores = scores.float().masked_fill(~ok[:, :, None, :], -math.inf)
    n_valid = valid.sum(-1)
    cap = budget.caps(n_valid)[:, None].expand(b, kv)
    floor = n_valid.clamp(max=budget.min_num)[:, None].expand(b, kv)
    most = budget.most(t)
    if rule == "mass":  # needs no margins: one softmax, summed over the group
        priority = torch.softmax(scores, -1).nan_to_num(0.0).sum(2).masked_fill(~ok, -math.inf)
        return _finish(priority, cap, ok, valid, budget, most, t)
    margin = scores - scores.amax(-1, keepdim=True)  # 0 at each query head's best token
    best = margin.amax(2)  # [b, KV, t]
    above = (best > -alpha).sum(-1)  # tokens some query head of the group wants
    if rule == "margin":
        priority, counts = best, torch.maximum(torch.minimum(above, cap), floor)
    elif rule == "cap":
        priority, counts = best, cap
    elif rule == "head-union":
        priority = _round_robin(margin, most)
        counts = torch.maximum(torch.minimum(above, cap), floor)
    elif rule == "artifact":
        priority, counts, most = _artifact(margin, ok, alpha, cap, floor, most)
    else:
        raise ValueError(f"unknown selection rule {rule!r}")
    return _finish(priority, counts, ok, valid, budget, most, t)


def mass_order(scores: torch.Tensor, bias: torch.Tensor, token_bias: torch.Tensor,
               width: int) -> torch.Tensor:
    """The ``mass`` rule's ranking in few ops (each a kernel launch on a GPU), for scores
    ``[b, KV, G, t]`` and ``bias [b, 1, 1, t]`` (0 where a token may be chosen, -inf where
    not; ``token_bias`` the same ``[b, 1, t]``): softmax over the allowed tokens, summed over
    the group, the top ``width``. A token
    that may not be chosen ranks below every one that may (its priority is -inf, not 0: an
    allowed token's mass may underflow to 0). The counts are the step's caps (``select``'s
    for this rule)."""
    priority = torch.softmax(scores + bias, -1).sum(2).add_(token_bias)
    return priority.topk(width, dim=-1, sorted=True).indices


def _finish(priority, counts, ok, valid, budget: Budget, most: int, t: int):
    """Sink and recent tokens forced in, counts capped by what a head may choose, ranked."""
    forced = forced_mask(valid, budget)
    if forced is not None:
        forced = forced[:, None, :] & ok
        priority = priority.masked_fill(forced, FORCED)
        counts = torch.maximum(counts, forced.sum(-1))
        most = min(t, most + budget.keep_sink + budget.keep_recent)
    counts = torch.minimum(counts, ok.sum(-1))  # never more than the head may choose from
    order = priority.topk(min(most, t), dim=-1, sorted=True).indices
    return order, counts


def _round_robin(margin: torch.Tensor, most: int) -> torch.Tensor:
    """Priority ``[b, KV, t]``: minus the best rank any query head gives the token (ties by
    the best margin), over each head's top ``most``; others rank last."""
    b, kv, g, t = margin.shape
    k = min(most, t)
    top = margin.topk(k, dim=-1, sorted=True).indices  # [b, KV, G, k]
    rank = torch.arange(k, device=margin.device, dtype=torch.float32).expand(b, kv, g, k)
    best_rank = torch.full((b, kv, t), float(k), device=margin.device)
    best_rank = best_rank.scatter_reduce(2, top.reshape(b, kv, g * k), rank.reshape(b, kv, g * k),
                                         reduce="amin")
    tie = 0.5 * margin.amax(2).exp()  # in (0, 0.5]: a later rank never overtakes an earlier one
    priority = -best_rank + tie
    return priority.masked_fill(margin.amax(2) == -math.inf, -math.inf)


def _artifact(margin, ok, alpha, cap, floor, most):
    """One k (mean count over heads and rows), each query head's top k, union per KV head."""
    b, kv, g, t = margin.shape
    per_head = (margin > -alpha).sum(-1).float()  # [b, KV, G]
    k = per_head.mean().round().long()
    k_rows = torch.maximum(torch.minimum(k.expand(b, kv), cap), floor)  # [b, KV]
    k_max = min(most, t)
    top = margin.topk(k_max, dim=-1, sorted=True).indices  # [b, KV, G, k_max]
    use = torch.arange(k_max, device=margin.device) < k_rows[:, :, None, None]
    hits = torch.zeros(b, kv, t, dtype=torch.int32, device=margin.device)
    hits.scatter_add_(2, top.reshape(b, kv, g * k_max),
                      use.expand(b, kv, g, k_max).reshape(b, kv, g * k_max).to(torch.int32))
    chosen = (hits > 0) & ok
    # chosen tokens first (by their best margin), the rest never
    priority = (1.0 + margin.amax(2).exp()).masked_fill(~chosen, -math.inf)
    return priority, chosen.sum(-1), min(t, g * k_max)
