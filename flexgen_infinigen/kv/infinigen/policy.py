"""InfiniGen: during layer i, rehearse layer i+1's attention with a few skewed columns of its
query and cached keys, and fetch only the K/V rows of the tokens that score high.

Flow per decode step, for each layer i+1 >= ``first_layer`` and GPU batch:

1. ``speculate(x, ...)`` (compute stream, during layer i): layer i+1's query from layer i's
   attention input, projected on the kept skewed columns (:mod:`.rehearsal`),
   scored against layer i+1's speculation keys (on the compute device); a selection rule
   (:mod:`..selection_rules`) turns the scores into ranked rows and a count per KV head.
2. The row load. A KV cache in (pinned) host memory that the device maps: issued right
   after the ranking, on a side stream, the device reading the chosen rows itself
   (:mod:`...memory.mapped_rows`; the indices never reach the host); ``load`` (cache-load
   lane) hands them over. Otherwise ``load`` waits for the selection, gathers exactly the
   selected rows on the host into a pinned buffer and copies them to the device. Either way
   they are laid out per KV head for attention.
3. ``attend``: attention over the fetched rows (rows past a head's own count are masked) plus
   the new token.

The KV cache holds the model's own keys: only the speculation is skewed.
"""
from __future__ import annotations

import math
import weakref

import torch

from ...switches import SELECT_FROM_MB as SELECT_FROM_MB_SWITCH
from ..base import CacheSpec, DecodeWork, PolicyContext
from ..full import selected_bias
from .cache import PENDING_KEYS, InfiniGenCache, StepCaps
from ..options import add_selection_args, selection_from_args
from .options import InfiniGenOptions, own_query_runs
from ..chosen_rows import SelectivePolicy
from .spec_keys import KINDS, bytes_per_key

__all__ = ["InfiniGenCache", "InfiniGenPolicy", "StepCaps"]

# --select-from-mb by device. On a CPU a layer's speculation has a fixed cost (kernel calls
# and Python) that exceeds what reading the spared rows costs while the layer's KV is small
# (12 MB: SmolLM2 at 4K tokens x batch 2). On a GPU, until a measured crossover replaces it
# (gpu_check's long-context steps), choosing pays when the link time of the rows it spares,
# (1 - fraction) x KV / link bandwidth, beats what speculation adds: at small sizes, its
# launches (tens of kernels a layer; the device reads the rows, no host round trip). At the
# rates PCIe 4 and 5 x16 links are specified for, with a fifth of the rows kept, that
# crossover is 10-20 MB of KV per layer and batch; 16 MB is its middle (Llama-3.1-8B in
# bf16: 4K tokens at batch 1; OPT-13B in fp16 at batch 20: 40 tokens, so the paper's
# setting always selects)
SELECT_FROM_MB = {"cpu": 12.0, "cuda": 16.0}
SELECT_FROM_ENV = SELECT_FROM_MB_SWITCH.name  # the default's default, for the tests


class InfiniGenPolicy(SelectivePolicy):
    name = "infinigen"
    summary = ("rehearse the next layer's attention during this one and fetch only the K/V "
               "rows it will use")
    default_rule = "mass"
    speculates = True

    def __init__(self, options: InfiniGenOptions | None = None, **kw):
        super().__init__()
        self.options = (options or InfiniGenOptions(**kw)).validate()
        self.rehearsal = None
        self._step_caps: StepCaps | None = None
        self._rows_bias = None  # (counts, version, top, bias) of the last rows_bias

    # ---- command line -----------------------------------------------------------------------
    @classmethod
    def add_args(cls, parser) -> None:
        from ...flags import str2bool

        add_selection_args(parser)
        g = parser.add_argument_group("InfiniGen (with --kv-policy infinigen)")
        g.add_argument("--speculation-keys", default="int4",
                       help="the device copy of the keys that speculation scores against: every "
                            "skewed column quantized to 4 (default), 8 or 2 bits, the paper's "
                            "partial columns in the runtime dtype, or page summaries "
                            "(pages8/16/32: the minimum and maximum of each page's keys; whole "
                            "pages are chosen, scoring costs pages, not tokens)")
        g.add_argument("--partial-weight-ratio", type=float, default=None,
                       help="fraction of head_dim skewed columns used to rehearse attention "
                            "(default 0.3 for partial keys, 1.0 for quantized keys)")
        g.add_argument("--calibration", default=None,
                       help="text file for skewing (default: the store's skew, else built-in "
                            "text)")
        g.add_argument("--prompt-skew", type=str2bool, default=False,
                       help="blend each prompt's own query statistics into its skew (a "
                            "short prompt's statistics are noisier than the calibration "
                            "text's; default false)")
        g.add_argument("--column-score", default="q",
                       help="rank skewed columns by query energy, or query times key energy")
        g.add_argument("--speculation-query", default="auto",
                       choices=["input", "renorm", "own", "auto"],
                       help="what the rehearsal multiplies by layer i+1's query weights: "
                            "layer i's attention input (input, the paper's), or layer i's "
                            "residual through layer i+1's own input norm (renorm: no extra "
                            "reads, a closer guess); or own: no guess, each layer chooses "
                            "with its own query as it attends (a KV cache in CPU memory read "
                            "in place only: nothing is fetched ahead); auto: own where "
                            "that holds, else renorm where the model allows, else input "
                            "(docs/usage/long_context.md)")
        g.add_argument("--kv-pool-capacity", type=float, default=1.0,
                       help="fraction of each head's context kept in the host pool")
        g.add_argument("--eviction", default="fifo", help="pool eviction: fifo, lru or counter")
        g.add_argument("--select-from-mb", type=float, default=None,
                       help="read a layer whole while its KV for the batch is under this many "
                            "MB, where choosing rows costs more than it spares (default 12 on "
                            "a CPU, 16 on a GPU until measured); 0 always selects")

    @classmethod
    def from_args(cls, a) -> "InfiniGenPolicy":
        return cls(selection_from_args(
            a, InfiniGenOptions, partial_weight_ratio=a.partial_weight_ratio,
            speculation_keys=a.speculation_keys, calibration=a.calibration,
            prompt_skew=a.prompt_skew, column_score=a.column_score,
            speculation_query=a.speculation_query, kv_pool_capacity=a.kv_pool_capacity,
            eviction=a.eviction, select_from_mb=a.select_from_mb))

    @classmethod
    def planned(cls, fraction: float) -> "InfiniGenPolicy":
        return cls(max_kv_fraction=fraction)

    overhead_name = "infinigen"
    default_overhead_s = 0.3e-3

    @classmethod
    def overhead_probe(cls) -> "InfiniGenPolicy":
        return cls(select_from_mb=0.0)  # a tiny model's layers are small: select anyway

    def overhead_layers(self, cfg) -> int:
        return max(1, cfg.num_layers - self.options.first_layer)

    @property
    def needs_prompt_queries(self) -> bool:
        return self.options.prompt_skew  # a per-prompt skew comes from the prompt's queries

    # ---- what it costs ----------------------------------------------------------------------
    @property
    def kv_fraction(self) -> float:
        return self.options.max_kv_fraction

    def fetch_fraction(self, cfg, context: float | None = None) -> float:
        layers = cfg.num_layers
        full = min(self.options.first_layer, layers)  # these read the whole cache
        share = self.options.max_kv_fraction
        if context:  # the floor in rows (all of a context under it)
            share = min(1.0, max(share, self.options.budget.min_num / context))
        return (full + (layers - full) * share) / layers

    def _columns(self, cfg) -> int:
        return max(1, round(self.options.ratio * cfg.head_dim))

    def _folds(self, cfg) -> bool:
        from ...models import family_of
        return family_of(cfg).SKEW_FOLDS_INTO_WEIGHTS and not self.options.prompt_skew

    def decode_work(self, cfg, batch: int, context: float, item: int) -> DecodeWork:
        """Speculation in every selecting layer: the projected query (OPT: r columns per
        head; rotary models: the full query and its projection) and the scores against
        the speculation keys."""
        r = self._columns(cfg)
        params = cfg.hidden_size * cfg.num_heads * r if self._folds(cfg) else \
            cfg.hidden_size * cfg.q_dim + cfg.num_heads * cfg.head_dim ** 2
        scores = batch * cfg.num_heads * context * 4
        keys = batch * context * cfg.num_kv_heads * bytes_per_key(
            self.options.speculation_keys, r, item)
        return DecodeWork(gathers_rows=True, maps_rows=True,
                          layers=max(0, cfg.num_layers - self.options.first_layer),
                          matmul_params=params, scan_bytes=keys + 4 * scores,
                          overhead=self.overhead_name)

    def device_bytes(self, cfg, policy, item: int, max_len: int,
                     weights_in_place: bool = False, on_cpu: bool = False) -> dict[str, int]:
        """Speculation keys (selecting layers only), the speculation weights (``r`` rows of
        W_Q per head where the projection folds into them, else the whole W_Q per layer: a
        float copy, except 4-bit weights multiplied in place, which the rehearsal shares
        with the layer), the projections, the KV pool's state, the selected rows in flight
        and the decode keys that wait while a layer reads itself whole. Each layer's own
        query (``own``, or ``auto`` where own runs) needs no speculation weights."""
        from ...models import family_of
        o = self.options.with_defaults(cfg.family, self.default_rule)
        own = o.speculation_query == "own" or (
            o.speculation_query == "auto" and own_query_runs(cfg, policy, item, on_cpu))
        d = cfg.head_dim
        r = self._columns(cfg)
        layers = max(0, cfg.num_layers - o.first_layer)
        caches = layers * policy.num_gpu_batches
        cols = policy.gpu_batch_size * cfg.num_kv_heads
        rows = cfg.num_heads * (r if self._folds(cfg) else d)
        bias = rows if "layers.0.q_proj.bias" in family_of(cfg).weight_shapes(cfg) else 0
        terms = {
            "speculation_keys": round(caches * max_len * cols * bytes_per_key(
                o.speculation_keys, r, item)),
            "speculation_weights": 0 if own else layers * (rows * cfg.hidden_size * (
                self._folds(cfg) or not weights_in_place) + bias) * item,
            "projections": cfg.num_layers * cfg.num_kv_heads * d * r * item
            + (caches * cols * d * r * item if o.prompt_skew else 0),
            "selected_rows": 2 * cfg.kv_copies * (o.budget.most(max_len) + 1) * cols * d * item,
            # decode keys waiting while a layer reads itself whole (infinigen_cache)
            "pending_keys": caches * min(PENDING_KEYS, max_len) * cols * d * item,
        }
        bits = KINDS.get(o.speculation_keys)
        if bits is not None:  # the codes of one cache unpacked for scoring (one at a time)
            per_byte = 8 // bits
            terms["speculation_unpacked"] = max_len * cols * (-(-r // per_byte) * per_byte) * item
        if o.prompt_skew:
            terms["gram_matrices"] = 2 * cfg.num_layers * cfg.num_kv_heads * d * d * 4
        if o.kv_pool_capacity < 1:
            terms["kv_pool"] = caches * cols * max_len * (1 + 8 + 8)  # bool, 2 x int64
        return terms

    def step_caps(self, visible: torch.Tensor, length: int, kv: int) -> "StepCaps":
        """What the mass rule needs of a step's ``visible`` mask ``[b, > length]``, the same
        for every layer of the step: computed for its first layer, then reused while the
        same mask (the same tensor, unchanged) comes back."""
        memo = self._step_caps
        if (memo is not None and memo.source() is visible and memo.version == visible._version
                and memo.length == length and memo.kv == kv):
            return memo
        seen = visible[:, :length]
        n_valid = seen.sum(-1)
        caps = torch.minimum(self.options.budget.caps(n_valid), n_valid)
        counts = caps[:, None].expand(-1, kv).contiguous()
        bias = torch.zeros(seen.shape, dtype=torch.float32, device=seen.device)
        bias = bias.masked_fill_(~seen, -math.inf)[:, None, :]  # [b, 1, length]
        self._step_caps = StepCaps(weakref.ref(visible), visible._version, length, kv,
                                   seen.to(torch.uint8).contiguous(), caps, counts,
                                   bias.unsqueeze(2), bias)
        return self._step_caps

    def rows_bias(self, counts: torch.Tensor, top: int) -> torch.Tensor:
        """:func:`~.full.selected_bias` of ``counts``, computed once while the same counts
        come back (the mass rule's are the step's caps, shared by its layers)."""
        memo = self._rows_bias
        if (memo is not None and memo[0]() is counts and memo[1] == counts._version
                and memo[2] == top):
            return memo[3]
        bias = selected_bias(counts, top)
        self._rows_bias = (weakref.ref(counts), counts._version, top, bias)
        return bias

    # ---- running ----------------------------------------------------------------------------
    def prepare(self, ctx: PolicyContext) -> None:
        from dataclasses import replace

        from .rehearsal import Rehearsal, auto_query

        self.options = self.options.with_defaults(ctx.cfg.family, self.default_rule)
        if self.options.speculation_query == "auto":
            self.options = replace(self.options,
                                   speculation_query=auto_query(ctx, self.options))
        if self.options.select_from_mb is None:
            env = SELECT_FROM_MB_SWITCH.get()
            self.options = replace(self.options, select_from_mb=env if env is not None else
                                   SELECT_FROM_MB.get(ctx.tiers.device.type, 0.0))
        self.rehearsal = Rehearsal(ctx, self.options)

    def make_cache(self, spec: CacheSpec) -> InfiniGenCache:
        return InfiniGenCache(spec, self)

    def settings(self) -> dict:
        o = self.options
        return {"selection": o.selection, "alpha": o.alpha,
                "partial_weight_ratio": o.ratio, "speculation_keys": o.speculation_keys,
                "speculation_query": o.speculation_query,
                "max_kv_fraction": o.max_kv_fraction, "select_from_mb": o.select_from_mb,
                "keep_sink": o.keep_sink, "keep_recent": o.keep_recent}

    def report(self) -> dict:
        s, o = self.stats, self.options
        return {**super().report(),
                "speculation_time_s": s.speculation_s,
                "skew_calibration": self.rehearsal.meta() if self.rehearsal else None,
                "kv_pool_capacity": o.kv_pool_capacity, "eviction": o.eviction,
                "kv_pool_evicted_tokens": s.evicted}
