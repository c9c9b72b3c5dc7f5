"""One pipeline rank's engine: the same zig-zag schedule over its own layers, with the GPU
batches of a block as the pipeline's micro-batches.

For each iteration (the prefill, then one token per decode step) and each micro-batch m,
a rank takes m's input (the first rank: the token the last rank sampled for m, then the
embedding; the others: the hidden state from the previous rank), runs every one of its
stages for m (:meth:`~..engine.Engine._iteration`, with its overlapped loads and
stores), and hands the result on (the last rank: samples m's token and sends it to the
first). With at least as many micro-batches as ranks every rank is busy once the pipeline
has filled: while rank 1 works on micro-batch 0, rank 0 works on micro-batch 1.

InfiniGen in every stage: a layer's speculation uses the previous layer's attention
input. For a rank's first layer that input is computed on the previous rank, which sends
it beside the hidden state (``[b, 1, hidden]`` per decode step), so every layer selects
exactly as in one process.

The first rank learns the tokens of iteration i while it runs iteration i + 1, so it
yields a step when the last micro-batch's token arrives; middle ranks never see tokens
(their steps carry zeros) and every rank runs all steps (no early stop).
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from ..engine.block import BlockMode, Pass
from ..engine.schedule import Engine, Step
from ..memory.lanes import Lanes
from ..memory.split_tensor import SplitTensor
from ..sampling import Sampler


class PipelineEngine(Engine):
    stops_early = False  # every rank must run the same steps
    reuses_prefill = False

    def __init__(self, cfg, weights, policy, tiers, kv_policy, dtype, part, link):
        super().__init__(cfg, weights, policy, tiers, kv_policy, dtype, part)
        self.link = link
        self.micro_batches = None  # GPU batches per micro-batch: None, one each
        self.debug["pipeline_wait_s"] = 0.0

    def reset_counters(self) -> None:
        self.debug["pipeline_wait_s"] = 0.0  # seconds spent waiting for other ranks
        self.link.reset_counters()  # a generation's traffic, not the calibration's

    def any_rank(self, flag: bool, what: str) -> bool:
        return self.link.any(flag, what)

    def takes_rows(self) -> bool:
        return False  # a joiner's prefill alone would have to run on every rank

    def can_join(self, prompt_len: int) -> bool:
        return False

    def _steps(self, steps: int, sampler: Sampler, keep_logits: bool, lanes: Lanes,
               mode: BlockMode) -> Iterator[Step]:
        link = self.link
        groups = micro_batches(len(self.states), self.micro_batches)
        self._known: dict[int, dict[int, tuple]] = {}  # step -> GPU batch -> (tokens, logits)
        self._sampled: dict[int, torch.Tensor] = {}  # the last rank: each batch's last token
        self._last_yield = time.perf_counter()
        for i in range(steps):
            decode, before = i > 0, self.tiers.host_syncs
            for g, group in enumerate(groups):
                for m in group:
                    if decode:
                        self._advance(m, self._input_token(i - 1, m, keep_logits))
                    if not link.is_first:
                        self._receive(decode, m, mode)
                if decode and link.is_first and g == len(groups) - 1:
                    yield self._step(i - 1, keep_logits)  # its last token has just arrived
                self._iteration(Pass(decode, tuple(group), mode), lanes)
                for m in group:
                    if link.is_last:
                        self._sample(i, m, sampler, keep_logits)
                    else:
                        self._pass_on(decode, m, mode)
            self._end_step(before)
            if not link.is_first:
                yield self._step(i, keep_logits)
        if link.is_first:
            yield self._step(steps - 1, keep_logits)
        link.flush()

    # ---- what crosses between ranks ---------------------------------------------------------
    def _input_token(self, i: int, m: int, keep_logits: bool) -> torch.Tensor:
        """GPU batch ``m``'s token of iteration ``i``, its next input: received (first
        rank), sampled here (last rank), or a placeholder (a middle rank, which embeds
        nothing and only needs its shape)."""
        if self.link.is_first:
            return self._receive_token(i, m, keep_logits)
        if self.link.is_last:
            return self._sampled[m]
        return torch.zeros(self.states[m].ids.shape[0], dtype=torch.long)

    def _receive_token(self, i: int, m: int, keep_logits: bool) -> torch.Tensor:
        """The first rank: the last rank's token (and logits) of batch ``m``, iteration
        ``i``, received once (tokens and logits come over the gloo group, never NCCL: rank 0
        wants them on the host, and the return path must not queue behind hidden states)."""
        known = self._known.setdefault(i, {})
        if m not in known:
            link, b, last = self.link, self.states[m].ids.shape[0], self.link.world - 1
            tokens = self._wait(link.recv, (b,), torch.long, last, "tokens", True)
            logits = self._wait(link.recv, (b, self.cfg.vocab_size), torch.float32, last,
                                "logits", True) if keep_logits else None
            known[m] = (tokens, logits)
        return known[m][0]

    def _sample(self, i: int, m: int, sampler: Sampler, keep_logits: bool) -> None:
        logits = self._logits(m)
        tokens = sampler(logits, i, m)
        kept = logits.float() if keep_logits else None
        self._known.setdefault(i, {})[m] = (tokens, kept)
        self._sampled[m] = tokens
        self.link.send(tokens, 0, "tokens", True)
        if keep_logits:
            self.link.send(kept, 0, "logits", True)

    def _receive(self, decode: bool, m: int, mode: BlockMode) -> None:
        state, link = self.states[m], self.link
        b, s = state.ids.shape
        state.hidden = self._wait(link.recv, (b, s, self.cfg.hidden_size), self.dtype,
                                  link.previous, "hidden")
        if decode and self.kv_policy.speculates and mode.record is None:
            x = self._wait(link.recv, (b, 1, self.cfg.hidden_size), self.dtype,
                           link.previous, "speculation_input")
            first = self.attention_stage[self.part.start]
            pos_enc, _, seen = state.attention_inputs(self.cfg.window_of(self.part.start))
            self.caches[(first, m)].speculate(x, pos_enc, state.valid, seen)

    def _pass_on(self, decode: bool, m: int, mode: BlockMode) -> None:
        state, link = self.states[m], self.link
        h = state.hidden
        if isinstance(h, SplitTensor):  # its buffer is reused: send a copy
            h = h.read().clone()
        link.send(h, link.next, "hidden")
        if decode and self.kv_policy.speculates and mode.record is None:
            link.send(state.handoff, link.next, "speculation_input")
        state.handoff = None

    def _wait(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.debug["pipeline_wait_s"] += time.perf_counter() - start
        return out

    def _step(self, i: int, keep_logits: bool) -> Step:
        """Iteration ``i``'s step: every batch's token (placeholders on a middle rank)."""
        order = range(len(self.states))
        if self.link.is_first:
            for m in order:
                self._receive_token(i, m, keep_logits)
        known = self._known.pop(i, {})
        vocab = self.cfg.vocab_size
        rows = [known.get(m) or (torch.zeros(self.states[m].ids.shape[0], dtype=torch.long),
                                 torch.zeros(self.states[m].ids.shape[0], vocab)
                                 if keep_logits else None) for m in order]
        now = time.perf_counter()
        seconds, self._last_yield = now - self._last_yield, now
        return Step(i, [r[0] for r in rows], seconds,
                    [r[1] for r in rows] if keep_logits else None)


def micro_batches(num_gpu_batches: int, count: int | None) -> list[list[int]]:
    """The block's GPU batches cut into ``count`` contiguous micro-batches (default: one GPU
    batch each). A micro-batch's GPU batches share each weight load, as in one process."""
    count = num_gpu_batches if count is None else min(count, num_gpu_batches)
    bounds = [round(g * num_gpu_batches / count) for g in range(count + 1)]
    return [list(range(bounds[g], bounds[g + 1])) for g in range(count)]


def rank_engine(link):
    """``OffloadedLM.load(make_engine=...)`` for one pipeline rank talking over ``link``."""
    def make(cfg, weights, policy, tiers, kv_policy, dtype, part):
        return PipelineEngine(cfg, weights, policy, tiers, kv_policy, dtype, part, link)
    return make
