"""The offloading engine: one zig-zag block schedule for every model family and KV policy.

A block runs two named phases: the **prefill** (iteration 0: the prompts go through every
layer and their keys and values are stored) and **decode** steps (one token per GPU batch
per iteration, attending to the cache). For each iteration, for each schedule stage j
(embedding, attention and MLP of every layer, output head), for each GPU batch k of the
block: the stage's weights are loaded once and reused across the k batches, the batch's KV
cache is loaded, the stage computes and returns the new keys and values, and they are stored.
A decode step's mixture-of-experts MLP stage is the exception: it runs once, for the tokens
of every GPU batch of the block together (each routed expert read once for all of them).

The overlapped loop issues the next step's loads and the previous step's stores on
separate lanes while the current step computes, with one synchronization per step.
Ordering rule for speculation (InfiniGen): the cache of layer i+1, batch k is told what to
read (``KVCache.speculate``) during the compute of layer i, batch k, but its load may already
be queued one step ahead on the load lane; such a ``load`` waits for its speculation, so a
speculating cache is never ``inline`` (an inline load would run on the compute thread before
the speculation it needs and wait forever).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..kv.base import CacheSpec, KVPolicy
from ..models import family_of
from ..policy import Policy
from ..sampling import Sampler
from .attention import mask_bias, visible
from .expert_homes import expert_of
from .fused_decode import FusedDecode
from .prefill_cache import Prefilled
from .routing_profile import COUNTED_MATRIX, CountedRead
from .stage_compute import StageCompute
from .stages import LayerSlice, Stage, build_stages  # noqa: F401 (re-exported)
from .streams import Lanes
from .tiered import OnDemand, TieredTensor
from .tiers import Tiers

# called with (layer, q, k, valid) of each layer's prompt pass instead of storing it
PromptRecorder = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


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
    handoff: torch.Tensor | None = None  # the last layer's attention input, for the next rank


@dataclass
class Step:
    """One iteration of a block: the token chosen for every GPU batch, its wall time, and
    the logits when asked for."""

    index: int  # 0 is the prefill
    tokens: list[torch.Tensor]  # per GPU batch, [b] on the CPU
    seconds: float
    logits: list[torch.Tensor] | None = None


class Engine(StageCompute):
    stops_early = True  # the caller may stop a block when every row has ended
    reuses_prefill = True  # a block may start from a kept prefill (:mod:`.prefill_cache`)

    def __init__(self, cfg: ModelConfig, weights: dict[str, TieredTensor], policy: Policy,
                 tiers: Tiers, kv_policy: KVPolicy, dtype: torch.dtype,
                 part: LayerSlice | None = None):
        self.cfg, self.weights, self.policy, self.tiers = cfg, weights, policy, tiers
        self.kv_policy, self.dtype = kv_policy, dtype
        self.family = family_of(cfg)
        self.part = part or LayerSlice.whole(cfg)
        self.stages = build_stages(cfg, policy.split_layers, self.part)
        self.states: list[BatchState] = []
        self.caches: dict[tuple[int, int], object] = {}  # (stage, GPU batch) -> KVCache
        self.attention_stage: dict[int, int] = {}  # layer -> its attention stage
        self.record: PromptRecorder | None = None
        # (layer, expert) -> stages that read it, while a routing profile is recorded
        self.routing_counts: dict[tuple[int, int], int] | None = None
        self.prefilled: Prefilled | None = None  # the block starts from this prefill
        self.capture: Prefilled | None = None  # the block's prefill is kept here
        self.prefill_chunk = 1 << 30  # tokens per prefill chunk, set for each block
        self._block: list[int] = []  # the GPU batches of the iteration being run
        self.running = False  # one block at a time: its caches and states are the engine's
        self._activations: dict[tuple, TieredTensor] = {}  # offloaded hidden states, reused
        # debug statistics of the last block: host synchronizations of each iteration
        self.debug: dict[str, list] = {"host_syncs_per_step": []}
        # a Llama-family decode step on a CPU as one compiled call a stage (None: never)
        self.fused = FusedDecode.for_model(cfg, dtype, tiers.is_cuda)
        self._moe_plans: dict = {}  # MoE stage -> its one-call decode step, or None
        # per stage: (what the weights read in place give, built once; the names read anew)
        self._stage_reads: dict[int, tuple[dict, list[tuple[str, str]]]] = {}
        self._host_experts: dict[int, dict] = {}  # stage -> OnHost handles (cpu_expert_compute)

    def reset_counters(self) -> None:
        """Start a generation's own statistics (the host syncs are per block already)."""

    def any_rank(self, flag: bool, what: str) -> bool:
        """``flag`` on any rank of the run: this process is the only one."""
        return flag

    # ---- one block --------------------------------------------------------------------------
    def generate_block(self, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
                       sampler: Sampler, keep_logits: bool = False,
                       record: PromptRecorder | None = None, prefilled: Prefilled | None = None,
                       capture: Prefilled | None = None) -> Iterator[Step]:
        """Up to ``steps`` iterations for each GPU batch of (ids [b, P], valid [b, P]) pairs,
        one :class:`Step` at a time: the caller stops early by not asking for more.

        ``record``: run the prefill only, handing each layer's prompt q and k to it instead
        of keeping a cache (calibration). ``prefilled``: fill the caches from this kept
        prefill of the same prompts instead of running it; ``capture``: keep this block's
        prefill there."""
        if self.running:
            raise RuntimeError("a block is already running on this engine; finish or close "
                               "its generator first")
        self.running = True
        lanes = None
        try:
            dev = self.tiers.device
            prompt_len = batches[0][0].shape[1]
            self.states = []
            for ids, valid in batches:
                valid = valid.to(dev)
                positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
                self.states.append(self._prepare(BatchState(ids.to(dev), valid, positions)))
            self.record, self.prefilled, self.capture = record, prefilled, capture
            self.prefill_chunk = self._prefill_chunk(len(batches[0][0]), prompt_len)
            if record is None:
                self._make_caches(len(batches[0][0]), prompt_len + steps)
            else:
                steps = 1
            lanes = Lanes(dev, self.policy.overlap)
            self.debug["host_syncs_per_step"] = []
            yield from self._steps(steps, sampler, keep_logits, lanes)
        except BaseException:  # an error, an interrupt, or the caller stopped (GeneratorExit)
            for cache in self.caches.values():  # wake loads waiting for a speculation
                cache.abort()
            raise
        finally:
            if lanes is not None:
                lanes.close()
            self.caches.clear()
            self._activations.clear()
            if self.fused is not None:
                self.fused.reset()
            self.record = self.prefilled = self.capture = None
            self.running = False

    def _prefill_chunk(self, batch_size: int, prompt_len: int) -> int:
        from .memory_plan import prefill_chunk
        policy = dataclasses.replace(self.policy, gpu_batch_size=batch_size)
        return prefill_chunk(self.cfg, policy, self.dtype.itemsize, prompt_len)

    def _steps(self, steps: int, sampler: Sampler, keep_logits: bool,
               lanes: Lanes) -> Iterator[Step]:
        """The block's iterations in one process: every GPU batch through every stage."""
        tokens = []
        everything = range(len(self.states))
        for i in range(steps):
            start, before = time.perf_counter(), self.tiers.host_syncs
            decode = i > 0
            for k in everything if decode else ():
                self._advance(k, tokens[k])
            if not decode and self.prefilled is not None:
                logits = self._restore(self.prefilled)
            else:
                self._iteration(decode, lanes, everything)
                logits = [self._logits(k) for k in everything]
                if not decode and self.capture is not None:
                    self.capture.logits = [x.clone() for x in logits]
            tokens = [sampler(x, i, k) for k, x in enumerate(logits)]
            self._end_step(before)
            yield Step(i, tokens, time.perf_counter() - start,
                       [x.float() for x in logits] if keep_logits else None)

    def _restore(self, prefilled: Prefilled) -> list[torch.Tensor]:
        """The prefill from a kept one: every cache stores its layer's prompt keys and values
        (no queries: a policy that needs them runs its own prefill); the first logits."""
        dev = self.tiers.device
        for (j, k), cache in self.caches.items():
            key, value = prefilled.take(self.stages[j].layer, k)
            cache.store_prompt(None, key.to(dev), value.to(dev), self.states[k].valid)
        return list(prefilled.logits)

    def _logits(self, k: int) -> torch.Tensor:
        return self.tiers.host_values(self.states[k].logits)[0]

    def _end_step(self, syncs_before: int) -> None:
        if self.tiers.is_cuda:
            torch.cuda.synchronize()
            self.tiers.count_sync()
            self.tiers.settle()  # byte counts kept on the device until now: nothing to wait
        self.debug["host_syncs_per_step"].append(self.tiers.host_syncs - syncs_before)

    def run_block(self, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
                  sampler: Sampler, keep_logits: bool = False) -> dict:
        """All ``steps`` iterations: their wall times, and logits when ``keep_logits``."""
        done = list(self.generate_block(batches, steps, sampler, keep_logits))
        return {"times": [s.seconds for s in done],
                "logits": [s.logits for s in done] if keep_logits else []}

    def _make_caches(self, batch_size: int, max_len: int) -> None:
        p, cfg = self.policy, self.cfg
        self.caches, self.attention_stage = {}, {}
        for j, stage in enumerate(self.stages):
            if stage.kind not in ("attn", "layer"):
                continue
            for k in range(len(self.states)):
                spec = CacheSpec(self.tiers, stage.layer, k, batch_size, max_len, cfg.num_kv_heads,
                                 cfg.head_dim, self.dtype, p.cache_split, p.compress_cache,
                                 p.cpu_cache_compute, cfg.sliding_window)
                self.caches[(j, k)] = self.kv_policy.make_cache(spec)
                self.attention_stage[stage.layer] = j

    def _advance(self, k: int, new: torch.Tensor) -> None:
        """GPU batch ``k`` takes its next token ``new`` [b] as input."""
        state = self.states[k]
        dev = state.valid.device
        state.ids = new.view(-1, 1).to(dev)
        state.positions = state.valid.long().sum(-1, keepdim=True)
        state.valid = torch.cat([state.valid, torch.ones_like(state.valid[:, :1])], dim=1)
        self._prepare(state)

    def _prepare(self, state: BatchState) -> BatchState:
        """What every layer of this iteration shares: position encodings and the mask bias."""
        state.pos_enc = self.family.encode_positions(self.cfg, state.positions)
        # decode's mask (one query row); a prompt's is built per chunk by attend_prompt
        state.bias = mask_bias(state.valid, 1, self.dtype, self.cfg.sliding_window) \
            if state.ids.shape[1] == 1 else None
        # what the newest token may attend to (the KV policies select among these only)
        state.visible = visible(state.valid, self.cfg.sliding_window)
        return state

    # ---- the schedule -----------------------------------------------------------------------
    def _load_weights(self, j: int) -> dict[str, torch.Tensor]:
        """Stage ``j``'s weights for compute; routed experts off the device as handles that
        the MoE math reads only for the experts its tokens use (once for the whole stage:
        the handles are shared by its GPU batches)."""
        kept = self._stage_reads.get(j) if self.routing_counts is None else None
        fixed, rest = kept or self._split_reads(j)
        out = dict(fixed)
        for short, full in rest:
            t = self.weights[full]
            if t.kind == "experts" and self.routing_counts is not None:
                out[short] = CountedRead(t, self.routing_counts, expert_of(full),
                                         counted=full.endswith(COUNTED_MATRIX))
            else:
                out[short] = OnDemand(t) if t.kind == "experts" and not t.resident \
                    else t.read_for_compute()
        return out

    def _split_reads(self, j: int) -> tuple[dict, list[tuple[str, str]]]:
        """Stage ``j``'s routed experts that the compute device reads where they are stored
        (on the device, or codes in CPU memory a CPU multiplies in place): their reads are
        the stored tensors themselves, move nothing and count nothing, so they are made once
        and reused every step (a MoE stage has thousands, and a step uses a few). The rest
        are read anew each time (a dense stage has a handful of weights, each read in a
        few ops). Nothing is kept while a routing profile counts reads."""
        fixed, rest = {}, []
        for short, full in self.stages[j].weights.items():
            t = self.weights[full]
            in_place = t.kind == "experts" and (t.resident or t.packed_in_place)
            if in_place and self.routing_counts is None:
                fixed[short] = t.read_for_compute()
            else:
                rest.append((short, full))
        if self.routing_counts is None:
            self._stage_reads[j] = fixed, rest
        return fixed, rest

    def _load_cache(self, decode: bool, j: int, k: int):
        if not decode or (j, k) not in self.caches:
            return None
        return self.caches[(j, k)].load(self.states[k].valid.shape[1] - 1)

    def _store_cache(self, decode: bool, j: int, k: int, new) -> None:
        """Keep ``new`` = (q, k, v, valid), the keys and values stage ``j`` of batch ``k``
        computed (or hand the prompt's to the recorder)."""
        if new is None:
            return
        q, key, value, valid = new
        if self.record is not None:
            self.record(self.stages[j].layer, q, key, valid)
        elif decode:
            self.caches[(j, k)].store_token(key, value, valid.shape[1] - 1)
        else:
            cache = self.caches[(j, k)]
            cache.store_prompt(q, key, value, valid)
            if self.capture is not None:  # read back from the cache later, when it is exact
                self.capture.keep(self.stages[j].layer, k, key, value, cache.prompt_reader(
                    key.shape[1], key.shape[0]))

    def _iteration(self, decode: bool, lanes: Lanes, batches: range | list[int]) -> None:
        """Every stage for the GPU batches ``batches`` (all of the block's, or one pipeline
        micro-batch): each stage's weights loaded once for them, in the zig-zag order."""
        first, last = batches[0], batches[-1]
        self._block = list(batches)
        if not self.policy.overlap:
            for j in range(len(self.stages)):
                weights = self._load_weights(j)
                for k in batches:
                    new = self._compute(decode, j, k, weights, self._load_cache(decode, j, k))
                    self._store_cache(decode, j, k, new)
            return
        steps = [(j, k) for j in range(len(self.stages)) for k in batches]
        weight_loads = {0: self._submit_weights(lanes, 0)}
        cache_load = self._submit_cache(lanes, "cache_load", self._load_cache, decode, 0, first)
        previous = None  # ((j, k), new K/V) of the step before, stored while this one computes
        for n, (j, k) in enumerate(steps):
            if k == first and j + 1 < len(self.stages):
                weight_loads[j + 1] = self._submit_weights(lanes, j + 1)
            next_load = None
            if n + 1 < len(steps):
                next_load = self._submit_cache(lanes, "cache_load", self._load_cache, decode,
                                               *steps[n + 1])
            if previous is not None:
                self._submit_cache(lanes, "cache_store", self._store_cache, decode, *previous[0],
                                   previous[1])
            new = self._compute(decode, j, k, lanes.result(weight_loads[j]),
                                lanes.result(cache_load))
            lanes.sync()  # the cache lanes only: a weight load is waited for where it is used
            if k == last:
                del weight_loads[j]
            cache_load, previous = next_load, ((j, k), new)
        self._store_cache(decode, *previous[0], previous[1])

    def _submit_weights(self, lanes: Lanes, j: int):
        resident = all(self.weights[n].resident for n in self.stages[j].weights.values())
        return lanes.submit("weights", self._load_weights, j, inline=resident, track=False)

    def _submit_cache(self, lanes: Lanes, lane: str, fn, decode: bool, j: int, k: int, *extra):
        cache = self.caches.get((j, k))
        return lanes.submit(lane, fn, decode, j, k, *extra, inline=cache is None or cache.inline)
