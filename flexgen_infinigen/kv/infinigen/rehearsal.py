"""What InfiniGen's rehearsal needs from the model, taken once at load: the skew (stored
with the weights, or calibrated now), the per-layer projections on the kept skewed columns,
and the query weights it multiplies with (folded with the projection where the query is an
affine map of the input, as in OPT; the whole W_Q for rotary models).

:meth:`Rehearsal.projected_query` is layer i+1's query from layer i's attention input,
projected on those columns: what speculation scores against the speculation keys.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ...config import ConfigError, read_text
from ...memory.split_tensor import SplitTensor
from ..base import PolicyContext
from .options import InfiniGenOptions, own_query_runs
from ...kernels import cpu_kernels
from ...memory.codes import PackedWeight
from ...kernels.layers import linear
from .skew import (
    Skew,
    calibrate,
    calibration_key,
    keep_calibration,
    kept_calibration,
    project_per_head,
    projection,
    query_gram,
)

PRIOR_TOKENS = 64  # weight of the calibrated skew against a prompt's own statistics


class Rehearsal:
    def __init__(self, ctx: PolicyContext, options: InfiniGenOptions):
        cfg = ctx.cfg
        self.cfg, self.family, self.options = cfg, ctx.family, options
        self.skew = skew = self._skew(ctx, options)
        dev = ctx.tiers.device
        # [L, KV, d, r] in the runtime dtype: one copy, shared (as views) by every cache
        self.projections = skew.projections(options.ratio, options.column_score).to(
            dev, ctx.dtype)
        self.gram_q = skew.gram_q.to(dev) if options.prompt_skew else None
        self.gram_k = skew.gram_k.to(dev) if options.prompt_skew else None
        # a query that is an affine map of the input (no rotary) takes a static projection in
        # its weights: only r rows per head stay on the device
        self.folded = ctx.family.SKEW_FOLDS_INTO_WEIGHTS and not options.prompt_skew
        # own: each layer's own query, no rehearsal product (and no folded copies)
        self.weights = [self._query_weights(ctx, layer) if options.speculation_query != "own"
                        else {} for layer in range(cfg.num_layers)]
        self.renorm = [self._renorm(ctx, layer) if options.speculation_query == "renorm"
                       else None for layer in range(cfg.num_layers)]

    @staticmethod
    def _skew(ctx: PolicyContext, options: InfiniGenOptions) -> Skew:
        """The skew stored with the weights (``python -m flexgen_infinigen.calibrate``), else the
        calibration an earlier run with the same text, weights, placement, dtype and threads
        kept in the store, else a calibration now (kept for the next such run)."""
        store = ctx.store_path
        text = read_text(options.calibration, "--calibration") if options.calibration else None
        skew = None if options.calibration or store is None else Skew.load(store)
        key = None
        if skew is None and store is not None:
            key = calibration_key(ctx, text)
            skew = kept_calibration(store, key)
            if skew is not None:
                skew.meta["kept"] = True
        # pipeline ranks calibrate together or not at all
        if ctx.any_rank(skew is None, "agreeing on InfiniGen's calibration"):
            skew = None
        if skew is None:
            skew = calibrate(ctx, text)
            # a pipeline rank records only its own layers: nothing to keep for a whole run
            if key is not None and len(ctx.layers) == ctx.cfg.num_layers:
                keep_calibration(skew, store, key)
        return skew

    @property
    def columns(self) -> int:
        return self.projections.shape[-1]

    def _query_weights(self, ctx: PolicyContext, layer: int) -> dict:
        """The device-resident weights the rehearsal of ``layer`` needs (read through the
        ledger, which the loader resets afterwards)."""
        if layer < self.options.first_layer or layer not in ctx.layers:
            return {}  # no speculation, or the layer is on another pipeline rank
        cfg, weights = self.cfg, ctx.weights
        names = [n for n in ctx.family.QUERY_WEIGHTS if f"layers.{layer}.{n}" in weights]
        if not self.folded:  # the whole W_Q: rotary models need the full rotated query
            return {n: self._whole(weights[f"layers.{layer}.{n}"]) for n in names}
        w = {n: weights[f"layers.{layer}.{n}"].read().clone() for n in names}
        # [H, d, r] (OPT: KV == H), with attention's 1/sqrt(d): the query comes out scaled
        p = self.projections[layer].to(w["q_proj.weight"].dtype) * cfg.head_dim ** -0.5
        heads = w["q_proj.weight"].view(cfg.num_heads, cfg.head_dim, -1)
        out = {"q_proj.weight": torch.einsum("kdr,kdi->kri", p, heads).reshape(-1, heads.shape[-1])}
        if "q_proj.bias" in w:
            out["q_proj.bias"] = torch.einsum("kdr,kd->kr", p, w["q_proj.bias"].view(
                cfg.num_heads, cfg.head_dim)).reshape(-1)
        return out

    def _renorm(self, ctx: PolicyContext, layer: int):
        """``--speculation-query renorm``: (scale, shift) that turn layer ``layer - 1``'s
        attention input into layer ``layer``'s norm of the same residual. Both layers
        normalize the residual h the same way (its mean and spread, or RMS) before their own
        elementwise weight w and bias b, so x' = (x - b) / w * w' + b' = x * (w' / w) +
        (b' - b * w' / w): no extra reads of h. None where the layer does not speculate."""
        if layer < max(self.options.first_layer, 1) or layer not in ctx.layers:
            return None
        refused = renorm_refused(ctx.weights, self.cfg, layer)
        if refused:
            raise ConfigError(f"--speculation-query renorm: {refused}; use input")
        weights, dev = ctx.weights, ctx.tiers.device
        names = [f"layers.{i}.attn_norm.weight" for i in (layer - 1, layer)]
        before, after = (weights[n].read().float() for n in names)
        scale = after / before
        shift = None
        bias = [f"layers.{i}.attn_norm.bias" for i in (layer - 1, layer)]
        if all(n in weights for n in bias):
            b0, b1 = (weights[n].read().float() for n in bias)
            shift = (b1 - b0 * scale).to(dev, ctx.dtype)
        return scale.to(dev, ctx.dtype), shift

    def renormed(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the rehearsal of ``layer`` takes it (see :meth:`_renorm`)."""
        got = self.renorm[layer]
        if got is None:
            return x
        scale, shift = got
        return x * scale if shift is None else torch.addcmul(shift, x, scale)

    @staticmethod
    def _whole(tensor):
        """A query weight as the rehearsal keeps it: 4-bit codes that a CPU multiplies where
        they are stored (what the layer itself reads: no copy, a quarter of the float bytes
        read each step), else a float copy on the compute device."""
        weight = tensor.read_for_compute()  # else the tensor read(), brought to the device
        return weight if isinstance(weight, PackedWeight) else weight.clone()

    def prompt_projection(self, layer: int, kv_heads: int, q: torch.Tensor,
                          valid: torch.Tensor) -> torch.Tensor:
        """``[b, KV, d, r]``: the calibrated projection, or one per prompt, from the prompt's
        own query statistics blended with the calibration's (weight ``PRIOR_TOKENS``)."""
        static = self.projections[layer]
        b = valid.shape[0]
        if self.gram_q is None:
            return static.expand(b, *static.shape)
        qv = q.float() * valid[:, :, None, None]  # padding contributes nothing
        n = valid.sum(-1).double() * (self.cfg.num_heads // kv_heads)
        gram = query_gram(qv, kv_heads) * (qv.shape[1] * self.cfg.num_heads
                                           // kv_heads)  # sums, not means
        prior = self.gram_q[layer].double()
        blended = (gram + PRIOR_TOKENS * prior) / (n + PRIOR_TOKENS)[:, None, None, None]
        return projection(blended, self.gram_k[layer], self.options.ratio,
                          self.options.column_score)

    def query_projection(self, projection: torch.Tensor) -> torch.Tensor:
        """What :meth:`projected_query` takes for ``projection [b, KV, d, r]``: it times
        attention's 1/sqrt(d) (one shared by the batch stays shared: stride 0)."""
        scale = self.cfg.head_dim ** -0.5
        if projection.stride(0) == 0:
            return (projection[:1] * scale).expand_as(projection)
        return projection * scale

    def projected_query(self, layer: int, x: torch.Tensor, pos_enc, kv_heads: int,
                        projection: torch.Tensor) -> torch.Tensor:
        """``[b, KV, G, r]``: layer ``layer``'s query of input ``x`` ``[b, 1, D]`` on the kept
        columns of its KV head's skew, times 1/sqrt(d) (``projection`` ``[b, KV, d, r]``
        from :meth:`query_projection`)."""
        cfg, w = self.cfg, self.weights[layer]
        b, group = x.shape[0], cfg.num_heads // kv_heads
        x = self.renormed(layer, x)
        if self.folded:
            return linear(x, w["q_proj.weight"], w.get("q_proj.bias")).view(b, kv_heads,
                                                                               group, -1)
        return self.project(self.family.query(cfg, w, x, pos_enc), kv_heads, projection)

    def project(self, q: torch.Tensor, kv_heads: int, projection: torch.Tensor) -> torch.Tensor:
        """``[b, KV, G, r]``: a rotated query ``q`` ``[b, 1, H, d]`` (the rehearsal's, or
        with ``--speculation-query own`` the layer's own) projected per KV head."""
        cfg, b = self.cfg, q.shape[0]
        group = cfg.num_heads // kv_heads
        q = q.reshape(b, kv_heads, group, cfg.head_dim)
        if (projection.stride(0) == 0 or b == 1) and (q.is_cuda or cpu_kernels.library() is None):
            # one projection per KV head, in few ops (each a kernel launch on a GPU)
            if b == 1:
                return torch.bmm(q[0], projection[0]).unsqueeze(0)
            rows = q.transpose(0, 1).reshape(kv_heads, b * group, cfg.head_dim)
            out = torch.bmm(rows, projection[0]).view(kv_heads, b, group, -1)
            return out.transpose(0, 1)
        return project_per_head(q.transpose(1, 2), projection).transpose(1, 2)

    def meta(self) -> dict:
        return {"source": self.skew.meta.get("source"), "tokens": self.skew.meta.get("tokens"),
                "kept_from_an_earlier_run": bool(self.skew.meta.get("kept")),
                "per_prompt": self.options.prompt_skew}


def renorm_refused(weights: Mapping[str, SplitTensor], cfg, layer: int) -> str | None:
    """Why layer ``layer``'s rehearsal cannot renormalize layer ``layer - 1``'s input (no
    norm before each layer's attention, or one that zeroes a channel), else None; ``weights``
    as placed, by store name."""
    names = [f"layers.{i}.attn_norm.weight" for i in (layer - 1, layer)]
    if not getattr(cfg, "do_layer_norm_before", True) or not all(
            n in weights for n in names):
        return f"it needs a norm before each layer's attention ({cfg.name} has none to take)"
    if bool((weights[names[0]].read().abs() < 1e-6).any()):
        return f"layer {layer - 1}'s input norm zeroes a channel, which no rescaling recovers"
    return None


def auto_query(ctx: PolicyContext, options: InfiniGenOptions) -> str:
    """``--speculation-query auto``: ``own`` where every layer's KV cache is float32 in one
    place a CPU reads in place with the kernels (where ``InfiniGenCache`` attends in place;
    nothing needs fetching ahead there), else ``renorm`` where every speculating layer can
    take it, else the paper's ``input``. A default must run everywhere: never refuses."""
    cfg = ctx.cfg
    if own_query_runs(cfg, ctx.placement, ctx.dtype.itemsize, not ctx.tiers.is_cuda):
        return "own"
    layers = [i for i in ctx.layers if i >= max(options.first_layer, 1)]
    refused = any(renorm_refused(ctx.weights, cfg, i) is not None for i in layers)
    # pipeline ranks take one query, as one process over every layer would
    return "input" if ctx.any_rank(refused, "agreeing on the speculation query") \
        else "renorm"
