"""InfiniGen: during layer i, rehearse layer i+1's attention with a few skewed columns of its
query and cached keys, and fetch only the K/V rows of the tokens that score high.

Flow per decode step, for each layer i+1 >= ``first_layer`` and GPU batch:

1. ``before_attention(i, ...)`` (compute stream, during layer i): partial query of layer i+1
   from layer i's attention input, approximate logits against layer i+1's partial key cache
   (on the compute device), per-head threshold ``max - alpha``, union over the query heads of
   each KV head, cap and floor; the ranked token order and per-head counts go to the cache.
2. ``load`` (cache-load lane, overlapped with layer i): waits for that selection, gathers the
   selected rows on the host into a pinned buffer and copies them to the device.
3. ``attend``: attention over the fetched rows (rows past a head's own count are masked) plus
   the new token.
"""
from __future__ import annotations

import math
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ConfigError, read_text
from .base import CacheSpec
from .full import FullCache, FullPolicy, attend_selected, to_rows
from .pool import KVPool, check_pool_options

SELECTION_TIMEOUT_S = 600


@dataclass(frozen=True)
class InfiniGenOptions:
    alpha: float | None = None  # None: 4 for OPT, 5 for Llama (the paper's defaults)
    partial_weight_ratio: float = 0.3
    max_kv_fraction: float = 0.2
    max_num_kv: int | None = None
    min_num_kv: int = 4
    first_layer: int = 2  # layers below this read the whole cache (layer 0 has no predecessor)
    group_combine: str = "union"  # how the query heads of a KV head combine: union | mean
    column_score: str = "q"
    calibration: str | None = None  # text file; default: the store's skew, else built-in text
    kv_pool_capacity: float = 1.0  # fraction of each head's context kept on the host
    eviction: str = "fifo"

    def validate(self) -> "InfiniGenOptions":
        if self.alpha is not None and not self.alpha >= 0:
            raise ConfigError(f"--alpha must be >= 0 (got {self.alpha}); use inf to keep all")
        for flag, v in [("--partial-weight-ratio", self.partial_weight_ratio),
                        ("--max-kv-fraction", self.max_kv_fraction)]:
            if not 0 < v <= 1:
                raise ConfigError(f"{flag} must be in (0, 1] (got {v})")
        if self.max_num_kv is not None and self.max_num_kv < 1:
            raise ConfigError(f"--max-num-kv must be at least 1 (got {self.max_num_kv})")
        if self.group_combine not in ("union", "mean"):
            raise ConfigError(f"--group-combine must be union or mean "
                              f"(got {self.group_combine!r})")
        check_pool_options(self.kv_pool_capacity, self.eviction)
        if self.calibration is not None and not os.path.isfile(self.calibration):
            raise ConfigError(f"--calibration {self.calibration} does not exist; give a text "
                              "file, or drop the flag to use the store's skew")
        if self.column_score not in ("q", "qk"):
            raise ConfigError(f"--column-score must be q or qk (got {self.column_score!r})")
        return self


class InfiniGenCache(FullCache):
    def __init__(self, spec: CacheSpec, policy: "InfiniGenPolicy"):
        super().__init__(spec)
        self.policy = policy
        self.resident = False  # loads wait for the speculation: never run them inline
        self.speculative = spec.layer >= policy.options.first_layer
        cols = policy.columns[spec.layer]  # [KV, r]
        self.col_index = cols.repeat(spec.batch_size, 1)  # per cache column [b*KV, r]
        self.partial = torch.zeros(spec.max_len, spec.batch_size * spec.kv_heads, cols.shape[1],
                                   dtype=spec.dtype, device=spec.tiers.device)
        spec.tiers.track(self.partial, "device")
        self.selection = None
        self.ready = threading.Event()
        # bytes of one token's K and V for one KV head column, as stored (compressed or not)
        self.row_bytes = sum(self.bytes_by_tier().values()) / (
            spec.max_len * spec.batch_size * spec.kv_heads)
        opts = policy.options
        self.pool = None
        if self.speculative and opts.kv_pool_capacity < 1:
            self.pool = KVPool(opts.kv_pool_capacity, opts.eviction,
                               spec.batch_size * spec.kv_heads, spec.max_len, spec.tiers.device)

    # keys are kept skewed; for rotary models the skew is applied here, at run time
    def _skew(self, x: torch.Tensor) -> torch.Tensor:
        return self.policy.skew_runtime(self.spec.layer, x)

    def _write_partial(self, k_skewed: torch.Tensor, start: int) -> None:
        rows = to_rows(k_skewed)  # [s, b*KV, d]
        idx = self.col_index.unsqueeze(0).expand(rows.shape[0], -1, -1)
        self.partial[start:start + rows.shape[0]] = rows.gather(2, idx)

    def store_prompt(self, q, k, v, valid) -> None:
        k = self._skew(k)
        self._write_partial(k, 0)
        super().store_prompt(q, k, v, valid)

    def store_token(self, k_new, v_new, position: int) -> None:
        self._store(self._skew(k_new), v_new, position)

    def select(self, order: torch.Tensor, counts: torch.Tensor) -> None:
        """Hand the ranking over to the load lane (called on the compute stream)."""
        done = torch.cuda.current_stream().record_event() if order.is_cuda else None
        self.selection = (order, counts, done)
        self.ready.set()

    def load(self, length: int):
        stats = self.policy.stats
        b, kv = self.spec.batch_size, self.spec.kv_heads
        if not self.speculative:
            stats.add(self.spec.layer, length * b * kv, length * b * kv, length * b * kv,
                      self.row_bytes)
            return super().load(length)
        if not self.ready.wait(SELECTION_TIMEOUT_S):
            raise RuntimeError(f"no speculation arrived for layer {self.spec.layer}")
        self.ready.clear()
        order, counts, done = self.selection
        self.selection = None
        if done is not None:  # the load stream must see the finished speculation
            stream = torch.cuda.current_stream()
            stream.wait_event(done)
            order.record_stream(stream)
            counts.record_stream(stream)
        top = int(counts.max())  # the one host sync: the gather on the host needs the indices
        index = order[:, :, :top]  # [b, KV, top]
        rows = index.permute(2, 0, 1).reshape(top, b * kv).cpu()
        stats.add(self.spec.layer, top * b * kv, int(counts.sum()), length * b * kv,
                  self.row_bytes)
        return self.k.gather(rows), self.v.gather(rows), counts, index

    def attend(self, loaded, q, k_new, v_new, valid, bias) -> torch.Tensor:
        q, k_new = self._skew_query(q), self._skew(k_new)
        self._write_partial(k_new, valid.shape[1] - 1)
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

    def _skew_query(self, q: torch.Tensor) -> torch.Tensor:
        pol = self.policy
        if pol.folded:
            return q
        b, s, h, d = q.shape
        kv = self.spec.kv_heads
        a = pol.matrices[self.spec.layer]  # [KV, d, d]
        return torch.einsum("bskgd,kde->bskge", q.view(b, s, kv, h // kv, d), a).reshape(q.shape)


class FetchStats:
    """Rows moved, rows selected and rows cached, per layer (thread-safe counters)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.moved = defaultdict(int)
        self.selected = defaultdict(int)
        self.cached = defaultdict(int)
        self.speculation_s = 0.0
        self.evicted = 0
        self.bytes_moved = 0.0  # K and V bytes fetched for attention
        self.bytes_full = 0.0  # what fetching every cached row would have moved

    def add(self, layer: int, moved: int, selected: int, cached: int, row_bytes: float) -> None:
        with self.lock:
            self.bytes_moved += moved * row_bytes
            self.bytes_full += cached * row_bytes
            self.moved[layer] += moved
            self.selected[layer] += selected
            self.cached[layer] += cached


class InfiniGenPolicy(FullPolicy):
    name = "infinigen"

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
        opts = self.options
        if opts.alpha is None:
            self.options = opts = InfiniGenOptions(
                **{**opts.__dict__, "alpha": 4.0 if cfg.family == "opt" else 5.0})
        store = getattr(lm, "store_path", None)
        skew = None if opts.calibration or store is None else Skew.load(store)
        if skew is None:
            text = read_text(opts.calibration, "--calibration") if opts.calibration else None
            skew = calibrate(lm, text, column_score=opts.column_score)
        self.skew = skew
        self.family = engine.family
        self.cfg = cfg
        dev, dtype = engine.tiers.device, engine.dtype
        self.matrices = skew.matrices.to(dev, dtype)  # [L, KV, d, d]
        self.columns = skew.columns(opts.partial_weight_ratio).to(dev)  # [L, KV, r]
        self.folded = engine.family.SKEW_FOLDS_INTO_WEIGHTS
        if self.folded:
            self._fold(engine)
        self.spec_weights = [self._speculation_weights(engine, layer)
                             for layer in range(cfg.num_layers)]
        engine.tiers.reset_counters()

    def _fold(self, engine) -> None:
        """W_Q and W_K rows (and biases) of head h become A_h^T times them: q k^T unchanged."""
        cfg = self.cfg
        for layer in range(cfg.num_layers):
            a = self.skew.matrices[layer].double()  # [KV, d, d]; here KV == H
            for proj in ("q_proj", "k_proj"):
                for part in ("weight", "bias"):
                    tensor = engine.weights[f"layers.{layer}.{proj}.{part}"]
                    w = tensor.read().double().cpu()
                    heads = w.view(cfg.num_kv_heads, cfg.head_dim, -1)
                    skewed = torch.einsum("kde,kdi->kei", a, heads).reshape(w.shape)
                    tensor.write(skewed.to(engine.dtype).to(engine.tiers.device))

    def _speculation_weights(self, engine, layer: int) -> dict:
        """The device-resident weights the rehearsal of ``layer`` needs."""
        cfg = self.cfg
        w = {n: engine.weights[f"layers.{layer}.{n}"].read().clone()
             for n in ("q_proj.weight", "q_proj.bias") if f"layers.{layer}.{n}" in engine.weights}
        if not self.folded:
            return w  # full W_Q: RoPE needs the whole rotated query before the skew
        # OPT: only the partial rows of the (skewed) W_Q: head h keeps rows h*d + columns
        cols = self.columns[layer]  # [H, r]
        rows = (torch.arange(cfg.num_heads, device=cols.device)[:, None] * cfg.head_dim
                + cols).reshape(-1)
        return {n: t[rows] for n, t in w.items()}

    def skew_runtime(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Rotary models: skew keys [b, s, KV, d] at run time (folded models: unchanged)."""
        if self.folded:
            return x
        return torch.einsum("bskd,kde->bske", x, self.matrices[layer])

    def make_cache(self, spec: CacheSpec) -> InfiniGenCache:
        cache = InfiniGenCache(spec, self)
        self.caches[(spec.layer, spec.batch)] = cache
        return cache

    # ---- speculation ------------------------------------------------------------------------
    def before_attention(self, layer: int, batch: int, x: torch.Tensor, state) -> None:
        target = self.caches.get((layer + 1, batch))
        if target is None or not target.speculative:
            return
        start = time.perf_counter()
        order, counts = self._speculate(target, x, state)
        target.select(order, counts)
        self.stats.speculation_s += time.perf_counter() - start

    def _speculate(self, cache: InfiniGenCache, x: torch.Tensor, state):
        cfg, opts, spec = self.cfg, self.options, cache.spec
        b, kv, h = spec.batch_size, spec.kv_heads, cfg.num_heads
        group, r = h // kv, self.columns.shape[-1]
        w = self.spec_weights[spec.layer]
        if self.folded:
            pq = F.linear(x, w["q_proj.weight"], w.get("q_proj.bias")).view(b, kv, group, r)
        else:
            q = self.family.query(cfg, w, x, state.pos_enc)  # [b, 1, H, d]
            a_cols = self.matrices[spec.layer].gather(
                2, self.columns[spec.layer][:, None, :].expand(-1, cfg.head_dim, -1))
            pq = torch.einsum("bkgd,kdr->bkgr", q.view(b, kv, group, cfg.head_dim), a_cols)
        length = state.valid.shape[1] - 1  # cached tokens (the new one is always attended)
        pk = cache.partial[:length].view(length, b, kv, r).permute(1, 2, 3, 0)  # [b, KV, r, t]
        scores = torch.matmul(pq, pk).float() / math.sqrt(cfg.head_dim)  # [b, KV, G, t]
        valid = state.valid[:, None, None, :length]
        if cache.pool is not None:  # evicted tokens are never selected again
            valid = valid & cache.pool.alive[:, :length].view(b, kv, 1, length)
        scores = scores.masked_fill(~valid, float("-inf"))
        margin = scores - scores.amax(-1, keepdim=True)  # 0 at each head's best token
        if opts.group_combine == "union":
            rank_score = margin.amax(2)  # a token any head of the group wants
        else:
            mean = scores.mean(2)
            rank_score = mean - mean.amax(-1, keepdim=True)
        chosen = (rank_score > -opts.alpha).sum(-1)  # [b, KV]
        n_valid = state.valid[:, :length].sum(-1, keepdim=True)  # [b, 1]
        cap = torch.floor(n_valid * opts.max_kv_fraction).clamp(min=1)
        if opts.max_num_kv is not None:
            cap = cap.clamp(max=opts.max_num_kv)
        floor = n_valid.clamp(max=opts.min_num_kv)
        counts = torch.maximum(torch.minimum(chosen, cap.long()), floor.long())
        # no row keeps more than this (its cap or floor), so a partial top-k ranks enough
        most = max(min(length, opts.min_num_kv), max(1, int(length * opts.max_kv_fraction)))
        if opts.max_num_kv is not None:
            most = max(min(most, opts.max_num_kv), min(length, opts.min_num_kv))
        order = rank_score.topk(min(most, length), dim=-1, sorted=True).indices  # [b, KV, t]
        return order, counts

    # ---- report -----------------------------------------------------------------------------
    def report(self) -> dict:
        s = self.stats
        layers = sorted(s.cached)
        total_cached = max(sum(s.cached.values()), 1)
        return {
            "kv_policy": self.name,
            "alpha": self.options.alpha,
            "partial_weight_ratio": self.options.partial_weight_ratio,
            "max_kv_fraction": self.options.max_kv_fraction,
            "kv_fetch_fraction": sum(s.moved.values()) / total_cached,
            "kv_selected_fraction": sum(s.selected.values()) / total_cached,
            "kv_fetch_fraction_per_layer": [s.moved[i] / max(s.cached[i], 1) for i in layers],
            "kv_bytes_fetched": int(s.bytes_moved),
            "kv_bytes_full_fetch": int(s.bytes_full),
            "speculation_time_s": s.speculation_s,
            "skew_calibration": {k: self.skew.meta.get(k) for k in ("source", "tokens")}
            if self.skew is not None else None,
            "kv_pool_capacity": self.options.kv_pool_capacity,
            "eviction": self.options.eviction,
            "kv_pool_evicted_tokens": s.evicted,
        }
