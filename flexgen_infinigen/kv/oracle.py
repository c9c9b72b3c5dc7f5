"""The oracle: per KV head and decode step, attention over the cached tokens that the exact
scores rank highest (by default the most softmax mass summed over the group's query heads).

It reads the whole cache to score it, so it moves as many bytes as the full cache: it is an
evaluation tool, the upper bound every approximate selection at the same budget is measured
against, not a fast path.
"""
from __future__ import annotations

import math

import torch

from ..config import ConfigError
from .base import CacheSpec
from .full import FullCache, FullPolicy, attend_selected, from_rows, row_buffers
from .options import SelectionOptions
from .selection import select
from .stats import FetchStats


class OracleCache(FullCache):
    def __init__(self, spec: CacheSpec, policy: "OraclePolicy"):
        super().__init__(spec)
        self.policy = policy
        self.resident = False  # attend needs the loaded rows, wherever the cache lives
        self.speculative = spec.layer >= policy.options.first_layer
        self.row_bytes = sum(self.bytes_by_tier().values()) / (
            spec.max_len * spec.batch_size * spec.kv_heads)

    def store_token(self, k_new, v_new, position: int) -> None:
        self._store(k_new, v_new, position)

    def attend(self, loaded, q, k_new, v_new, valid, bias) -> torch.Tensor:
        b, kv = self.spec.batch_size, self.spec.kv_heads
        length = valid.shape[1] - 1
        n = length * b * kv
        if not self.speculative:
            self.policy.stats.add(self.spec.layer, n, n, n, self.row_bytes, speculative=False)
            return super().attend(loaded, q, k_new, v_new, valid, bias)
        first = self.spec.first_visible(length)  # loaded rows start there (sliding window)
        k_rows, v_rows = loaded[0][:length - first], loaded[1][:length - first]  # [t, b*KV, d]
        keys = from_rows(k_rows, b)  # [b, t, KV, d]
        h, d = q.shape[2], q.shape[3]
        qg = q[:, 0].view(b, kv, h // kv, d)
        scores = torch.einsum("bkgd,btkd->bkgt", qg.float(), keys.float()) / math.sqrt(d)
        opts = self.policy.options
        order, counts = select(scores, valid[:, first:length], opts.selection, opts.alpha,
                               opts.budget)
        top = order.shape[-1]
        index = order.permute(2, 0, 1).reshape(top, b * kv)[..., None].expand(-1, -1, d)
        k_sel, v_sel = row_buffers(self.spec, top + 1, "selected")
        torch.gather(k_rows, 0, index, out=k_sel[:top])
        torch.gather(v_rows, 0, index, out=v_sel[:top])
        self.policy.stats.add(self.spec.layer, n, int(counts.sum()), n, self.row_bytes)
        return attend_selected(q, k_sel, v_sel, k_new, v_new, counts)


class OraclePolicy(FullPolicy):
    name = "oracle"
    default_rule = "mass"

    def __init__(self, options: SelectionOptions | None = None, **kw):
        self.options = (options or SelectionOptions(**kw)).validate()
        self.stats = FetchStats()

    def reset_stats(self) -> None:
        self.stats = FetchStats()

    def prepare(self, lm) -> None:
        if lm.engine.policy.cpu_cache_compute:
            raise ConfigError("--kv-policy oracle attends on the compute device; it cannot be "
                              "combined with --cpu-cache-compute (drop one)")
        self.options = self.options.with_defaults(lm.cfg.family, self.default_rule)

    def make_cache(self, spec: CacheSpec) -> OracleCache:
        return OracleCache(spec, self)

    def report(self) -> dict:
        o = self.options
        return {"kv_policy": self.name, "selection": o.selection, "alpha": o.alpha,
                "max_kv_fraction": o.max_kv_fraction, "keep_sink": o.keep_sink,
                "keep_recent": o.keep_recent, **self.stats.report()}

