"""What one schedule stage computes for one GPU batch (:class:`StageCompute`, the engine's
compute half): the embedding, attention (per operation, or a decode step's compiled call with
or without the cache's part in it), the MLP (a decode step's MoE MLP once for the whole
block), the head, and where the hidden state is kept between stages. Which way a decode
stage goes is its :class:`~.stage_plan.StagePlan`; :mod:`.schedule` walks the schedule and
calls :meth:`StageCompute.run`."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..kernels.attention import attend_prompt, score_rows
from ..memory.codes import PackedWeight
from ..memory.split_tensor import SplitTensor
from ..memory.tiers import Tiers
from ..models import Family
from ..placement import Placement
from .block import Block, Pass
from .stage_plan import StagePath, StagePlan, StagePlans
from .stages import Stage


class StageCompute:
    """The compute of one engine: its model, stages, weights, placement and plans are fixed;
    each call is given the block and the pass it computes for."""

    def __init__(self, cfg: ModelConfig, family: Family, stages: list[Stage],
                 weights: dict[str, SplitTensor], placement: Placement, tiers: Tiers,
                 plans: StagePlans, reads):
        self.cfg, self.family, self.stages, self.weights = cfg, family, stages, weights
        self.placement, self.tiers, self.plans, self.reads = placement, tiers, plans, reads

    def run(self, block: Block, p: Pass, stage: int, batch: int, w: dict, loaded):
        """Stage ``stage`` for GPU batch ``batch``; returns the new (q, k, v, valid) of an
        attention stage, to be stored, else None."""
        s, state, fam, cfg = self.stages[stage], block.states[batch], self.family, self.cfg
        if p.decode and s.kind == "mlp" and s.moe:
            if batch == p.first:  # once for the block's tokens
                self._experts_for_block(block, p, stage, w)
            return None
        h, new = state.hidden, None
        if isinstance(h, SplitTensor):
            h = h.read()
        if s.kind == "embed":
            h = fam.embed(cfg, w, state.ids, state.positions)
        plan = self._layer_plan(block, stage, batch, w, h) if p.decode and s.kind != "embed" \
            else None
        if plan is not None and plan.call is not None:
            h, new = self._fused(block, plan, stage, batch, h, loaded)
        elif s.kind in ("attn", "layer"):
            h, new = self._attention(block, p, stage, batch, w, h, loaded)
        if s.kind in ("mlp", "layer") and (plan is None or plan.call is None):
            h = self._mlp(p, w, h)
        if s.kind == "head":
            # contiguous: the same kernels, whatever the batch, read the last token alone
            state.logits = fam.head(cfg, w, h[:, -1:, :].contiguous())[:, -1]
            h = None
        state.hidden = self._keep_hidden(block, batch, h)
        return new

    def _layer_plan(self, block: Block, stage: int, batch: int, w: dict,
                    h) -> StagePlan | None:
        """Stage ``stage``'s plan for ``batch`` (made at the block's first decode step), or
        None where no compiled call can take this input at all."""
        s = self.stages[stage]
        if (self.plans.fused is None or s.kind == "head" or not isinstance(h, torch.Tensor)
                or h.dtype != torch.float32 or h.shape[1] != 1 or not h.is_contiguous()):
            return None
        known = self.plans.layers.get((stage, batch))
        if known is not None:
            return known
        # weights read in place every step: the call's pointers hold
        resident = all(self.weights[n].resident or isinstance(w[short], PackedWeight)
                       for short, n in s.weights.items())
        last_here = block.attention_stage.get(s.layer + 1) is None
        return self.plans.layer(stage, batch, s.kind, w, h.shape[0], resident,
                                block.caches.get((stage, batch)),
                                block.next_cache(s.layer, batch),
                                last_here and s.layer + 1 < self.cfg.num_layers)

    def _fused(self, block: Block, plan: StagePlan, stage: int, batch: int,
               h: torch.Tensor, loaded):
        """Stage ``stage`` of a decode step through its compiled call; (h, new K/V or
        None)."""
        state, call = block.states[batch], plan.call
        if call.kind == "mlp":
            return call.mlp(h), None
        if plan.attention is not None:  # the cache's attention inside the call
            got = plan.attention.layer(h, state, loaded)
            if got is not None:
                out, x = got
                if x is not None:  # the next layer's speculation, not taken by the call
                    self._speculate_next(block, stage, batch, x)
                return out, None
        x, q, k, v = call.attention_inputs(h, state)
        self._speculate_next(block, stage, batch, x)
        _, bias, seen = state.attention_inputs(self.cfg.window_of(self.stages[stage].layer))
        out = block.caches[(stage, batch)].attend(loaded, q, k, v, seen, bias)
        return call.attention_output(h, out), (q, k, v, state.valid)

    def _speculate_next(self, block: Block, stage: int, batch: int, x: torch.Tensor) -> None:
        """The next layer's cache may choose what to read from this layer's input ``x``."""
        state, layer = block.states[batch], self.stages[stage].layer
        following = block.next_cache(layer, batch)
        if following is not None:  # with the next layer's positions and window
            pos_enc, _, seen = state.attention_inputs(self.cfg.window_of(layer + 1))
            following.speculate(x, pos_enc, state.valid, seen)
        elif layer + 1 < self.cfg.num_layers:
            state.handoff = x  # the next layer is on the next pipeline rank

    def _attention(self, block: Block, p: Pass, stage: int, batch: int, w: dict,
                   h: torch.Tensor, loaded):
        fam, cfg, state = self.family, self.cfg, block.states[batch]
        if cfg.is_linear(self.stages[stage].layer):
            return self._recurrent(block, p, stage, batch, w, h), None
        window = cfg.window_of(self.stages[stage].layer)
        pos_enc, bias, seen = state.attention_inputs(window)
        x = fam.attn_input(cfg, w, h)
        if p.decode:
            self._speculate_next(block, stage, batch, x)
        q, k, v = fam.attn_qkv(cfg, w, x, pos_enc)
        sinks = fam.attention_sinks(cfg, w)
        if p.decode:
            out = block.caches[(stage, batch)].attend(loaded, q, k, v, seen, bias, sinks=sinks)
        else:
            known = block.prefix.kv.get((self.stages[stage].layer, batch)) \
                if block.prefix is not None else None
            if known is not None:  # the first columns' keys and values, computed before
                k = torch.cat([known[0].to(k.device, k.dtype), k], 1)
                v = torch.cat([known[1].to(v.device, v.dtype), v], 1)
            rows = min(p.mode.prefill_chunk, score_rows(q.shape[0], q.shape[2], k.shape[1]))
            out = attend_prompt(q, k, v, state.valid, window, rows=rows, sinks=sinks)
        return fam.attn_out(cfg, w, h, out), (q, k, v, state.valid)

    def _recurrent(self, block: Block, p: Pass, stage: int, batch: int, w: dict,
                   h: torch.Tensor) -> torch.Tensor:
        """A recurrent layer's token mixing: its rows' states read from where they are
        held, mixed with the new tokens by the family's math, written back. A prompt pass
        that keeps no caches (a recorder's) starts from zero states and keeps none."""
        fam, cfg, state = self.family, self.cfg, block.states[batch]
        if p.decode:
            self._speculate_next(block, stage, batch, fam.attn_input(cfg, w, h))
        held = block.caches.get((stage, batch))
        if held is None:
            rows = {name: torch.zeros((h.shape[0], *shape), dtype=torch.float32,
                                      device=h.device)
                    for name, shape in fam.recurrent_state_shapes(cfg).items()}
        else:
            rows = held.read()
        out, rows = fam.recurrent_mix(cfg, w, h, rows, state.valid[:, -h.shape[1]:])
        if held is not None:
            held.write(rows)
        return out

    def _experts_for_block(self, block: Block, p: Pass, stage: int, w: dict) -> None:
        """A MoE MLP stage of a decode step for every GPU batch of the pass at once: the
        math is token by token, so their tokens go through it together, and each expert a
        token chose is read once for the block, not once for each GPU batch that chose it
        (FlexGen's reuse of a stage's weights across its GPU batches, for experts; on a CPU
        one experts call a block, or the whole stage in one call: :mod:`.fused_moe`)."""
        counting = self.reads.routing_counts is not None
        on_host = self.placement.cpu_expert_compute and not counting
        if on_host:
            w = self.reads.on_host(stage, w)
        plan = self.plans.moe_stage(stage, w, lambda: self._dense_resident(stage), on_host,
                                    counting)
        hidden = []
        for batch in p.batches:
            h = block.states[batch].hidden
            hidden.append(h.read() if isinstance(h, SplitTensor) else h)
        h = torch.cat(hidden) if len(hidden) > 1 else hidden[0]
        out = plan.moe(h) if plan.path is StagePath.FUSED_MOE else None
        if out is None:
            out = self._mlp(p, w, h)
        for batch, h in zip(p.batches, out.split([h.shape[0] for h in hidden])):
            block.states[batch].hidden = self._keep_hidden(block, batch, h)

    def _dense_resident(self, stage: int) -> bool:
        """The stage's weights other than routed experts (router, norm) read in place."""
        return all(self.weights[n].resident for short, n in self.stages[stage].weights.items()
                   if not short.startswith("experts."))

    def _mlp(self, p: Pass, w: dict, h: torch.Tensor) -> torch.Tensor:
        """The MLP, a prompt in chunks of ``prefill_chunk`` tokens (it works token by token,
        so only one chunk's wide temporaries are alive at a time)."""
        n, chunk = h.shape[1], p.mode.prefill_chunk
        if n <= chunk:
            return self.family.mlp(self.cfg, w, h)
        out = torch.empty_like(h)
        for start in range(0, n, chunk):
            out[:, start:start + chunk] = self.family.mlp(self.cfg, w, h[:, start:start + chunk])
        return out

    def _keep_hidden(self, block: Block, batch: int, h):
        """Offload ``batch``'s hidden state as the placement says, into one buffer per batch
        and shape (the previous stage's copy has been read back by then)."""
        split = self.placement.act_split
        if h is None or split[0] == 1.0:
            return h
        key = (batch, tuple(h.shape), h.dtype)
        held = block.activations.get(key)
        if held is None:
            held = SplitTensor(self.tiers, tuple(h.shape), h.dtype, split, "activations")
            block.activations[key] = held
        held.write(h)
        return held
