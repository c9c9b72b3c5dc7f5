"""The offloading engine: one zig-zag block schedule for every model family and KV policy.

A block runs two named phases: the **prefill** (iteration 0: the prompts go through every
layer and their keys and values are stored) and **decode** steps (one token per GPU batch
per iteration, attending to the cache). For each iteration, for each schedule stage
(embedding, attention and MLP of every layer, output head), for each GPU batch of the
block: the stage's weights are loaded once and reused across the batches, the batch's KV
cache is loaded, the stage computes and returns the new keys and values, and they are
stored. A decode step's mixture-of-experts MLP stage is the exception: it runs once, for the
tokens of every GPU batch of the block together (each routed expert read once for all of
them).

The overlapped loop issues the next step's loads and the previous step's stores on separate
lanes while the current step computes, with one synchronization per step. In the loop,
``stage`` indexes the schedule's stages and ``batch`` the block's GPU batches; a block's
mode (:class:`~.block.BlockMode`) and each iteration's :class:`~.block.Pass` are values the
loop passes down, and its state is one :class:`~.block.Block`.

Ordering rule for speculation (a cache that chooses its rows): the cache of layer i+1, batch
b is told what to read (``KVCache.speculate``) during the compute of layer i, batch b, but
its load may already be queued one step ahead on the load lane; such a ``load`` waits for
its speculation, so a speculating cache is never ``inline`` (an inline load would run on the
compute thread before the speculation it needs and wait forever).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import torch

from ..config import ModelConfig
from ..kv.base import CacheSpec, KVPolicy, PromptRecorder
from ..kv.recurrent import RecurrentState
from ..memory.lanes import Lanes
from ..memory.split_tensor import SplitTensor
from ..memory.tiers import Tiers
from ..models import family_of
from ..placement import Placement
from ..sampling import Sampler
from . import join
from .block import BatchState, Block, BlockMode, Pass, PrefixKV, Step
from .experts import StageReads
from .prefill_cache import Prefilled
from .stage_compute import StageCompute
from .stage_plan import StagePlans
from .stages import LayerSlice, Stage, build_stages  # noqa: F401 (re-exported)

__all__ = ["BatchState", "Engine", "PromptRecorder", "Step"]


class Engine:
    stops_early = True  # the caller may stop a block when every row has ended
    reuses_prefill = True  # a block may start from a kept prefill (:mod:`.prefill_cache`)

    def __init__(self, cfg: ModelConfig, weights: dict[str, SplitTensor], policy: Placement,
                 tiers: Tiers, kv_policy: KVPolicy, dtype: torch.dtype,
                 part: LayerSlice | None = None):
        self.cfg, self.weights, self.policy, self.tiers = cfg, weights, policy, tiers
        self.kv_policy, self.dtype = kv_policy, dtype
        family = family_of(cfg)
        self.part = part or LayerSlice.whole(cfg)
        self.stages = build_stages(cfg, policy.split_layers, self.part)
        self.block = Block()  # the running block's state (one block at a time)
        self.running = False
        self._lanes: Lanes | None = None  # the running block's lanes
        # debug statistics of the last block: host synchronizations of each iteration
        self.debug: dict[str, list] = {"host_syncs_per_step": []}
        self.plans = StagePlans(cfg, dtype, tiers.is_cuda)
        self.reads = StageReads(weights, self.stages)
        self.compute = StageCompute(cfg, family, self.stages, weights, policy, tiers,
                                    self.plans, self.reads)

    # the running block's state, by its old names
    @property
    def states(self) -> list[BatchState]:
        return self.block.states

    @states.setter
    def states(self, value: list[BatchState]) -> None:
        self.block.states = value

    @property
    def caches(self) -> dict:
        return self.block.caches

    @property
    def attention_stage(self) -> dict[int, int]:
        return self.block.attention_stage

    @property
    def fused(self):
        """The compiled layer call's library, or None: every stage runs per operation."""
        return self.plans.fused

    @fused.setter
    def fused(self, lib) -> None:  # a benchmark turns the call off and on
        self.plans.fused = lib

    @property
    def family(self):
        """The model family's math (a test may wrap it: the compute reads it from here)."""
        return self.compute.family

    @family.setter
    def family(self, value) -> None:
        self.compute.family = value

    @property
    def routing_counts(self) -> dict[tuple[int, int], int] | None:
        """(layer, expert) -> stages that read it, while a routing profile is recorded."""
        return self.reads.routing_counts

    @routing_counts.setter
    def routing_counts(self, value: dict[tuple[int, int], int] | None) -> None:
        self.reads.routing_counts = value

    def reset_counters(self) -> None:
        """Start a generation's own statistics (the host syncs are per block already)."""

    def any_rank(self, flag: bool, what: str) -> bool:
        """``flag`` on any rank of the run: this process is the only one."""
        return flag

    # ---- one block --------------------------------------------------------------------------
    def generate_block(self, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
                       sampler: Sampler, keep_logits: bool = False,
                       record: PromptRecorder | None = None, prefilled: Prefilled | None = None,
                       capture: Prefilled | None = None,
                       prefix: PrefixKV | None = None,
                       at_end: Callable[[], None] | None = None) -> Iterator[Step]:
        """Up to ``steps`` iterations for each GPU batch of (ids [b, P], valid [b, P]) pairs,
        one :class:`Step` at a time: the caller stops early by not asking for more.

        ``record``: run the prefill only, handing each layer's prompt q and k to it instead
        of keeping a cache (calibration). ``prefilled``: fill the caches from this kept
        prefill of the same prompts instead of running it; ``capture``: keep this block's
        prefill there. ``prefix``: the keys and values of the prompts' first columns, known
        already: the prefill computes the rest only. ``at_end``: called once the block's
        last step has been taken (every step run, or the caller stopped), while its caches
        still hold every column (:meth:`cached_kv`); not after an error."""
        if self.running:
            raise RuntimeError("a block is already running on this engine; finish or close "
                               "its generator first")
        self.running = True
        lanes = None
        self.block = Block()
        try:
            dev = self.tiers.device
            prompt_len = batches[0][0].shape[1]
            known = 0
            if prefix is not None and prefix.length:
                if record is not None or prefilled is not None or not 0 < prefix.length < \
                        prompt_len:
                    raise ValueError("a prefix leaves at least one prompt column to compute, "
                                     "and is not combined with a recorder or a kept prefill")
                self.block.prefix, known = prefix, prefix.length
            for ids, valid in batches:
                valid = valid.to(dev)
                positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
                self.block.states.append(self._prepare(BatchState(
                    ids[:, known:].to(dev), valid, positions[:, known:])))
            mode = BlockMode(record, prefilled, capture,
                             self._prefill_chunk(len(batches[0][0]), prompt_len))
            if record is None:
                self._make_caches(len(batches[0][0]), prompt_len + steps)
            else:
                steps = 1
            lanes = self._lanes = Lanes(dev, self.policy.overlap)
            self.debug["host_syncs_per_step"] = []
            yield from self._steps(steps, sampler, keep_logits, lanes, mode)
            if at_end is not None:
                at_end()
        except GeneratorExit:  # the caller stopped between steps: the block ended whole
            for cache in self.block.caches.values():
                cache.abort()
            if at_end is not None:
                at_end()
            raise
        except BaseException:  # an error or an interrupt
            for cache in self.block.caches.values():  # wake loads waiting for a speculation
                cache.abort()
            raise
        finally:
            if lanes is not None:
                lanes.close()
            self._lanes = None
            self.block = Block()
            self.plans.reset()
            self.running = False

    def _prefill_chunk(self, batch_size: int, prompt_len: int) -> int:
        from .memory_plan import prefill_chunk
        policy = dataclasses.replace(self.policy, gpu_batch_size=batch_size)
        return prefill_chunk(self.cfg, policy, self.dtype.itemsize, prompt_len)

    def _steps(self, steps: int, sampler: Sampler, keep_logits: bool, lanes: Lanes,
               mode: BlockMode) -> Iterator[Step]:
        """The block's iterations in one process: every GPU batch through every stage."""
        tokens = []
        everything = tuple(range(len(self.block.states)))
        for i in range(steps):
            start, before = time.perf_counter(), self.tiers.host_syncs
            decode = i > 0
            for batch in everything if decode else ():
                self._advance(batch, tokens[batch])
            if not decode and mode.prefilled is not None:
                logits = self._restore(mode.prefilled)
            else:
                self._iteration(Pass(decode, everything, mode), lanes)
                logits = [self._logits(batch) for batch in everything]
                if not decode and mode.capture is not None:
                    mode.capture.logits = [x.clone() for x in logits]
            tokens = [sampler(x, i, batch) for batch, x in enumerate(logits)]
            self.block.pending = tokens  # what the next step feeds (restart_row may change)
            self._end_step(before)
            yield Step(i, tokens, time.perf_counter() - start,
                       [x.float() for x in logits] if keep_logits else None)

    def _restore(self, prefilled: Prefilled) -> list[torch.Tensor]:
        """The prefill from a kept one: every cache stores its layer's prompt keys and values
        (no queries: a policy that needs them runs its own prefill); the first logits."""
        dev = self.tiers.device
        for (stage, batch), cache in self.block.caches.items():
            key, value = prefilled.take(self.stages[stage].layer, batch)
            cache.store_prompt(None, key.to(dev), value.to(dev), self.block.states[batch].valid)
        return list(prefilled.logits)

    def restart_row(self, batch: int, row: int, token: int) -> None:
        """Between two steps: a row starts over (:meth:`.block.Block.restart_row`)."""
        self.block.restart_row(batch, row, token)

    def takes_rows(self) -> bool:
        """Between two steps: a row can take a prompt prefilled alone
        (:func:`.join.takes_rows`), when the block's columns are enough."""
        return join.takes_rows(self)

    def can_join(self, prompt_len: int) -> bool:
        """Between two steps: a prompt this long can join by its own prefill
        (:func:`.join.can_join`)."""
        return join.can_join(self, prompt_len)

    def join_row(self, batch: int, row: int, ids: list[int],
                 choose: Callable[[torch.Tensor], int], prefix: PrefixKV | None = None) -> int:
        """Between two steps: a row takes a new prompt, prefilled alone, and its first token
        (:func:`.join.join_row`)."""
        return join.join_row(self, self._lanes, batch, row, ids, choose, prefix)

    def columns(self) -> int:
        """Columns the running block's caches hold (prompt width and steps fed since)."""
        return self.block.columns()

    def cached_kv(self, layer: int, batch: int, rows: list[int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """While a block runs: a layer's keys and values (:meth:`.block.Block.cached_kv`)."""
        return self.block.cached_kv(layer, batch, rows)

    def _logits(self, batch: int) -> torch.Tensor:
        return self.tiers.host_values(self.block.states[batch].logits)[0]

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
        p, cfg, block = self.policy, self.cfg, self.block
        block.caches.clear()
        block.attention_stage.clear()
        for stage, s in enumerate(self.stages):
            if s.kind not in ("attn", "layer"):
                continue
            for batch in range(len(block.states)):
                spec = CacheSpec(self.tiers, s.layer, batch, batch_size, max_len,
                                 cfg.num_kv_heads, cfg.head_dim, self.dtype, p.cache_split,
                                 p.compress_cache, p.cpu_cache_compute,
                                 cfg.window_of(s.layer), cfg.values_are_keys)
                if cfg.is_linear(s.layer):  # a row's state where its KV cache would be
                    cache = RecurrentState(spec, self.family.recurrent_state_shapes(cfg))
                else:
                    cache = self.kv_policy.make_cache(spec)
                block.caches[(stage, batch)] = cache
                block.attention_stage[s.layer] = stage

    def _advance(self, batch: int, new: torch.Tensor) -> None:
        """GPU batch ``batch`` takes its next token ``new`` [b] as input."""
        self.block.states[batch].advance(new, self.family, self.cfg, self.dtype)

    def _prepare(self, state: BatchState) -> BatchState:
        return state.prepare(self.family, self.cfg, self.dtype)

    # ---- the schedule -----------------------------------------------------------------------
    def _load_cache(self, p: Pass, stage: int, batch: int):
        cache = self.block.caches.get((stage, batch))
        if not p.decode or cache is None:
            return None
        return cache.load(self.block.states[batch].valid.shape[1] - 1)

    def _store_cache(self, p: Pass, stage: int, batch: int, new) -> None:
        """Keep ``new`` = (q, k, v, valid), the keys and values stage ``stage`` of ``batch``
        computed (or hand the prompt's to the recorder)."""
        if new is None:
            return
        q, key, value, valid = new
        mode = p.mode
        if mode.record is not None:
            mode.record(self.stages[stage].layer, q, key, valid)
        elif p.decode:
            self.block.caches[(stage, batch)].store_token(key, value, valid.shape[1] - 1)
        else:
            cache = self.block.caches[(stage, batch)]
            cache.store_prompt(q, key, value, valid)
            if mode.capture is not None:  # read back from the cache later, when it is exact
                mode.capture.keep(self.stages[stage].layer, batch, key, value,
                                  cache.prompt_reader(key.shape[1], key.shape[0]))

    def _compute(self, p: Pass, stage: int, batch: int, w: dict, loaded):
        return self.compute.run(self.block, p, stage, batch, w, loaded)

    def _iteration(self, p: Pass, lanes: Lanes) -> None:
        """Every stage for the pass's GPU batches (all of the block's, or one pipeline
        micro-batch): each stage's weights loaded once for them, in the zig-zag order."""
        batches = p.batches
        first, last = batches[0], batches[-1]
        if not self.policy.overlap:
            for stage in range(len(self.stages)):
                weights = self.reads.load(stage)
                for batch in batches:
                    new = self._compute(p, stage, batch, weights,
                                        self._load_cache(p, stage, batch))
                    self._store_cache(p, stage, batch, new)
            return
        steps = [(stage, batch) for stage in range(len(self.stages)) for batch in batches]
        weight_loads = {0: self._submit_weights(lanes, 0)}
        cache_load = self._submit_cache(lanes, "cache_load", self._load_cache, p, 0, first)
        previous = None  # ((stage, batch), new K/V) of the step before, stored meanwhile
        for n, (stage, batch) in enumerate(steps):
            if batch == first and stage + 1 < len(self.stages):
                weight_loads[stage + 1] = self._submit_weights(lanes, stage + 1)
            next_load = None
            if n + 1 < len(steps):
                next_load = self._submit_cache(lanes, "cache_load", self._load_cache, p,
                                               *steps[n + 1])
            if previous is not None:
                self._submit_cache(lanes, "cache_store", self._store_cache, p, *previous[0],
                                   previous[1])
            new = self._compute(p, stage, batch, lanes.result(weight_loads[stage]),
                                lanes.result(cache_load))
            lanes.sync()  # the cache lanes only: a weight load is waited for where it is used
            if batch == last:
                del weight_loads[stage]
            cache_load, previous = next_load, ((stage, batch), new)
        self._store_cache(p, *previous[0], previous[1])

    def _submit_weights(self, lanes: Lanes, stage: int):
        resident = all(self.weights[n].resident for n in self.stages[stage].weights.values())
        return lanes.submit("weights", self.reads.load, stage, inline=resident, track=False)

    def _submit_cache(self, lanes: Lanes, lane: str, fn, p: Pass, stage: int, batch: int,
                      *extra):
        cache = self.block.caches.get((stage, batch))
        return lanes.submit(lane, fn, p, stage, batch, *extra,
                            inline=cache is None or cache.inline)
