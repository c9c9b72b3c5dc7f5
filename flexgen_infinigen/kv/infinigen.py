"""InfiniGen: during layer i, rehearse layer i+1's attention with a few skewed columns of its
query and cached keys, and fetch only the K/V rows of the tokens that score high.

Flow per decode step, for each layer i+1 >= ``first_layer`` and GPU batch:

1. ``before_attention(i, ...)`` (compute stream, during layer i): layer i+1's query from layer
   i's attention input, projected on the kept skewed columns, scored against layer i+1's
   speculation keys (on the compute device); a selection rule (:mod:`.selection`) turns the
   scores into ranked rows and a count per KV head.
2. ``load`` (cache-load lane, overlapped with layer i): waits for that selection, gathers
   exactly the selected rows on the host into a pinned buffer and copies them to the device,
   where they are laid out per KV head for attention.
3. ``attend``: attention over the fetched rows (rows past a head's own count are masked) plus
   the new token.

The KV cache holds the model's own keys: only the speculation is skewed.
"""
from __future__ import annotations

import math
import threading
import time

import torch
import torch.nn.functional as F

from ..config import ConfigError, read_text
from .base import CacheSpec
from .full import FullCache, FullPolicy, attend_selected
from .options import InfiniGenOptions
from .pool import KVPool
from .selection import select
from .selective import fetch_selected, gather_on_device
from .spec_keys import SpeculationKeys
from .stats import FetchStats

SELECTION_TIMEOUT_S = 600
PRIOR_TOKENS = 64  # weight of the calibrated skew against a prompt's own statistics


class InfiniGenCache(FullCache):
    def __init__(self, spec: CacheSpec, policy: "InfiniGenPolicy"):
        super().__init__(spec)
        self.policy = policy
        self.resident = False  # loads wait for the speculation: never run them inline
        self.speculative = spec.layer >= policy.options.first_layer
        opts = policy.options
        self.projection = None  # [b, KV, d, r]: set from the prompt (or the calibration)
        self.keys = None
        if self.speculative:
            r = policy.projections.shape[-1]
            self.keys = SpeculationKeys(opts.speculation_keys, spec.max_len,
                                        spec.batch_size * spec.kv_heads, r, spec.dtype,
                                        spec.tiers)
        self.selection = None
        self.ready = threading.Event()
        self.aborted = False
        # bytes of one token's K and V for one KV head column, as stored (compressed or not)
        self.row_bytes = sum(self.bytes_by_tier().values()) / (
            spec.max_len * spec.batch_size * spec.kv_heads)
        self.pool = None
        if self.speculative and opts.kv_pool_capacity < 1:
            self.pool = KVPool(opts.kv_pool_capacity, opts.eviction,
                               spec.batch_size * spec.kv_heads, spec.max_len, spec.tiers.device)

    def _write_keys(self, k: torch.Tensor, start: int) -> None:
        """Project keys ``[b, s, KV, d]`` on the kept columns into the speculation keys."""
        if self.keys is not None:
            rows = torch.einsum("bskd,bkdr->sbkr", k, self.projection)
            self.keys.write(rows.reshape(rows.shape[0], -1, rows.shape[-1]), start)

    def store_prompt(self, q, k, v, valid) -> None:
        if self.speculative:
            # in the runtime dtype once, not converted again at every decode step
            self.projection = self.policy.prompt_projection(self.spec, q, valid).to(k.dtype)
        self._write_keys(k, 0)
        super().store_prompt(q, k, v, valid)

    def store_token(self, k_new, v_new, position: int) -> None:
        self._store(k_new, v_new, position)

    def select(self, order: torch.Tensor, counts: torch.Tensor) -> None:
        """Hand the ranking over to the load lane (called on the compute stream). Unless the
        cache is on the device, its copy to the host starts here, without a wait."""
        if self.k.resident:
            done = torch.cuda.current_stream().record_event() if order.is_cuda else None
            self.selection = (order, counts, done)
        else:
            self.selection = (order, counts, self.spec.tiers.host_values_async(order, counts))
        self.ready.set()

    def load(self, length: int):
        stats = self.policy.stats
        b, kv = self.spec.batch_size, self.spec.kv_heads
        if not self.speculative:  # reads every visible row (the sliding window's, if any)
            n = (length - self.spec.first_visible(length)) * b * kv
            stats.add(self.spec.layer, n, n, n, self.row_bytes, speculative=False)
            return super().load(length)
        if not self.ready.wait(SELECTION_TIMEOUT_S):
            raise RuntimeError(f"no speculation arrived for layer {self.spec.layer}")
        if self.aborted:
            raise RuntimeError("generation stopped by an error elsewhere")
        self.ready.clear()
        order, counts, pending = self.selection
        self.selection = None
        if self.k.resident:  # gathered where it lives, no sync
            if pending is not None:  # the load stream must see the finished speculation
                torch.cuda.current_stream().wait_event(pending)
            k_sel, v_sel = gather_on_device(self, order)
            used = counts.sum()
            stats.add(self.spec.layer, used, used, length * b * kv, self.row_bytes)
            return k_sel, v_sel, counts, order
        # the one host sync: the gather on the host needs the indices
        order_host, counts_host = pending()
        k_sel, v_sel, moved = fetch_selected(self, order_host, counts_host)
        stats.add(self.spec.layer, moved, moved, length * b * kv, self.row_bytes)
        return k_sel, v_sel, counts, order[:, :, :k_sel.shape[0] - 1]

    def attend(self, loaded, q, k_new, v_new, valid, bias) -> torch.Tensor:
        self._write_keys(k_new, valid.shape[1] - 1)
        if not self.speculative:
            return super().attend(loaded, q, k_new, v_new, valid, bias)
        k_sel, v_sel, counts, index = loaded
        if self.pool is not None:
            self._update_pool(index, counts, valid)
        return attend_selected(q, k_sel, v_sel, k_new, v_new, counts)

    def _update_pool(self, index, counts, valid) -> None:
        """Record what this step used, then evict past the budget (the new token included)."""
        b, kv = self.spec.batch_size, self.spec.kv_heads
        self.pool.record_fetch(index.reshape(b * kv, -1), counts.reshape(b * kv))
        per_col = valid[:, None, :].expand(b, kv, valid.shape[1]).reshape(b * kv, -1)
        before = self.pool.evicted
        self.pool.evict(per_col)
        self.policy.stats.evicted += self.pool.evicted - before


class InfiniGenPolicy(FullPolicy):
    name = "infinigen"
    default_rule = "mass"

    def __init__(self, options: InfiniGenOptions | None = None, **kw):
        self.options = (options or InfiniGenOptions(**kw)).validate()
        self.stats = FetchStats()
        self.caches: dict[tuple[int, int], InfiniGenCache] = {}
        self.skew = None

    def reset_stats(self) -> None:
        self.stats = FetchStats()

    # ---- set-up -----------------------------------------------------------------------------
    def prepare(self, lm) -> None:
        from ..infinigen.skew import Skew, calibrate

        cfg, engine = lm.cfg, lm.engine
        if engine.policy.cpu_cache_compute:
            raise ConfigError("--kv-policy infinigen moves selected KV rows to the compute device;"
                              " it cannot be combined with --cpu-cache-compute (drop one)")
        self.options = opts = self.options.with_defaults(cfg.family, self.default_rule)
        store = getattr(lm, "store_path", None)
        skew = None if opts.calibration or store is None else Skew.load(store)
        if skew is None:
            text = read_text(opts.calibration, "--calibration") if opts.calibration else None
            skew = calibrate(lm, text)
        self.skew, self.family, self.cfg = skew, engine.family, cfg
        dev = engine.tiers.device
        # [L, KV, d, r] in the runtime dtype: one copy, shared (as views) by every cache
        self.projections = skew.projections(opts.ratio, opts.column_score).to(dev, engine.dtype)
        self.gram_q = skew.gram_q.to(dev) if opts.prompt_skew else None
        self.gram_k = skew.gram_k.to(dev) if opts.prompt_skew else None
        # a query that is an affine map of the input (no rotary) takes a static projection in
        # its weights: only r rows per head stay on the device
        self.folded = engine.family.SKEW_FOLDS_INTO_WEIGHTS and not opts.prompt_skew
        self.spec_weights = [self._speculation_weights(engine, layer)
                             for layer in range(cfg.num_layers)]
        engine.tiers.reset_counters()

    def _speculation_weights(self, engine, layer: int) -> dict:
        """The device-resident weights the rehearsal of ``layer`` needs."""
        if layer < self.options.first_layer:
            return {}
        cfg = self.cfg
        w = {n: engine.weights[f"layers.{layer}.{n}"].read().clone()
             for n in engine.family.QUERY_WEIGHTS if f"layers.{layer}.{n}" in engine.weights}
        if not self.folded:
            return w  # the whole W_Q: rotary models need the full rotated query
        p = self.projections[layer].to(w["q_proj.weight"].dtype)  # [H, d, r] (OPT: KV == H)
        heads = w["q_proj.weight"].view(cfg.num_heads, cfg.head_dim, -1)
        out = {"q_proj.weight": torch.einsum("kdr,kdi->kri", p, heads).reshape(-1, heads.shape[-1])}
        if "q_proj.bias" in w:
            out["q_proj.bias"] = torch.einsum("kdr,kd->kr", p, w["q_proj.bias"].view(
                cfg.num_heads, cfg.head_dim)).reshape(-1)
        return out

    def prompt_projection(self, spec: CacheSpec, q: torch.Tensor,
                          valid: torch.Tensor) -> torch.Tensor:
        """``[b, KV, d, r]``: the calibrated projection, or one per prompt, from the prompt's
        own query statistics blended with the calibration's (weight ``PRIOR_TOKENS``)."""
        from ..infinigen.skew import projection, query_gram

        static = self.projections[spec.layer]
        b = q.shape[0]
        if self.gram_q is None:
            return static.expand(b, *static.shape)
        qv = q.float() * valid[:, :, None, None]  # padding contributes nothing
        n = valid.sum(-1).double() * (self.cfg.num_heads // spec.kv_heads)
        gram = query_gram(qv, spec.kv_heads) * (qv.shape[1] * self.cfg.num_heads
                                                // spec.kv_heads)  # sums, not means
        prior = self.gram_q[spec.layer].double()
        blended = (gram + PRIOR_TOKENS * prior) / (n + PRIOR_TOKENS)[:, None, None, None]
        return projection(blended, self.gram_k[spec.layer], self.options.ratio,
                          self.options.column_score)

    def device_bytes(self, cfg, policy, item: int, max_len: int) -> dict[str, int]:
        """Speculation keys (selecting layers only), the speculation weights (``r`` rows of
        W_Q per head where the projection folds into them, else the whole W_Q per layer),
        the projections, the KV pool's state and the selected rows in flight."""
        from ..models import family_of
        from .spec_keys import KINDS, bytes_per_key
        o = self.options.with_defaults(cfg.family, self.default_rule)
        d = cfg.head_dim
        r = max(1, round(o.ratio * d))
        layers = max(0, cfg.num_layers - o.first_layer)
        caches = layers * policy.num_gpu_batches
        cols = policy.gpu_batch_size * cfg.num_kv_heads
        rows = cfg.num_heads * (r if family_of(cfg).SKEW_FOLDS_INTO_WEIGHTS and not o.prompt_skew
                                else d)
        bias = rows if "layers.0.q_proj.bias" in family_of(cfg).weight_shapes(cfg) else 0
        terms = {
            "speculation_keys": round(caches * max_len * cols * bytes_per_key(
                o.speculation_keys, r, item)),
            "speculation_weights": layers * (rows * cfg.hidden_size + bias) * item,
            "projections": cfg.num_layers * cfg.num_kv_heads * d * r * item
            + (caches * cols * d * r * item if o.prompt_skew else 0),
            "selected_rows": 2 * 2 * (o.budget.most(max_len) + 1) * cols * d * item,
        }
        bits = KINDS[o.speculation_keys]
        if bits is not None:  # the codes of one cache unpacked for scoring (one at a time)
            per_byte = 8 // bits
            terms["speculation_unpacked"] = max_len * cols * (-(-r // per_byte) * per_byte) * item
        if o.prompt_skew:
            terms["gram_matrices"] = 2 * cfg.num_layers * cfg.num_kv_heads * d * d * 4
        if o.kv_pool_capacity < 1:
            terms["kv_pool"] = caches * cols * max_len * (1 + 8 + 8)  # bool, 2 x int64
        return terms

    def abort(self) -> None:
        for cache in self.caches.values():
            cache.aborted = True
            cache.ready.set()

    def make_cache(self, spec: CacheSpec) -> InfiniGenCache:
        cache = InfiniGenCache(spec, self)
        self.caches[(spec.layer, spec.batch)] = cache
        return cache

    # ---- speculation ------------------------------------------------------------------------
    def before_attention(self, layer: int, batch: int, x: torch.Tensor, state) -> None:
        target = self.caches.get((layer + 1, batch))
        if target is None or not target.speculative:
            return
        if x.is_cuda:  # kernels run later than they are launched: time them with events
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        order, counts = self._speculate(target, x, state)
        target.select(order, counts)
        if x.is_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.stats.speculation_events.append((start, end))
        else:
            self.stats.speculation_s += time.perf_counter() - start

    def _speculate(self, cache: InfiniGenCache, x: torch.Tensor, state):
        cfg, opts, spec = self.cfg, self.options, cache.spec
        b, kv, h = spec.batch_size, spec.kv_heads, cfg.num_heads
        group = h // kv
        w = self.spec_weights[spec.layer]
        if self.folded:
            pq = F.linear(x, w["q_proj.weight"], w.get("q_proj.bias")).view(b, kv, group, -1)
        else:
            q = self.family.query(cfg, w, x, state.pos_enc)  # [b, 1, H, d]
            pq = torch.einsum("bkgd,bkdr->bkgr", q.view(b, kv, group, cfg.head_dim),
                              cache.projection)
        length = state.valid.shape[1] - 1  # cached tokens (the new one is always attended)
        # scaled first: the product stays in fp16's range (see attention.py)
        scores = cache.keys.scores(pq * (1.0 / math.sqrt(cfg.head_dim)), length)  # [b,KV,G,t]
        allowed = None
        if cache.pool is not None:  # evicted tokens are never selected again
            allowed = cache.pool.alive[:, :length].view(b, kv, length)
        return select(scores, state.visible[:, :length], opts.selection, opts.alpha, opts.budget,
                      allowed)

    # ---- report -----------------------------------------------------------------------------
    def report(self) -> dict:
        s, o = self.stats, self.options
        return {
            "kv_policy": self.name,
            "selection": o.selection, "alpha": o.alpha,
            "partial_weight_ratio": o.ratio, "speculation_keys": o.speculation_keys,
            "max_kv_fraction": o.max_kv_fraction,
            "keep_sink": o.keep_sink, "keep_recent": o.keep_recent,
            **s.report(),
            "speculation_time_s": s.speculation_s,
            "skew_calibration": {"source": self.skew.meta.get("source"),
                                 "tokens": self.skew.meta.get("tokens"),
                                 "per_prompt": o.prompt_skew}
            if self.skew is not None else None,
            "kv_pool_capacity": o.kv_pool_capacity,
            "eviction": o.eviction,
            "kv_pool_evicted_tokens": s.evicted,
        }
