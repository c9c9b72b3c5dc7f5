"""H2O: keep the heavy hitters (most accumulated attention) and a recent window; evict the
rest for good. Budgets are fractions of each sequence's context, per KV head.

Only kept rows are fetched at decode, so ``kv_fetch_fraction`` is the kept share; the
attention probabilities of every step are added to the kept tokens' scores.
"""
from __future__ import annotations

import math

import torch

from ..config import ConfigError
from ..kernels.attention import prompt_key_mass, score_rows
from .base import CacheSpec, DecodeWork, Loaded
from .full import attend_selected
from .chosen_rows import SelectiveCache, SelectivePolicy, fetch_selected, gather_on_device


def _alive_first(alive: torch.Tensor, top: int) -> torch.Tensor:
    """``[cols, top]``: each column's kept positions first, in position order (then zeros);
    a prefix count and one scatter, not a sort."""
    cols, length = alive.shape
    rank = alive.long().cumsum(-1) - 1
    rank = torch.where(alive & (rank < top), rank, top)  # the rest go to a spare column
    order = torch.zeros(cols, top + 1, dtype=torch.long, device=alive.device)
    positions = torch.arange(length, device=alive.device).expand(cols, length)
    return order.scatter_(1, rank, positions)[:, :top]


class H2OCache(SelectiveCache):
    # each row's scores accumulate over its own steps and evictions: a row does not take
    # another sequence's columns (a request waits for the next block instead)
    takes_rows = False

    def __init__(self, spec: CacheSpec, policy: "H2OPolicy"):
        super().__init__(spec, policy)
        cols = spec.batch_size * spec.kv_heads
        dev = spec.tiers.device
        self.alive = torch.zeros(cols, spec.max_len, dtype=torch.bool, device=dev)
        self.score = torch.zeros(cols, spec.max_len, dtype=torch.float32, device=dev)

    def _columns(self, x: torch.Tensor) -> torch.Tensor:
        """[b, KV, t] -> [b*KV, t]."""
        return x.reshape(-1, x.shape[-1])

    def store_prompt(self, q, k, v, valid) -> None:
        super().store_prompt(q, k, v, valid)
        length = k.shape[1]
        mass = prompt_key_mass(q, k, valid, self.spec.window)
        kv_valid = valid[:, None, :].expand(-1, self.spec.kv_heads, -1)
        self.score[:, :length] = self._columns(mass)
        self.alive[:, :length] = self._columns(kv_valid)
        self._evict(self._columns(kv_valid))

    def _budget(self, n_valid: torch.Tensor):
        """Tokens kept per column: ceil((hh + recent) x context), the newest ceil(recent x
        context) of them by position and the rest by accumulated attention."""
        opts = self.policy
        n = n_valid.double()
        keep = torch.minimum(torch.ceil(n * (opts.hh_ratio + opts.recent_ratio) - 1e-9), n)
        recent = torch.minimum(torch.ceil(n * opts.recent_ratio - 1e-9), keep)
        return (keep - recent).long(), recent.long()

    def _evict(self, valid_cols: torch.Tensor) -> None:
        """Keep the ``recent`` newest and the ``heavy`` highest-scoring others, per column."""
        length = valid_cols.shape[1]
        n_valid = valid_cols.sum(-1)
        heavy, recent = self._budget(n_valid)
        pos = torch.arange(length, device=valid_cols.device)
        # rank of each valid token from the newest (0 = newest)
        newest = torch.flip(torch.cumsum(torch.flip(valid_cols.long(), [1]), 1), [1]) - 1
        in_recent = valid_cols & (newest < recent[:, None])
        candidates = self.alive[:, :length] & valid_cols & ~in_recent
        score = self.score[:, :length].masked_fill(~candidates, -math.inf)
        # the best ``heavy`` per column: a partial sort to a bound known without a sync
        most = min(length, math.ceil(length * self.policy.hh_ratio) + 1)
        best = score.topk(most, dim=-1).indices
        keep_heavy = torch.zeros_like(candidates).scatter_(
            1, best, pos[:most].expand(best.shape) < heavy[:, None])
        keep_heavy &= candidates
        self.alive[:, :length] = in_recent | keep_heavy
        # the next token will not see tokens outside the sliding window: evicted for good
        self.alive[:, :self.spec.first_visible(length)] = False

    def load(self, length: int) -> Loaded:
        b, kv = self.spec.batch_size, self.spec.kv_heads
        tiers = self.spec.tiers
        if self.k.addressable:  # on the device: gather there, padded to the budget, no sync
            alive = self.alive[:, :length]
            top = min(length, math.ceil(length * (self.policy.hh_ratio
                                                   + self.policy.recent_ratio)) + 1)
            order = _alive_first(alive, top)
            counts = alive.sum(-1)
            k_sel, v_sel = gather_on_device(self, order.view(b, kv, top))
            used = counts.sum()
            self.count(used, used, length)
            return Loaded.chosen(k_sel, v_sel, counts, order)
        alive = tiers.host_values(self.alive[:, :length])[0]  # the one sync of the step
        counts = alive.sum(-1)
        top = int(counts.max())
        order = _alive_first(alive, top)
        k_sel, v_sel, moved = fetch_selected(self, order.view(b, kv, top), counts.view(b, kv))
        self.count(moved, moved, length)
        return Loaded.chosen(k_sel, v_sel, tiers.index_to_device(counts),
                             tiers.index_to_device(order))

    def attend(self, loaded: Loaded, q, k_new, v_new, valid, bias, sinks=None) -> torch.Tensor:
        b, kv = self.spec.batch_size, self.spec.kv_heads
        k_sel, v_sel, counts, order = loaded.k, loaded.v, loaded.counts, loaded.order
        top = k_sel.shape[0] - 1  # the last row is the new token's
        out, mass = attend_selected(q, k_sel, v_sel, k_new, v_new, counts.view(b, kv),
                                    return_key_mass=True)
        got = self._columns(mass)  # [cols, top + 1]; masked rows got 0
        length = valid.shape[1] - 1
        self.score.scatter_add_(1, order, got[:, :top])
        self.score[:, length] = got[:, top]
        self.alive[:, length] = True
        valid_cols = valid[:, None, :].expand(-1, kv, -1).reshape(b * kv, -1)
        self._evict(valid_cols)
        return out


class H2OPolicy(SelectivePolicy):
    computes_sinks = False  # its attention takes no sinks
    name = "h2o"
    summary = "keep the heavy hitters and the newest tokens, evict the rest for good"
    needs_prompt_queries = True  # the prompt's attention scores the heavy hitters
    overhead_name = "h2o"
    default_overhead_s = 0.2e-3

    def __init__(self, hh_ratio: float = 0.1, recent_ratio: float = 0.1):
        super().__init__()
        for flag, v in [("--hh-ratio", hh_ratio), ("--recent-ratio", recent_ratio)]:
            if not 0 <= v <= 1:
                raise ConfigError(f"{flag} must be in [0, 1] (got {v})")
        if hh_ratio + recent_ratio <= 0:
            raise ConfigError("--hh-ratio plus --recent-ratio must be above 0")
        self.hh_ratio, self.recent_ratio = hh_ratio, recent_ratio

    @classmethod
    def add_args(cls, parser) -> None:
        g = parser.add_argument_group("H2O (with --kv-policy h2o)")
        g.add_argument("--hh-ratio", type=float, default=0.1,
                       help="heavy hitters kept, as a fraction of the context")
        g.add_argument("--recent-ratio", type=float, default=0.1,
                       help="recent tokens kept, as a fraction of the context")

    @classmethod
    def from_args(cls, args) -> "H2OPolicy":
        return cls(args.hh_ratio, args.recent_ratio)

    @classmethod
    def planned(cls, fraction: float) -> "H2OPolicy":
        return cls(fraction / 2, fraction / 2)

    @property
    def kv_fraction(self) -> float:
        return min(1.0, self.hh_ratio + self.recent_ratio)

    def fetch_fraction(self, cfg, context: float | None = None) -> float:
        return self.kv_fraction

    def decode_work(self, cfg, batch: int, context: float, item: int) -> DecodeWork:
        return DecodeWork(gathers_rows=True, layers=cfg.num_layers, overhead=self.overhead_name)

    def device_bytes(self, cfg, policy, item: int, max_len: int,
                     weights_in_place: bool = False, on_cpu: bool = False) -> dict[str, int]:
        caches = cfg.num_layers * policy.num_gpu_batches
        cols = policy.gpu_batch_size * cfg.num_kv_heads
        top = min(max_len, math.ceil(max_len * (self.hh_ratio + self.recent_ratio)) + 1)
        b, heads = policy.gpu_batch_size, cfg.num_heads
        rows = min(max_len, score_rows(b, heads, max_len))
        return {"h2o_scores_and_masks": caches * cols * max_len * (1 + 4),  # bool + float32
                "selected_rows": 2 * cfg.kv_copies * (top + 1) * cols * cfg.head_dim * item,
                # the prompt's key mass: one chunk of float32 scores, their softmax and bias
                "prompt_scores": 3 * 4 * b * heads * max_len * rows}

    def make_cache(self, spec: CacheSpec) -> H2OCache:
        return H2OCache(spec, self)

    def settings(self) -> dict:
        return {"hh_ratio": self.hh_ratio, "recent_ratio": self.recent_ratio}
