"""The oracle: per KV head and decode step, attention over the cached tokens that the exact
scores rank highest (by default the most softmax mass summed over the group's query heads).

It reads the whole cache to score it, so it moves as many bytes as the full cache: it is an
evaluation tool, the upper bound every approximate selection at the same budget is measured
against, not a fast path.
"""
from __future__ import annotations

import math

import torch

from .base import CacheSpec, Loaded, PolicyContext
from .full import attend_selected, from_rows, row_buffers
from .options import SelectionOptions, add_selection_args, selection_from_args
from .selection_rules import select
from .chosen_rows import SelectiveCache, SelectivePolicy


class OracleCache(SelectiveCache):
    def attend(self, loaded: Loaded, q, k_new, v_new, valid, bias, sinks=None) -> torch.Tensor:
        b, kv = self.spec.batch_size, self.spec.kv_heads
        length = valid.shape[1] - 1
        if not self.selecting:
            self.count_full_read(length)
            return super().attend(loaded, q, k_new, v_new, valid, bias)
        first = self.spec.first_visible(length)  # loaded rows start there (sliding window)
        k_rows, v_rows = loaded.k[:length - first], loaded.v[:length - first]  # [t, b*KV, d]
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
        self.count(length * b * kv, int(counts.sum()), length)  # it read the whole cache
        return attend_selected(q, k_sel, v_sel, k_new, v_new, counts)


class OraclePolicy(SelectivePolicy):
    computes_sinks = False  # its attention takes no sinks
    name = "oracle"
    summary = ("exact top tokens by true attention at the same budget; it reads the whole "
               "cache to score it, so it is an accuracy upper bound for evaluation, not a fast "
               "path")
    plannable = False
    default_rule = "mass"

    def __init__(self, options: SelectionOptions | None = None, **kw):
        super().__init__()
        self.options = (options or SelectionOptions(**kw)).validate()

    @classmethod
    def add_args(cls, parser) -> None:
        add_selection_args(parser)

    @classmethod
    def from_args(cls, args) -> "OraclePolicy":
        return cls(selection_from_args(args, SelectionOptions))

    def prepare(self, ctx: PolicyContext) -> None:
        self.options = self.options.with_defaults(ctx.cfg.family, self.default_rule)

    def make_cache(self, spec: CacheSpec) -> OracleCache:
        return OracleCache(spec, self, spec.layer >= self.options.first_layer)

    def settings(self) -> dict:
        o = self.options
        return {"selection": o.selection, "alpha": o.alpha, "max_kv_fraction": o.max_kv_fraction,
                "keep_sink": o.keep_sink, "keep_recent": o.keep_recent}
