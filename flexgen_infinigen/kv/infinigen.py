"""InfiniGen: during layer i, rehearse layer i+1's attention with a few skewed columns of its
query and cached keys, and fetch only the K/V rows of the tokens that score high.

Flow per decode step, for each layer i+1 >= ``first_layer`` and GPU batch:

1. ``speculate(x, ...)`` (compute stream, during layer i): layer i+1's query from layer i's
   attention input, projected on the kept skewed columns (:mod:`..infinigen.rehearsal`),
   scored against layer i+1's speculation keys (on the compute device); a selection rule
   (:mod:`.selection`) turns the scores into ranked rows and a count per KV head.
2. ``load`` (cache-load lane, overlapped with layer i): waits for that selection, gathers
   exactly the selected rows on the host into a pinned buffer and copies them to the device,
   where they are laid out per KV head for attention.
3. ``attend``: attention over the fetched rows (rows past a head's own count are masked) plus
   the new token.

The KV cache holds the model's own keys: only the speculation is skewed.
"""
from __future__ import annotations

import math
import os
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from ..infinigen.skew import project_per_head
from ..runtime import cpu_kernels
from ..runtime.attention import attend_rows
from .base import CacheSpec, DecodeWork
from .full import attend_selected, to_rows
from .options import InfiniGenOptions, add_selection_args, selection_from_args
from .pool import KVPool
from .selection import select
from .selective import (SelectiveCache, SelectivePolicy, attend_packed_rows, fetch_selected,
                        gather_on_device)
from .spec_keys import KINDS, SpeculationKeys, bytes_per_key
from .spec_pages import PAGE_KINDS
from .spec_pages import SpeculationPages as PageSummaries

SELECTION_TIMEOUT_S = 600  # a load waits this long for its speculation, then fails
READ_ALL = "read all"  # a step's selection when the layer is read whole
PACKED = "packed"  # a step's chosen rows, to be read as 4-bit codes where they are
# --select-from-mb by device: on a CPU a layer's speculation (~0.2 ms of kernels and Python)
# costs more than the rows it spares below about 12 MB of KV (SmolLM2: 4K tokens x batch 2);
# over a GPU's link every spared row pays (the paper's regime)
SELECT_FROM_MB = {"cpu": 12.0, "cuda": 0.0}
SELECT_FROM_ENV = "FLEXGEN_INFINIGEN_SELECT_FROM_MB"  # the default's default, for the tests


class InfiniGenCache(SelectiveCache):
    def __init__(self, spec: CacheSpec, policy: "InfiniGenPolicy"):
        super().__init__(spec, policy, spec.layer >= policy.options.first_layer)
        opts = policy.options
        self.projection = None  # [b, KV, d, r]: set from the prompt (or the calibration)
        self.keys = None
        if self.selecting:
            kind = PageSummaries if opts.speculation_keys in PAGE_KINDS else SpeculationKeys
            self.keys = kind(opts.speculation_keys, spec.max_len,
                             spec.batch_size * spec.kv_heads, policy.rehearsal.columns,
                             spec.dtype, spec.tiers)
        self.selection = None
        self.ready = threading.Event()
        self.aborted = False
        # on a CPU with the kernels, attention reads the selected rows in the cache itself
        self.attend_in_place = (self.selecting and self.k.addressable and not spec.tiers.is_cuda
                                and spec.dtype == torch.float32 and spec.head_dim % 8 == 0
                                and cpu_kernels.library() is not None)
        self.pool = None
        if self.selecting and opts.kv_pool_capacity < 1:
            self.pool = KVPool(opts.kv_pool_capacity, opts.eviction,
                               spec.batch_size * spec.kv_heads, spec.max_len, spec.tiers.device)

    def _write_keys(self, k: torch.Tensor, start: int, valid=None) -> None:
        """Project keys ``[b, s, KV, d]`` on the kept columns into the speculation keys
        (page summaries also take ``valid`` ``[b, s]``: padding widens no page)."""
        if self.keys is None:
            return
        rows = project_per_head(k, self.projection).transpose(0, 1)  # [s, b, KV, r]
        rows = rows.reshape(rows.shape[0], -1, rows.shape[-1])
        if isinstance(self.keys, PageSummaries):
            seen = None if valid is None else valid.t().repeat_interleave(self.spec.kv_heads, 1)
            self.keys.write(rows, start, seen)
        else:
            self.keys.write(rows, start)

    def store_prompt(self, q, k, v, valid) -> None:
        if self.selecting:
            # in the runtime dtype once, not converted again at every decode step
            self.projection = self.policy.rehearsal.prompt_projection(
                self.spec.layer, self.spec.kv_heads, q, valid).to(k.dtype)
        self._write_keys(k, 0, valid)
        super().store_prompt(q, k, v, valid)

    # ---- speculation (compute stream, during the previous layer) ----------------------------
    def reads_whole(self, length: int) -> bool:
        """Whether this step reads the layer whole: its KV (the batch's) is too small for
        choosing to pay (``--select-from-mb``)."""
        mb = self.policy.options.select_from_mb  # None until prepare() sets the device's
        if not mb:
            return False
        return length * self.spec.batch_size * self.spec.kv_heads * self.row_bytes < mb * 1e6

    def speculate(self, x, pos_enc, valid, visible) -> None:
        if not self.selecting:
            return
        if self.reads_whole(valid.shape[1] - 1):
            self.selection = READ_ALL
            self.ready.set()
            return
        stats = self.policy.stats
        if x.is_cuda:  # kernels run later than they are launched: time them with events
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        order, counts = self._rank(x, pos_enc, valid, visible)
        self._hand_over(order, counts)
        if x.is_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            stats.speculation_events.append((start, end))
        else:
            stats.speculation_s += time.perf_counter() - start

    def _rank(self, x, pos_enc, valid, visible):
        spec, opts = self.spec, self.policy.options
        b, kv, d = spec.batch_size, spec.kv_heads, spec.head_dim
        pq = self.policy.rehearsal.projected_query(spec.layer, x, pos_enc, kv, self.projection)
        pq = pq * (1.0 / math.sqrt(d))  # scaled first: the product stays in fp16's range
        length = valid.shape[1] - 1  # cached tokens (the new one is always attended)
        seen = visible[:, :length]
        if self.pool is None and opts.selection == "mass" and not (opts.keep_sink
                                                                  or opts.keep_recent):
            caps = self.policy.step_caps(visible, length, kv)
            width = min(opts.budget.most(length), length)
            if isinstance(self.keys, PageSummaries):  # whole pages, their own counts
                return self.keys.select_mass(pq, seen, caps.rows, width)
            order = self.keys.select_mass(pq, caps.seen, caps.per_column, width)
            if order is not None:
                return order, caps.counts
        scores = self.keys.scores(pq, length)  # [b, KV, G, t]
        allowed = None
        if self.pool is not None:  # evicted tokens are never selected again
            allowed = self.pool.alive[:, :length].view(b, kv, length)
        return select(scores, seen, opts.selection, opts.alpha, opts.budget, allowed)

    def _hand_over(self, order: torch.Tensor, counts: torch.Tensor) -> None:
        """Give the ranking to the load lane. Unless the cache is on the device, its copy to
        the host starts here, without a wait."""
        if self.k.addressable:
            done = torch.cuda.current_stream().record_event() if order.is_cuda else None
            self.selection = (order, counts, done)
        else:
            self.selection = (order, counts, self.spec.tiers.host_values_async(order, counts))
        self.ready.set()

    def abort(self) -> None:
        self.aborted = True
        self.ready.set()

    # ---- the decode step --------------------------------------------------------------------
    def load(self, length: int):
        if not self.selecting:  # reads every visible row (the sliding window's, if any)
            self.count_full_read(length)
            return super().load(length)
        if not self.ready.wait(SELECTION_TIMEOUT_S):
            raise RuntimeError(f"no speculation arrived for layer {self.spec.layer}")
        if self.aborted:
            raise RuntimeError("generation stopped by an error elsewhere")
        self.ready.clear()
        if self.selection is READ_ALL:
            self.selection = None
            self.count_full_read(length)
            in_place = self.attend_in_place or self.packed_here
            return READ_ALL, None if in_place else super().load(length)
        order, counts, pending = self.selection
        self.selection = None
        if self.packed_here:  # 4-bit codes attended where they are (order is on the CPU)
            used = int(counts.sum())
            self.count(used, used, length)
            return PACKED, None, counts, order
        if self.k.addressable:  # gathered where it lives, no sync
            if pending is not None:  # the load stream must see the finished speculation
                torch.cuda.current_stream().wait_event(pending)
            if self.attend_in_place:  # a CPU kernel reads the chosen rows where they are
                used = int(counts.sum())  # on the CPU: no sync to avoid
                self.count(used, used, length)
                return None, None, counts, order
            k_sel, v_sel = gather_on_device(self, order)
            used = counts.sum()
            self.count(used, used, length)
            return k_sel, v_sel, counts, order
        # the one host sync: the gather on the host needs the indices
        order_host, counts_host = pending()
        k_sel, v_sel, moved = fetch_selected(self, order_host, counts_host)
        self.count(moved, moved, length)
        return k_sel, v_sel, counts, order[:, :, :k_sel.shape[0] - 1]

    def attend(self, loaded, q, k_new, v_new, valid, bias) -> torch.Tensor:
        self._write_keys(k_new, valid.shape[1] - 1)
        if not self.selecting:
            return super().attend(loaded, q, k_new, v_new, valid, bias)
        if loaded[0] is READ_ALL:
            return self._attend_whole(loaded[1], q, k_new, v_new, valid, bias)
        k_sel, v_sel, counts, index = loaded
        if self.pool is not None:
            self._update_pool(index, counts, valid)
        if k_sel is PACKED:
            out = attend_packed_rows(self, q, k_new, v_new, index, counts,
                                     valid.shape[1] - 1)
            if out is not None:
                return out
            k_sel, v_sel, _ = fetch_selected(self, index, counts)  # no kernel: expand them
        elif k_sel is None:
            return self._attend_in_place(q, k_new, v_new, index, counts)
        return attend_selected(q, k_sel, v_sel, k_new, v_new, counts)

    def _attend_whole(self, loaded, q, k_new, v_new, valid, bias) -> torch.Tensor:
        """Attention over every visible row, as the full cache attends: read where the cache
        lives (the new row written first; ``store_token`` writes it again), or over the rows
        ``load`` brought."""
        if loaded is not None:
            return super().attend(loaded, q, k_new, v_new, valid, bias)
        length = valid.shape[1] - 1
        first = self.spec.first_visible(length)
        if self.packed_here:  # 4-bit codes read where they are; store_token stores the row
            out = self._attend_packed(q, k_new, v_new, bias[..., first:], first, length)
            if out is not None:
                return out
            return super().attend(self._read_rows(length), q, k_new, v_new, valid, bias)
        self._store(k_new, v_new, length)
        rows = slice(first, length + 1)
        return attend_rows(q, self.k.view(rows), self.v.view(rows), bias[..., first:])

    def _attend_in_place(self, q, k_new, v_new, index, counts) -> torch.Tensor:
        """Attention over the selected rows read where the cache lives (cpu_kernels)."""
        b, heads, d = q.shape[0], q.shape[2], q.shape[3]
        cols = b * self.spec.kv_heads
        qc = q.reshape(cols, heads // self.spec.kv_heads, d) * (1.0 / math.sqrt(d))
        out = cpu_kernels.attend_indexed(qc, self.k.view(), self.v.view(), index, counts,
                                         to_rows(k_new)[0], to_rows(v_new)[0])
        return out.view(b, 1, heads * d).to(q.dtype)

    def _update_pool(self, index, counts, valid) -> None:
        """Record what this step used, then evict past the budget (the new token included)."""
        b, kv = self.spec.batch_size, self.spec.kv_heads
        self.pool.record_fetch(index.reshape(b * kv, -1), counts.reshape(b * kv))
        per_col = valid[:, None, :].expand(b, kv, valid.shape[1]).reshape(b * kv, -1)
        before = self.pool.evicted
        self.pool.evict(per_col)
        self.policy.stats.evicted += self.pool.evicted - before


@dataclass(frozen=True)
class StepCaps:
    """A step's caps for the mass rule, shared by its layers (see ``step_caps``)."""

    source: weakref.ref  # the visible mask they came from
    version: int  # its version counter then
    length: int
    kv: int
    seen: torch.Tensor  # [b, length] uint8: the tokens that may be chosen
    rows: torch.Tensor  # [b] int64: each row's cap
    per_column: torch.Tensor  # [b * KV] int64: each KV head's cap
    counts: torch.Tensor  # [b, KV] int64: the same, as the selection's counts


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

    # ---- command line -----------------------------------------------------------------------
    @classmethod
    def add_args(cls, parser) -> None:
        from ..flags import str2bool

        add_selection_args(parser)
        g = parser.add_argument_group("InfiniGen (with --kv-policy infinigen)")
        g.add_argument("--speculation-keys", default="int4",
                       help="the device copy of the keys that speculation scores against: every "
                            "skewed column quantized to 4 (default) or 2 bits, the paper's "
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
                       help="blend each prompt's own query statistics into its skew (measured "
                            "worse than the built-in calibration; default false)")
        g.add_argument("--column-score", default="q",
                       help="rank skewed columns by query energy, or query times key energy")
        g.add_argument("--kv-pool-capacity", type=float, default=1.0,
                       help="fraction of each head's context kept in the host pool")
        g.add_argument("--eviction", default="fifo", help="pool eviction: fifo, lru or counter")
        g.add_argument("--select-from-mb", type=float, default=None,
                       help="read a layer whole while its KV for the batch is under this many "
                            "MB, where choosing rows costs more than it spares (default 12 on "
                            "a CPU, 0 on a GPU); 0 always selects")

    @classmethod
    def from_args(cls, a) -> "InfiniGenPolicy":
        return cls(selection_from_args(
            a, InfiniGenOptions, partial_weight_ratio=a.partial_weight_ratio,
            speculation_keys=a.speculation_keys, calibration=a.calibration,
            prompt_skew=a.prompt_skew, column_score=a.column_score,
            kv_pool_capacity=a.kv_pool_capacity, eviction=a.eviction,
            select_from_mb=a.select_from_mb))

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

    def fetch_fraction(self, cfg) -> float:
        layers = cfg.num_layers
        full = min(self.options.first_layer, layers)  # these read the whole cache
        return (full + (layers - full) * self.options.max_kv_fraction) / layers

    def _columns(self, cfg) -> int:
        return max(1, round(self.options.ratio * cfg.head_dim))

    def _folds(self, cfg) -> bool:
        from ..models import family_of
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
        return DecodeWork(gathers_rows=True,
                          layers=max(0, cfg.num_layers - self.options.first_layer),
                          matmul_params=params, scan_bytes=keys + 4 * scores,
                          overhead=self.overhead_name)

    def device_bytes(self, cfg, policy, item: int, max_len: int) -> dict[str, int]:
        """Speculation keys (selecting layers only), the speculation weights (``r`` rows of
        W_Q per head where the projection folds into them, else the whole W_Q per layer),
        the projections, the KV pool's state and the selected rows in flight."""
        from ..models import family_of
        o = self.options.with_defaults(cfg.family, self.default_rule)
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
            "speculation_weights": layers * (rows * cfg.hidden_size + bias) * item,
            "projections": cfg.num_layers * cfg.num_kv_heads * d * r * item
            + (caches * cols * d * r * item if o.prompt_skew else 0),
            "selected_rows": 2 * 2 * (o.budget.most(max_len) + 1) * cols * d * item,
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
        self._step_caps = StepCaps(weakref.ref(visible), visible._version, length, kv,
                                   seen.to(torch.uint8).contiguous(), caps, counts.view(-1),
                                   counts)
        return self._step_caps

    # ---- running ----------------------------------------------------------------------------
    def prepare(self, lm) -> None:
        from dataclasses import replace

        from ..infinigen.rehearsal import Rehearsal

        self.options = self.options.with_defaults(lm.cfg.family, self.default_rule)
        if self.options.select_from_mb is None:
            env = os.environ.get(SELECT_FROM_ENV)
            self.options = replace(self.options, select_from_mb=float(env) if env else
                                   SELECT_FROM_MB.get(lm.tiers.device.type, 0.0))
        self.rehearsal = Rehearsal(lm, self.options)

    def make_cache(self, spec: CacheSpec) -> InfiniGenCache:
        return InfiniGenCache(spec, self)

    def settings(self) -> dict:
        o = self.options
        return {"selection": o.selection, "alpha": o.alpha,
                "partial_weight_ratio": o.ratio, "speculation_keys": o.speculation_keys,
                "max_kv_fraction": o.max_kv_fraction, "select_from_mb": o.select_from_mb,
                "keep_sink": o.keep_sink, "keep_recent": o.keep_recent}

    def report(self) -> dict:
        s, o = self.stats, self.options
        return {**super().report(),
                "speculation_time_s": s.speculation_s,
                "skew_calibration": self.rehearsal.meta() if self.rehearsal else None,
                "kv_pool_capacity": o.kv_pool_capacity, "eviction": o.eviction,
                "kv_pool_evicted_tokens": s.evicted}
