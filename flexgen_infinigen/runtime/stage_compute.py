"""What one schedule stage computes for one GPU batch (:class:`StageCompute`, the engine's
compute half): the embedding, attention (the per-operation path, or a decode step's fused
call), the MLP (a decode step's MoE MLP once for the whole block), the head, and where the
hidden state is kept between stages. :mod:`.engine` walks the schedule and calls these."""
from __future__ import annotations

import torch

from .attention import attend_prompt, score_rows
from .compression import PackedWeight
from .fused_moe import moe_plan
from .tiered import OnHost, TieredTensor
from .tiers import HOST


class StageCompute:
    """The compute of :class:`~.engine.Engine` (a mixin: it reads the engine's stages,
    states, caches, weights and policy)."""

    def _compute(self, decode: bool, j: int, k: int, w: dict, loaded):
        """Stage ``j`` for batch ``k``; returns the new (q, k, v, valid) of an attention
        stage, to be stored, else None."""
        stage, state, fam, cfg = self.stages[j], self.states[k], self.family, self.cfg
        if decode and stage.kind == "mlp" and stage.moe:
            if k == self._block[0]:
                on_host = self.policy.cpu_expert_compute and self.routing_counts is None
                self._experts_for_block(j, self._experts_on_host(j, w) if on_host else w)
            return None
        h, new = state.hidden, None
        if isinstance(h, TieredTensor):
            h = h.read()
        if stage.kind == "embed":
            h = fam.embed(cfg, w, state.ids, state.positions)
        plan = self._fused_plan(j, k, w, h) if decode and stage.kind != "embed" else None
        if plan is not None:
            h, new = self._fused(plan, j, k, h, loaded)
        elif stage.kind in ("attn", "layer"):
            h, new = self._attention(decode, j, k, w, h, loaded)
        if stage.kind in ("mlp", "layer") and plan is None:
            h = self._mlp(w, h)
        if stage.kind == "head":
            state.logits = fam.head(cfg, w, h[:, -1:, :])[:, -1]
            h = None
        state.hidden = self._keep_hidden(k, h)
        return new

    def _fused_plan(self, j: int, k: int, w: dict, h):
        """Stage ``j``'s fused decode call for batch ``k`` (:mod:`.fused_decode`), or None."""
        stage = self.stages[j]
        if (self.fused is None or stage.kind == "head" or not isinstance(h, torch.Tensor)
                or h.dtype != torch.float32 or h.shape[1] != 1 or not h.is_contiguous()):
            return None
        if (j, k) not in self.fused.plans:  # weights read in place every step: fixed pointers
            resident = all(self.weights[n].resident or isinstance(w[s], PackedWeight)
                           for s, n in stage.weights.items())
            following = self.attention_stage.get(stage.layer + 1)
            self.fused.plan(j, k, stage.kind, w, h.shape[0], resident, self.caches.get((j, k)),
                            None if following is None else self.caches[(following, k)],
                            following is None and stage.layer + 1 < self.cfg.num_layers)
        return self.fused.plans[(j, k)]

    def _fused(self, plan, j: int, k_batch: int, h: torch.Tensor, loaded):
        """Stage ``j`` of a decode step through its fused call; (h, new K/V or None)."""
        state = self.states[k_batch]
        if plan.kind == "mlp":
            return plan.mlp(h), None
        if plan.whole:  # attention over the full cache inside the call: nothing to store
            return plan.whole_layer(h, state), None
        if plan.select is not None:  # InfiniGen's layer in the call (the row written there)
            got = plan.select.layer(h, state, loaded)
            if got is not None:
                out, x = got
                if x is not None:  # the next layer's speculation, not taken by the call
                    self._speculate_next(j, k_batch, x)
                return out, None
        x, q, k, v = plan.attention_inputs(h, state)
        self._speculate_next(j, k_batch, x)
        out = self.caches[(j, k_batch)].attend(loaded, q, k, v, state.visible, state.bias)
        return plan.attention_output(h, out), (q, k, v, state.valid)

    def _speculate_next(self, j: int, k_batch: int, x: torch.Tensor) -> None:
        """The next layer's cache may choose what to read from this layer's input ``x``."""
        state = self.states[k_batch]
        following = self.attention_stage.get(self.stages[j].layer + 1)
        if following is not None:
            self.caches[(following, k_batch)].speculate(x, state.pos_enc, state.valid,
                                                        state.visible)
        elif self.stages[j].layer + 1 < self.cfg.num_layers:
            state.handoff = x  # the next layer is on the next pipeline rank

    def _attention(self, decode: bool, j: int, k_batch: int, w: dict, h: torch.Tensor, loaded):
        fam, cfg, state = self.family, self.cfg, self.states[k_batch]
        x = fam.attn_input(cfg, w, h)
        if decode:
            self._speculate_next(j, k_batch, x)
        q, k, v = fam.attn_qkv(cfg, w, x, state.pos_enc)
        if decode:
            out = self.caches[(j, k_batch)].attend(loaded, q, k, v, state.visible, state.bias)
        else:
            rows = min(self.prefill_chunk, score_rows(q.shape[0], q.shape[2], k.shape[1]))
            out = attend_prompt(q, k, v, state.valid, cfg.sliding_window, rows=rows)
        return fam.attn_out(cfg, w, h, out), (q, k, v, state.valid)

    def _experts_for_block(self, j: int, w: dict) -> None:
        """A MoE MLP stage of a decode step for every GPU batch of the block at once: the
        math is token by token, so their tokens go through it together, and each expert a
        token chose is read once for the block, not once for each GPU batch that chose it
        (FlexGen's reuse of a stage's weights across its GPU batches, for experts; on a CPU
        one experts call a block, or the whole stage in one call: :mod:`.fused_moe`)."""
        hidden = []
        for k in self._block:
            h = self.states[k].hidden
            hidden.append(h.read() if isinstance(h, TieredTensor) else h)
        h = torch.cat(hidden) if len(hidden) > 1 else hidden[0]
        plan = self._moe_plan(j, w) if self.routing_counts is None else None
        out = plan(h) if plan is not None else None
        if out is None:
            out = self._mlp(w, h)
        for k, h in zip(self._block, out.split([h.shape[0] for h in hidden])):
            self.states[k].hidden = self._keep_hidden(k, h)

    def _moe_plan(self, j: int, w: dict):
        """Stage ``j``'s one-call MoE step (:mod:`.fused_moe`), planned at its first decode
        step (None: the per-operation path). Only for weights read in place every step:
        the router and the norm resident, the experts their stored codes."""
        if j not in self._moe_plans:
            dense = [n for s, n in self.stages[j].weights.items() if not s.startswith("experts.")]
            fixed = not self.tiers.is_cuda and all(self.weights[n].resident for n in dense)
            self._moe_plans[j] = moe_plan(self.cfg, w) if fixed else None
        return self._moe_plans[j]

    def _experts_on_host(self, j: int, w: dict) -> dict:
        """Stage ``j``'s weights with its routed experts held whole in CPU memory handed over
        as :class:`~.tiered.OnHost` (``--cpu-expert-compute``: a decode step's few tokens go
        to them rather than they to the compute device; a prompt still fetches them, its
        many tokens being faster on the device). Experts the compute device already reads
        where they are (codes a CPU multiplies in place) stay as they are."""
        handles = self._host_experts.get(j)
        if handles is None:
            handles = {}
            for short, full in self.stages[j].weights.items():
                t = self.weights[full]
                if (t.kind == "experts" and not (t.resident or t.packed_in_place)
                        and len(t.segments) == 1 and t.segments[0].tier == HOST):
                    handles[short] = OnHost(t)
            self._host_experts[j] = handles
        w.update(handles)  # a fresh dict per stage load (Engine._load_weights)
        return w

    def _mlp(self, w: dict, h: torch.Tensor) -> torch.Tensor:
        """The MLP, a prompt in chunks of ``prefill_chunk`` tokens (it works token by token,
        so only one chunk's wide temporaries are alive at a time)."""
        n, chunk = h.shape[1], self.prefill_chunk
        if n <= chunk:
            return self.family.mlp(self.cfg, w, h)
        out = torch.empty_like(h)
        for start in range(0, n, chunk):
            out[:, start:start + chunk] = self.family.mlp(self.cfg, w, h[:, start:start + chunk])
        return out

    def _keep_hidden(self, k: int, h):
        """Offload batch ``k``'s hidden state as the policy says, into one buffer per batch and
        shape (the previous stage's copy has been read back by then)."""
        split = self.policy.act_split
        if h is None or split[0] == 1.0:
            return h
        key = (k, tuple(h.shape), h.dtype)
        held = self._activations.get(key)
        if held is None:
            held = TieredTensor(self.tiers, tuple(h.shape), h.dtype, split, "activations")
            self._activations[key] = held
        held.write(h)
        return held
