"""The offloading engine: one zig-zag block schedule for every model family and KV policy.

For each generated token i, for each schedule stage j (embedding, attention and
MLP of every layer, output head), for each GPU batch k of the block: the stage's
weights are loaded once and reused across the k batches, the batch's KV cache is
loaded, the stage computes, and the new keys and values are stored. The
overlapped loop issues the next step's loads and the previous step's stores on
separate lanes while the current step computes, with one synchronization per step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .attention import attend, mask_bias, visible
from .config import ModelConfig
from .kv.base import CacheSpec, KVPolicy
from .models import family_of
from .policy import Policy
from .sampling import Sampler
from .streams import Lanes
from .tiered import TieredTensor
from .tiers import Tiers


@dataclass
class Stage:
    kind: str  # "embed", "attn", "mlp", "layer" (attention + MLP) or "head"
    layer: int | None
    weights: dict[str, str]  # name the family math uses -> name in the weight store


def build_stages(cfg: ModelConfig, sep_layer: bool) -> list[Stage]:
    names = family_of(cfg).stage_weights(cfg)
    stages = [Stage("embed", None, {n: n for n in names["embed"]})]
    for i in range(cfg.num_layers):
        per = {kind: {n: f"layers.{i}.{n}" for n in names[kind]} for kind in ("attn", "mlp")}
        if sep_layer:
            stages += [Stage("attn", i, per["attn"]), Stage("mlp", i, per["mlp"])]
        else:
            stages.append(Stage("layer", i, {**per["attn"], **per["mlp"]}))
    stages.append(Stage("head", None, {n: n for n in names["head"]}))
    return stages


@dataclass
class BatchState:
    """One GPU batch of a block: its inputs for the current token and its outputs so far."""

    ids: torch.Tensor  # [b, s] tokens fed at this iteration
    valid: torch.Tensor  # [b, length] True for real (not padding) tokens, inputs included
    positions: torch.Tensor  # [b, s] position ids of the inputs
    pos_enc: object = None  # the family's encoding of ``positions`` (rotary cos/sin)
    bias: torch.Tensor | None = None  # additive attention mask [b, 1, s, length]
    visible: torch.Tensor | None = None  # [b, length]: keys the newest token may see
    hidden: object = None
    logits: torch.Tensor | None = None
    new_kv: dict = field(default_factory=dict)  # stage index -> values waiting to be stored


class Engine:
    def __init__(self, cfg: ModelConfig, weights: dict[str, TieredTensor], policy: Policy,
                 tiers: Tiers, kv_policy: KVPolicy, dtype: torch.dtype):
        self.cfg, self.weights, self.policy, self.tiers = cfg, weights, policy, tiers
        self.kv_policy, self.dtype = kv_policy, dtype
        self.family = family_of(cfg)
        self.stages = build_stages(cfg, policy.sep_layer)
        self.states: list[BatchState] = []
        self.caches: dict[tuple[int, int], object] = {}
        self._activations: dict[tuple, TieredTensor] = {}  # offloaded hidden states, reused
        # debug statistics of the last block: host synchronizations of each iteration
        self.debug: dict[str, list] = {"host_syncs_per_step": []}

    # ---- one block --------------------------------------------------------------------------
    def run_block(self, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
                  sampler: Sampler, on_tokens=None, keep_logits: bool = False) -> dict:
        """Generate ``steps`` tokens for each GPU batch of (ids [b, P], valid [b, P]) pairs.

        ``on_tokens(iteration, [ids per batch])`` may return True to stop early.
        Returns per-iteration wall times, and logits when ``keep_logits``.
        """
        dev = self.tiers.device
        prompt_len = batches[0][0].shape[1]
        self.states = []
        for ids, valid in batches:
            valid = valid.to(dev)
            positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
            self.states.append(self._prepare(BatchState(ids.to(dev), valid, positions)))
        self._make_caches(len(batches[0][0]), prompt_len + steps)
        lanes = Lanes(dev, self.policy.overlap)
        times, logits, tokens = [], [], []
        syncs = self.debug["host_syncs_per_step"] = []
        try:
            for i in range(steps):
                start, before = time.perf_counter(), self.tiers.host_syncs
                if i > 0:
                    self._advance(tokens)
                self._iteration(i, lanes)
                host = [self.tiers.host_values(s.logits)[0] for s in self.states]
                tokens = [sampler(x, i, k) for k, x in enumerate(host)]
                if keep_logits:
                    logits.append([x.float() for x in host])
                if self.tiers.is_cuda:
                    torch.cuda.synchronize()
                    self.tiers.count_sync()
                times.append(time.perf_counter() - start)
                syncs.append(self.tiers.host_syncs - before)
                if on_tokens is not None and on_tokens(i, tokens):
                    break
        except BaseException:
            self.kv_policy.abort()  # wake loads waiting for a speculation that will not come
            raise
        finally:
            lanes.close()
            self.caches.clear()
            self._activations.clear()
        return {"times": times, "logits": logits}

    def _make_caches(self, batch_size: int, max_len: int) -> None:
        p, cfg = self.policy, self.cfg
        self.caches = {}
        for j, stage in enumerate(self.stages):
            if stage.kind not in ("attn", "layer"):
                continue
            for k in range(len(self.states)):
                spec = CacheSpec(self.tiers, stage.layer, k, batch_size, max_len, cfg.num_kv_heads,
                                 cfg.head_dim, self.dtype, p.cache_split, p.compress_cache,
                                 p.cpu_cache_compute, cfg.sliding_window)
                self.caches[(j, k)] = self.kv_policy.make_cache(spec)

    def _advance(self, tokens: list[torch.Tensor]) -> None:
        for state, new in zip(self.states, tokens):
            dev = state.valid.device
            state.ids = new.view(-1, 1).to(dev)
            state.positions = state.valid.long().sum(-1, keepdim=True)
            state.valid = torch.cat([state.valid, torch.ones_like(state.valid[:, :1])], dim=1)
            self._prepare(state)

    def _prepare(self, state: BatchState) -> BatchState:
        """What every layer of this iteration shares: position encodings and the mask bias."""
        state.pos_enc = self.family.encode_positions(self.cfg, state.positions)
        state.bias = mask_bias(state.valid, state.ids.shape[1], self.dtype,
                               self.cfg.sliding_window)
        # what the newest token may attend to (the KV policies select among these only)
        state.visible = visible(state.valid, self.cfg.sliding_window)
        return state

    # ---- the schedule -----------------------------------------------------------------------
    def _load_weights(self, j: int) -> dict[str, torch.Tensor]:
        return {short: self.weights[full].read() for short, full in self.stages[j].weights.items()}

    def _load_cache(self, i: int, j: int, k: int):
        if i == 0 or (j, k) not in self.caches:
            return None
        return self.caches[(j, k)].load(self.states[k].valid.shape[1] - 1)

    def _store_cache(self, i: int, j: int, k: int, new) -> None:
        """Keep ``new`` = (q, k, v, valid) of stage ``j``, batch ``k`` (popped by the caller on
        the compute side, so that a store lane receives, and marks, the tensors it reads)."""
        if new is None:
            return
        q, key, value, valid = new
        cache = self.caches[(j, k)]
        if i == 0:
            cache.store_prompt(q, key, value, valid)
        else:
            cache.store_token(key, value, valid.shape[1] - 1)

    def _iteration(self, i: int, lanes: Lanes) -> None:
        num_batches = len(self.states)
        steps = [(j, k) for j in range(len(self.stages)) for k in range(num_batches)]
        if not self.policy.overlap:
            for j in range(len(self.stages)):
                weights = self._load_weights(j)
                for k in range(num_batches):
                    self._compute(i, j, k, weights, self._load_cache(i, j, k))
                    self._store_cache(i, j, k, self._new_kv(j, k))
            return
        weight_loads = {0: self._submit_weights(lanes, 0)}
        cache_load = self._submit_cache(lanes, "cache_load", self._load_cache, i, 0, 0)
        previous = None
        for n, (j, k) in enumerate(steps):
            if k == 0 and j + 1 < len(self.stages):
                weight_loads[j + 1] = self._submit_weights(lanes, j + 1)
            next_load = None
            if n + 1 < len(steps):
                next_load = self._submit_cache(lanes, "cache_load", self._load_cache, i,
                                               *steps[n + 1])
            if previous is not None:
                self._submit_cache(lanes, "cache_store", self._store_cache, i, *previous,
                                   self._new_kv(*previous))
            self._compute(i, j, k, lanes.result(weight_loads[j]), lanes.result(cache_load))
            lanes.sync()  # the cache lanes only: a weight load is waited for where it is used
            if k == num_batches - 1:
                del weight_loads[j]
            cache_load, previous = next_load, (j, k)
        self._store_cache(i, *previous, self._new_kv(*previous))

    def _new_kv(self, j: int, k: int):
        return self.states[k].new_kv.pop(j, None)

    def _submit_weights(self, lanes: Lanes, j: int):
        resident = all(self.weights[n].resident for n in self.stages[j].weights.values())
        return lanes.submit("weights", self._load_weights, j, inline=resident, track=False)

    def _submit_cache(self, lanes: Lanes, lane: str, fn, i: int, j: int, k: int, *extra):
        cache = self.caches.get((j, k))
        return lanes.submit(lane, fn, i, j, k, *extra, inline=cache is None or cache.resident)

    # ---- compute ----------------------------------------------------------------------------
    def _compute(self, i: int, j: int, k: int, w: dict, loaded) -> None:
        stage, state, fam, cfg = self.stages[j], self.states[k], self.family, self.cfg
        h = state.hidden
        if isinstance(h, TieredTensor):
            h = h.read()
        if stage.kind == "embed":
            h = fam.embed(cfg, w, state.ids, state.positions)
        if stage.kind in ("attn", "layer"):
            h = self._attention(i, j, k, w, h, loaded)
        if stage.kind in ("mlp", "layer"):
            h = fam.mlp(cfg, w, h)
        if stage.kind == "head":
            state.logits = fam.head(cfg, w, h[:, -1:, :])[:, -1]
            h = None
        state.hidden = self._keep_hidden(k, h)

    def _attention(self, i: int, j: int, k_batch: int, w: dict, h: torch.Tensor, loaded):
        fam, cfg, state = self.family, self.cfg, self.states[k_batch]
        x = fam.attn_input(cfg, w, h)
        if i > 0:
            self.kv_policy.before_attention(self.stages[j].layer, k_batch, x, state)
        q, k, v = fam.attn_qkv(cfg, w, x, state.pos_enc)
        if i == 0:
            out = attend(q, k, v, state.bias)
        else:
            out = self.caches[(j, k_batch)].attend(loaded, q, k, v, state.visible, state.bias)
        state.new_kv[j] = (q, k, v, state.valid)
        return fam.attn_out(cfg, w, h, out)

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
