"""InfiniGen's cache of one layer and GPU batch: speculation during the previous layer
(scores over the speculation keys, a selection rule), the load of the chosen rows, and
attention over them; see :mod:`.policy` for the flow and the policy."""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...config import ConfigError
from .skew import project_per_head
from ...kernels import cpu_kernels
from ...kernels.attention import attend_rows
from ..base import CacheSpec, KVCache, Loaded, Read
from ..full import attend_selected
from .pool import KVPool
from ..selection_rules import mass_order, select
from ..chosen_rows import (
    SelectiveCache,
    attend_chosen_in_place,
    attend_packed_rows,
    fetch_selected,
    gather_mapped,
    gather_on_device,
)
from . import fused_select
from .handoff import OWN_QUERY, READ_WHOLE, Handed, Speculation
from .spec_keys import SpeculationKeys
from .spec_pages import PAGE_KINDS
from .spec_pages import SpeculationPages as PageSummaries

if TYPE_CHECKING:
    from ...kernels.layer_call import LayerCall

SELECTION_TIMEOUT_S = 600  # a load waits this long for its speculation, then fails
# a layer that reads itself whole keeps at most this many decode steps' keys waiting to be
# projected and packed into its speculation keys (written together, not one a step)
PENDING_KEYS = 256


class InfiniGenCache(SelectiveCache):
    speculates = True  # the layer before hands it its attention input

    def __init__(self, spec: CacheSpec, policy):
        super().__init__(spec, policy, spec.layer >= policy.options.first_layer)
        opts = policy.options
        self.projection = None  # [b, KV, d, r]: set from the prompt (or the calibration)
        self.query_projection = None  # the same times 1/sqrt(d), for the query
        self.keys = None
        if self.selecting:
            kind = PageSummaries if opts.speculation_keys in PAGE_KINDS else SpeculationKeys
            self.keys = kind(opts.speculation_keys, spec.max_len,
                             spec.batch_size * spec.kv_heads, policy.rehearsal.columns,
                             spec.dtype, spec.tiers)
        self.pending_keys: list[torch.Tensor] = []  # decode keys not yet in self.keys
        self.pending_start = 0
        self.stored_at = None  # a position whose new row attention already wrote in place
        self.selection: Speculation | None = None  # this step's, from speculate() to load()
        self.ready = threading.Event()
        self.aborted = False
        # on a CPU with the kernels, attention reads the selected rows in the cache itself
        self.attend_in_place = (self.selecting and self.k.addressable and not spec.tiers.is_cuda
                                and spec.dtype == torch.float32 and spec.head_dim % 8 == 0
                                and cpu_kernels.library() is not None)
        # the chosen rows are read by the compute device from (pinned) host memory, issued as
        # soon as speculation has ranked them: no index crosses to the host (mapped_rows)
        self.maps_rows = (self.selecting and self.k.mapped and not self.cpu_compute
                          and not self.packed_here)
        self.own_query = self.selecting and opts.speculation_query == "own"
        if self.own_query and not self.attend_in_place:
            raise ConfigError("--speculation-query own chooses rows when the layer attends, "
                              "so only where attention reads them in place: a float32 KV "
                              "cache in CPU memory, computed on the CPU (with the kernels); "
                              "use renorm")
        self.pool = None
        if self.selecting and opts.kv_pool_capacity < 1:
            self.pool = KVPool(opts.kv_pool_capacity, opts.eviction,
                               spec.batch_size * spec.kv_heads, spec.max_len, spec.tiers.device)

    def defer_keys(self, k_new: torch.Tensor, start: int) -> None:
        """A decode step's key ``[b, 1, KV, d]`` at ``start`` in a step that read the layer
        whole: its speculation keys are not scored yet, so it waits with the others and
        they are written together (see :meth:`flush_keys`)."""
        if self.keys is None:
            return
        if not self.pending_keys:
            self.pending_start = start
        self.pending_keys.append(k_new)
        if len(self.pending_keys) >= PENDING_KEYS:
            self.flush_keys()

    def flush_keys(self) -> None:
        """Write the waiting decode keys (each row projected and packed as alone)."""
        if self.pending_keys:
            self._write_keys(torch.cat(self.pending_keys, 1), self.pending_start)
            self.pending_keys = []

    def _write_keys(self, k: torch.Tensor, start: int, valid=None) -> None:
        """Project keys ``[b, s, KV, d]`` on the kept columns into the speculation keys
        (page summaries also take ``valid`` ``[b, s]``: padding widens no page)."""
        if self.keys is None:
            return
        b, s, kv, d = k.shape
        if (s == 1 and isinstance(self.keys, SpeculationKeys)
                and (self.projection.stride(0) == 0 or b == 1)
                and (k.is_cuda or cpu_kernels.library() is None)):
            # a decode step's key, in few ops (each a launch on a GPU): [KV, b, r] products
            if b == 1:  # already KV head after KV head
                self.keys.write_columns(torch.bmm(k.reshape(kv, 1, d), self.projection[0]),
                                        start)
                return
            cols = torch.bmm(k.reshape(b, kv, d).transpose(0, 1), self.projection[0])
            self.keys.write_columns(cols.transpose(0, 1).reshape(b * kv, 1, -1), start)
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
            self.query_projection = self.policy.rehearsal.query_projection(self.projection)
        self._write_keys(k, 0, valid)
        super().store_prompt(q, k, v, valid)

    @property
    def takes_rows(self) -> bool:
        """Besides the float rows: speculation keys kept per token (page summaries mix a
        page's tokens, a pool's eviction history is the row's own)."""
        return super().takes_rows and self.pool is None and \
            not isinstance(self.keys, PageSummaries)

    def take_row(self, row: int, start: int, other: KVCache, length: int) -> None:
        super().take_row(row, start, other, length)
        if not self.selecting:
            return
        self.flush_keys()  # waiting keys of the row's old sequence land before, not over
        kv = self.spec.kv_heads
        if self.projection.stride(0):  # one per prompt: the row takes its prompt's
            self.projection[row].copy_(other.projection[0])
            self.query_projection[row].copy_(other.query_projection[0])
        self.keys.take_columns(other.keys, slice(row * kv, (row + 1) * kv), start, length)

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
            self.selection = READ_WHOLE
            self.ready.set()
            return
        if self.own_query:  # chosen in attend(), from the layer's own query
            self.selection = OWN_QUERY
            self.ready.set()
            return
        self.flush_keys()  # the keys this step scores
        stats = self.policy.stats
        if x.is_cuda:  # kernels run later than they are launched: time them with events
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        order, counts = self._rank(x, pos_enc, valid, visible)
        self.hand_over(order, counts)
        if x.is_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            stats.speculation_events.append((start, end))
        else:
            stats.speculation_s += time.perf_counter() - start

    def _rank(self, x, pos_enc, valid, visible):
        # scaled by 1/sqrt(d) first (in its projection): the product stays in fp16's range
        pq = self.policy.rehearsal.projected_query(self.spec.layer, x, pos_enc,
                                                   self.spec.kv_heads, self.query_projection)
        return self._choose(pq, valid, visible)

    def _choose(self, pq, valid, visible):
        """(order, counts) for the projected query ``pq`` [b, KV, G, r]."""
        spec, opts = self.spec, self.policy.options
        b, kv = spec.batch_size, spec.kv_heads
        length = valid.shape[1] - 1  # cached tokens (the new one is always attended)
        if self.pool is None and opts.selection == "mass" and not (opts.keep_sink
                                                                  or opts.keep_recent):
            caps = self.policy.step_caps(visible, length, kv)
            width = min(opts.budget.most(length), length)
            if isinstance(self.keys, PageSummaries):  # whole pages, their own counts
                return self.keys.select_mass(pq, visible[:, :length], caps.rows, width)
            order = None
            if self.keys.fused_selection:  # (fetching the caps' views costs ops: not first)
                order = self.keys.select_mass(pq, caps.seen, caps.per_column, width)
            if order is None:  # the torch path: scores, one softmax, the top ``width``
                order = mass_order(self.keys.scores(pq, length), caps.bias, caps.token_bias,
                                   width)
            return order, caps.counts
        seen = visible[:, :length]
        scores = self.keys.scores(pq, length)  # [b, KV, G, t]
        allowed = None
        if self.pool is not None:  # evicted tokens are never selected again
            allowed = self.pool.alive[:, :length].view(b, kv, length)
        return select(scores, seen, opts.selection, opts.alpha, opts.budget, allowed)

    def hand_over(self, order: torch.Tensor, counts: torch.Tensor) -> None:
        """Give this step's ranking to the load lane. A cache in host memory the device maps
        has its rows read now, on a side stream; otherwise, unless the cache is on the device,
        the ranking's copy to the host starts here, without a wait."""
        if self.maps_rows and self.spec.tiers.maps_host:
            rows, done = self.spec.tiers.on_row_stream(
                lambda: gather_mapped(self, order, counts), order, counts)
            if rows is not None:
                self.selection = Speculation.mapped(order, counts, rows, done)
                self.ready.set()
                return
        if self.k.addressable:
            done = torch.cuda.current_stream().record_event() if order.is_cuda else None
            self.selection = Speculation.ranked(order, counts, done=done)
        else:
            self.selection = Speculation.ranked(
                order, counts, on_host=self.spec.tiers.host_values_async(order, counts))
        self.ready.set()

    def abort(self) -> None:
        self.aborted = True
        self.ready.set()

    # ---- the decode step --------------------------------------------------------------------
    def load(self, length: int) -> Loaded:
        if not self.selecting:  # reads every visible row (the sliding window's, if any)
            self.count_full_read(length)
            return super().load(length)
        if not self.ready.wait(SELECTION_TIMEOUT_S):
            raise RuntimeError(f"no speculation arrived for layer {self.spec.layer}")
        if self.aborted:
            raise RuntimeError("generation stopped by an error elsewhere")
        self.ready.clear()
        got, self.selection = self.selection, None
        if got.handed is Handed.OWN_QUERY:
            return Loaded.choose_when_attending()
        if got.handed is Handed.READ_WHOLE:  # attend() knows a selecting layer so read
            self.count_full_read(length)
            if self.attend_in_place or self.packed_here:
                return Loaded.later()
            return super().load(length)
        order, counts = got.order, got.counts
        if got.handed is Handed.MAPPED:  # read since speculation: the device waits for it
            self.spec.tiers.wait_rows(got.done)
            self.count(counts, counts, length)  # summed when the report reads it
            return Loaded.chosen(*got.rows, counts, order)
        if self.packed_here:  # 4-bit codes attended where they are (order is on the CPU)
            used = int(counts.sum())
            self.count(used, used, length)
            return Loaded.chosen_packed(counts, order)
        if self.k.addressable:  # gathered where it lives, no sync
            if got.done is not None:  # the load stream must see the finished speculation
                torch.cuda.current_stream().wait_event(got.done)
            if self.attend_in_place:  # a CPU kernel reads the chosen rows where they are
                used = int(counts.sum())  # on the CPU: no sync to avoid
                self.count(used, used, length)
                return Loaded.chosen_in_place(counts, order)
            k_sel, v_sel = gather_on_device(self, order)
            used = counts.sum()
            self.count(used, used, length)
            return Loaded.chosen(k_sel, v_sel, counts, order)
        # the one host sync: the gather on the host needs the indices
        order_host, counts_host = got.on_host()
        k_sel, v_sel, moved = fetch_selected(self, order_host, counts_host)
        self.count(moved, moved, length)
        return Loaded.chosen(k_sel, v_sel, counts, order[:, :, :k_sel.shape[0] - 1])

    def attend(self, loaded: Loaded, q, k_new, v_new, valid, bias, sinks=None) -> torch.Tensor:
        if not self.selecting:
            return super().attend(loaded, q, k_new, v_new, valid, bias, sinks)
        if loaded.read in (Read.LATER, Read.ROWS):  # this step reads the layer whole
            self.defer_keys(k_new, valid.shape[1] - 1)
            return self._attend_whole(loaded, q, k_new, v_new, valid, bias, sinks)
        if loaded.read is Read.CHOOSE_WHEN_ATTENDING:  # its own (rotated) query, its keys
            self.flush_keys()
            start = time.perf_counter()
            pq = self.policy.rehearsal.project(q, self.spec.kv_heads, self.query_projection)
            index, counts = self._choose(pq, valid, valid)
            self.policy.stats.speculation_s += time.perf_counter() - start
            used = int(counts.sum())
            self.count(used, used, valid.shape[1] - 1)
            loaded = Loaded.chosen_in_place(counts, index)
        self._write_keys(k_new, valid.shape[1] - 1)
        k_sel, v_sel, counts, index = loaded.k, loaded.v, loaded.counts, loaded.order
        if self.pool is not None:  # what this step used; then evict past the budget
            self.policy.stats.evicted += self.pool.record_step(
                index, counts, valid, self.spec.batch_size, self.spec.kv_heads)
        if loaded.read is Read.CHOSEN_PACKED:
            out = attend_packed_rows(self, q, k_new, v_new, index, counts,
                                     valid.shape[1] - 1, sinks)
            if out is not None:
                return out
            k_sel, v_sel, _ = fetch_selected(self, index, counts)  # no kernel: expand them
        elif loaded.read is Read.CHOSEN_IN_PLACE:
            return attend_chosen_in_place(self, q, k_new, v_new, index, counts, sinks)
        return attend_selected(q, k_sel, v_sel, k_new, v_new, counts,
                               bias=self.policy.rows_bias(counts, k_sel.shape[0] - 1),
                               sinks=sinks)

    def store_token(self, k_new, v_new, position: int) -> None:
        if self.stored_at == position:  # written in place before attention read it
            self.stored_at = None
            return
        super().store_token(k_new, v_new, position)

    def _attend_whole(self, loaded: Loaded, q, k_new, v_new, valid, bias,
                      sinks=None) -> torch.Tensor:
        """Attention over every visible row, as the full cache attends: read where the cache
        lives (the new row written first, and not again by ``store_token``), or over the
        rows ``load`` brought."""
        if loaded.read is Read.ROWS:
            return super().attend(loaded, q, k_new, v_new, valid, bias, sinks)
        length = valid.shape[1] - 1
        first = self.spec.first_visible(length)
        if self.packed_here:  # 4-bit codes read where they are; store_token stores the row
            out = self._attend_packed(q, k_new, v_new, bias[..., first:], first, length, sinks)
            if out is not None:
                return out
            return super().attend(Loaded.rows(self._read_rows(length)), q, k_new, v_new,
                                  valid, bias, sinks)
        self._store(k_new, v_new, length)
        self.stored_at = length
        rows = slice(first, length + 1)
        return attend_rows(q, self.k.view(rows), self.v.view(rows), bias[..., first:],
                           sinks=sinks)

    # ---- the fused decode layer -------------------------------------------------------------
    def fused_attention(self, call: "LayerCall", next_cache: KVCache | None):
        """This layer's InfiniGen step inside the call (:mod:`.fused_select`): the rows its
        speculation chose (or every row, a step read whole) and the next layer's speculation,
        where the cache is float32 in CPU memory and the next layer's (if any) InfiniGen's."""
        if not call.ok or not (next_cache is None or isinstance(next_cache, InfiniGenCache)):
            return None
        if not fused_select.takes(self, call.cfg.qk_norm):
            return None
        self.read_in_place(call)
        return fused_select.SelectPlan(call, self, next_cache)



@dataclass(frozen=True)
class StepCaps:
    """A step's caps for the mass rule, shared by its layers (see ``step_caps``)."""

    source: weakref.ref  # the visible mask they came from
    version: int  # its version counter then
    length: int
    kv: int
    seen: torch.Tensor  # [b, length] uint8: the tokens that may be chosen
    rows: torch.Tensor  # [b] int64: each row's cap
    counts: torch.Tensor  # [b, KV] int64: each KV head's cap, as the selection's counts
    bias: torch.Tensor  # [b, 1, 1, length] float32: 0 where a token may be chosen, else -inf
    token_bias: torch.Tensor  # the same, [b, 1, length]

    @property
    def per_column(self) -> torch.Tensor:
        """``[b * KV]``: each KV head's cap, one a column."""
        return self.counts.view(-1)
