"""InfiniGen's decode step inside the fused layer call (``kernels/c/decode_select.c``): a layer
whose KV cache is InfiniGen's, in CPU memory as floats, runs as one foreign call, as the full
cache's does (:mod:`...kernels.layer_call`), instead of an input call, the policy's attention
and speculation in torch, and an output call. :meth:`.cache.InfiniGenCache.fused_attention`
makes the :class:`SelectPlan` once per stage and batch.

What the call does for a layer, by what this step's ``load`` gave (``kv/infinigen/cache.py``):

- **the rows the previous layer's speculation chose** (``CHOSEN_IN_PLACE``): the new key into
  the layer's speculation keys, attention over those rows and the new token, the new row
  written;
- **the layer read whole** (``LATER``: a step under ``--select-from-mb``, or a layer before
  ``first_layer``): attention over every visible row, as the full cache's call; the new key
  waits with the others to be packed into the speculation keys (``defer_keys``);
- **the next layer's speculation**, when it selects this step: its query from this layer's
  attention input, projected, scored against its packed keys, and the mass rule's choice
  handed to its ``load`` as ``speculate`` hands it;
- **the layer's own choice** (``--speculation-query own``: its load gave
  ``CHOOSE_WHEN_ATTENDING``): its own rotated query, projected and scored against its own
  packed keys by the same rule, then attention over the rows chosen, as for the first case
  (no rehearsal for any layer).

A step this cannot take (another selection rule, a KV pool, page summaries or partial keys,
a 4-bit cache ...) returns None and the engine runs the two calls around the policy; where
only the next layer's speculation cannot be taken, the call returns the attention input and
the engine speculates from it. Equal to the per-operation path: the same kernels in the same
order, except each speculation query's sum (for the packed keys' minima), added in C rather
than by torch, which may differ in its last bit.

The C call reaches ``decode_select.c`` only through the block's ``select_step`` slot, which
a plan sets with its ``sel`` block.
"""
from __future__ import annotations

import ctypes

import torch

from ..base import Loaded, Read
from .spec_keys import SpeculationKeys
from ...kernels import cpu_kernels
from ...kernels.layer_args import ATTEND, IN, OUT, I64, PTR, LinearSpec, point_linear

CHOSEN, SPECULATE, OWN_QUERY = 16, 32, 64


class SelectArgs(ctypes.Structure):  # kernels/c/decode_layer.h's dl_select, field for field
    _fields_ = ([("index", PTR), ("counts", PTR), ("n", I64), ("proj", PTR), ("proj_sb", I64),
                 ("codes", PTR), ("lo", PTR), ("scale", PTR)]
                + [(n, I64) for n in ("L", "P", "r", "bits")]
                + [("nq", LinearSpec), ("nproj", PTR), ("nproj_sb", I64), ("nr", I64),
                   ("ncodes", PTR), ("nlo", PTR), ("nscale", PTR)]
                + [(n, I64) for n in ("nL", "nP", "nbits")]
                + [("visible", PTR), ("cap", PTR), ("order", PTR), ("T", I64), ("width", I64)]
                + [(n, PTR) for n in ("s_rows", "s_lin", "s_rot", "s_pq", "s_packed",
                                     "s_qsum")]
                + [(n, PTR) for n in ("nscale_x", "nshift_x", "s_x")])


def takes(cache, qk_norm: bool) -> bool:
    """Whether a layer with this InfiniGen cache may run InfiniGen inside its call (decided
    once per stage and batch, the next layer's cache being InfiniGen's or none; each step then
    checks what its load gave). The call's rehearsal computes the next layer's query without
    q/k norms: a model with them selects in the call only with ``--speculation-query own``
    (the layer's own query, normed as it attends)."""
    return (cache.k.addressable
            and (not qk_norm or cache.policy.options.speculation_query == "own")
            and cache.k.dtype == torch.float32 and not cache.cpu_compute
            and not cache.spec.tiers.is_cuda
            and (cache.in_place if not cache.selecting else cache.attend_in_place))


def _packed_keys(keys) -> bool:
    """Speculation keys the kernels write and score as packed codes, float32 minima."""
    return (isinstance(keys, SpeculationKeys) and keys.bits is not None and keys.use_kernel
            and keys.codes.is_contiguous() and keys.lo.dtype == torch.float32
            and keys.lo.is_contiguous() and keys.scale.is_contiguous())


def _projection(p, b: int, kv: int, d: int) -> bool:
    """A per-KV-head projection ``[b, KV, d, r]`` the projection kernel takes."""
    if p is None or p.dtype != torch.float32 or p.is_cuda or p.dim() != 4:
        return False
    r = p.shape[-1]
    return (p.shape == (b, kv, d, r) and r % 8 == 0 and r <= 128
            and p.stride()[1:] == (d * r, r, 1))


class SelectPlan:
    """An InfiniGen cache's part of a fused decode layer (a :class:`~..base.FusedAttention`):
    the ``dl_select`` block and its scratch buffers, beside the layer's ``call`` (a
    :class:`~...kernels.layer_call.LayerCall` already reading the cache's rows in place)."""

    def __init__(self, call, cache, next_cache):
        self.call, self.cache, self.next = call, cache, next_cache
        cfg, b, q4 = call.cfg, call.batch, call.q4
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        c, g = b * kv, h // kv
        s = self.args = SelectArgs()
        # this layer's chosen rows in the call: packed speculation keys to write the new key
        # into (or none), no pool
        self.chosen = cache.selecting and cache.pool is None and not cache.packed_here and (
            cache.keys is None or (_packed_keys(cache.keys)
                                   and _projection(cache.projection, b, kv, d)))
        buffers = {}
        if self.chosen and cache.keys is not None:
            keys = cache.keys
            s.proj, s.proj_sb = cache.projection.data_ptr(), cache.projection.stride(0)
            s.codes, s.lo, s.scale = (t.data_ptr() for t in (keys.codes, keys.lo, keys.scale))
            s.L, s.P = keys.codes.shape[1:]
            s.r, s.bits = cache.projection.shape[-1], keys.bits
            self.keep = (cache.projection,)
            buffers["s_rows"] = c * s.r
        # --speculation-query own: this layer chooses its rows in the call, from its own
        # query (the scoring fields then hold its own keys: no rehearsal for the next layer)
        self.own = self.chosen and cache.own_query and self._scoring(cache, s, b, kv, d)
        self.speculates = not self.own and self._speculation(next_cache, s, b, h, kv, d, q4)
        if self.speculates:
            buffers.update(s_x=b * cfg.hidden_size, s_lin=b * h * d, s_rot=b * h * d)
        if self.speculates or self.own:
            buffers.update(s_pq=c * g * s.nr, s_packed=c * g * s.nP * (8 // s.nbits),
                           s_qsum=c * g)
        self.buffers = {n: torch.empty(size, dtype=torch.float32) for n, size in buffers.items()}
        for n, t in self.buffers.items():
            setattr(s, n, t.data_ptr())
        call.args.sel = ctypes.addressof(s)
        # the C layer reaches decode_select.c through this slot only
        call.args.select_step = cpu_kernels.function_address("dl_select_step")

    def _speculation(self, nc, s: SelectArgs, b: int, h: int, kv: int, d: int, q4: bool) -> bool:
        """Whether the next layer's speculation runs in the call: the rehearsal's whole W_Q
        in a form the linear kernels read, and its keys scored in C; fills its part of the
        block."""
        if nc is None or not nc.selecting or nc.own_query:
            return False
        rehearsal = nc.policy.rehearsal
        if rehearsal is None or rehearsal.folded:
            return False
        renorm = rehearsal.renorm[nc.spec.layer]
        if renorm is not None:  # the call renorms x for the rehearsal (float32 vectors)
            if any(t is not None and (t.dtype != torch.float32 or t.is_cuda
                                      or not t.is_contiguous()) for t in renorm):
                return False
            s.nscale_x = renorm[0].data_ptr()
            s.nshift_x = renorm[1].data_ptr() if renorm[1] is not None else None
        w = rehearsal.weights[nc.spec.layer]
        if not point_linear(s.nq, w.get("q_proj.weight"), w.get("q_proj.bias"), q4):
            return False
        self.spec_keep = (w,)
        return self._scoring(nc, s, b, kv, d)

    def _scoring(self, nc, s: SelectArgs, b: int, kv: int, d: int) -> bool:
        """Whether the call can choose ``nc``'s rows: the mass rule over its packed keys,
        scored in C (what ``_choose`` takes then) through its per-KV-head projection; fills
        the scoring fields of the block."""
        opts = nc.policy.options
        if (nc.pool is not None or opts.selection != "mass" or opts.keep_sink
                or opts.keep_recent or not _packed_keys(nc.keys) or not nc.keys.fused_selection
                or nc.maps_rows or not nc.k.addressable
                or not _projection(nc.query_projection, b, kv, d)):
            return False
        keys, p = nc.keys, nc.query_projection
        s.nproj, s.nproj_sb, s.nr = p.data_ptr(), p.stride(0), p.shape[-1]
        s.ncodes, s.nlo, s.nscale = (t.data_ptr() for t in (keys.codes, keys.lo, keys.scale))
        s.nL, s.nP = keys.codes.shape[1:]
        s.nbits = keys.bits
        if s.nP * (8 // s.nbits) < s.nr or s.nP * (8 // s.nbits) > 256:
            return False
        self.score_keep = (p,)
        return True

    def layer(self, h: torch.Tensor, state, loaded: Loaded):
        """The layer in one call: ``(output, x)``, ``x`` the attention input when the engine
        must speculate for the next layer from it (else None); None when this step's load
        is not one the call takes (the engine then runs the two calls)."""
        call, cache, a = self.call, self.cache, self.call.args
        length = state.valid.shape[1] - 1
        mode = IN | OUT | call.mlp_mode
        deferred = None
        if not cache.selecting:
            mode |= ATTEND
        elif loaded.read is Read.CHOSEN_IN_PLACE and self.chosen:  # read where they are
            b, kv = call.batch, call.cfg.num_kv_heads
            self._point_rows(loaded.order.view(b * kv, -1), loaded.counts.reshape(b * kv))
            mode |= CHOSEN
        elif loaded.read is Read.CHOOSE_WHEN_ATTENDING and self.own:  # from its own query
            chosen, chosen_counts = self._point_speculation(cache, state, length)
            if chosen is None:
                return None
            self._point_rows(chosen.view(call.batch * call.cfg.num_kv_heads, -1),
                             chosen_counts.reshape(-1))
            used = int(chosen_counts.sum())
            cache.count(used, used, length)
            mode |= OWN_QUERY | CHOSEN
        elif loaded.read is Read.LATER:  # a selecting layer read whole, in place
            deferred = torch.empty(call.batch, 1, call.cfg.num_kv_heads, call.cfg.head_dim)
            a.kn = deferred.data_ptr()  # kept by defer_keys: this step's own tensor
            mode |= ATTEND
        else:
            return None
        call.point_mask(state)  # the position the new row and key are written at
        nc, x, order = self.next, None, None
        if nc is not None and nc.selecting and not nc.own_query:
            if self.speculates and not nc.reads_whole(length):
                order, counts = self._point_speculation(nc, state, length)
                if order is not None:
                    mode |= SPECULATE
            if not mode & SPECULATE:  # the engine speculates from this step's own x
                x = torch.empty_like(h)
                a.x = x.data_ptr()
        out = call.point_step(h, state)
        try:
            call.run(mode)
        finally:
            if deferred is not None:
                a.kn = call.buffers["kn"].data_ptr()
            if x is not None:
                a.x = call.buffers["x"].data_ptr()
        call.count_row()
        if deferred is not None:
            cache.defer_keys(deferred, length)
        if order is not None:  # to its load, as its own speculation hands it over
            nc.hand_over(order, counts)
        elif nc is not None and nc.own_query:  # it chooses when it attends (or reads whole)
            nc.speculate(None, None, state.valid, state.visible)
        return out, x

    def _point_rows(self, index: torch.Tensor, counts: torch.Tensor) -> None:
        """The rows DL_CHOSEN reads: ``index`` [C, n], ``counts`` [C]."""
        if index.dtype != torch.int64 or not index.is_contiguous():
            index = index.to(torch.int64).contiguous()
        if counts.dtype != torch.int64 or not counts.is_contiguous():
            counts = counts.to(torch.int64).contiguous()
        s = self.args
        s.index, s.counts, s.n = index.data_ptr(), counts.data_ptr(), index.shape[1]
        self.rows = (index, counts)  # alive through the call

    def _point_speculation(self, nc, state, length: int):
        """The choice the call makes this step for ``nc`` (the next layer, or with
        ``--speculation-query own`` this one): its ``(order, counts)`` tensors, the order
        filled by the call; (None, None) where the kernel takes no rows."""
        policy, s = nc.policy, self.args
        width = min(policy.options.budget.most(length), length)
        if width < 1:
            return None, None
        nc.flush_keys()  # the keys this step scores (decode keys of steps read whole)
        caps = policy.step_caps(state.visible, length, nc.spec.kv_heads)
        cap = caps.per_column
        if cap.dtype != torch.int64 or not cap.is_contiguous():
            return None, None
        order = torch.empty(nc.spec.batch_size, nc.spec.kv_heads, width, dtype=torch.int64)
        s.visible, s.cap, s.order = caps.seen.data_ptr(), cap.data_ptr(), order.data_ptr()
        s.T, s.width = length, width
        self.caps = caps  # alive through the call
        return order, caps.counts
