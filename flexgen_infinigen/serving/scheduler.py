"""The engine thread: the one thread that runs the model. It gathers waiting requests into a
block of the policy's ``gpu_batch_size x num_gpu_batches`` rows (the unit the zig-zag
schedule loads each layer's weights once for), runs the block one step at a time, and hands
each row's token to its request at every step.

- A block starts when it is full, or ``max_wait_s`` after its first request came: the wait
  trades first-token latency for fuller blocks. A short block takes as few GPU batches as
  hold its rows (as :meth:`~..api.OffloadedLM.generate` does).
- Requests join at block boundaries only. A row that finishes early stays empty until the
  block ends: its KV cache and positions belong to the block's prompt, and taking a new
  prompt in would need a prefill of its own, outside the step every row shares.
- Sampling is per row: each row has its own settings (temperature, top-k, top-p, min-p,
  penalties, logit bias; :mod:`..sampling`), stop ids and random generator (seeded by its
  request), so an answer does not depend on the other rows of its block: a greedy row that
  moves no logits is the plain argmax whatever its neighbours ask.
- A request whose client has gone is skipped in the queue, and dropped from its block at the
  next step; the block stops as soon as no row is left.
- A row fails alone: a prompt id outside the vocabulary or a sampler that cannot be made
  fails its request before the block runs; a row whose choice (or its text) raises during
  the block fails its request and the others go on with the tokens they would have had
  (:class:`RowChooser`). Only an error of the block's shared work fails every row.
"""
from __future__ import annotations

import queue
import threading
import time
from contextlib import closing

import torch

from ..cli import request_checks as checks
from ..sampling import Sampler, row_chooser
from .metrics import Metrics
from .requests import ServeRequest


class QueueFull(Exception):
    """More requests are waiting than ``max_queue``."""


class RowChooser:
    """The engine's sampler for one block: every row chooses with its own request's settings,
    and the log-probabilities each row asked for are kept for the step.

    A row whose choice raises fails alone: it takes the argmax (so the step's shapes stay
    whole) and is listed in :attr:`failed`; the scheduler ends its request with the error and
    the block goes on. The other rows' choices never read it, so they are the tokens they
    would have been without it."""

    def __init__(self, requests: list[ServeRequest], batch_size: int, tokenizer,
                 samplers: list[Sampler] | None = None):
        self.requests, self.batch_size, self.tokenizer = requests, batch_size, tokenizer
        self.samplers = samplers if samplers is not None else \
            [row_chooser(r.sampling, r.ids) for r in requests]
        self.logprobs: list[dict | None] = [None] * len(requests)
        self.failed: dict[int, str] = {}  # row -> why its choice failed (not yet reported)

    def __call__(self, logits: torch.Tensor, step: int = 0, batch: int = 0) -> torch.Tensor:
        logits = logits.float().cpu()
        tokens = logits.argmax(-1)
        first = batch * self.batch_size
        for r in range(logits.shape[0]):
            row = first + r
            if row >= len(self.requests) or self.requests[row].finished or row in self.failed:
                continue  # a padding row, or one that has ended: its token is never read
            request = self.requests[row]
            try:
                if request.sampling.temperature > 0 or request.sampling.moves_logits:
                    # the row's own chooser, on its row alone (its history is its own)
                    tokens[r] = self.samplers[row](logits[r:r + 1], step, 0)[0]
                if request.top_logprobs is not None:
                    self.logprobs[row] = self._logprobs(logits[r], int(tokens[r]),
                                                        request.top_logprobs)
            except Exception as e:  # noqa: BLE001 - this row's request fails, not the block
                tokens[r] = logits[r].argmax()
                self.failed[row] = f"choosing this request's token failed: " \
                                   f"{type(e).__name__}: {e}"
        return tokens

    def _logprobs(self, logits: torch.Tensor, token: int, top: int) -> dict:
        """The model's own log-probabilities (before temperature and top-p)."""
        lp = torch.log_softmax(logits, -1)
        best = lp.topk(top) if top else None
        pairs = [] if best is None else list(zip(best.indices.tolist(), best.values.tolist()))
        return {"token": self.tokenizer.decode([token]), "logprob": float(lp[token]),
                "top": [(self.tokenizer.decode([i]), v) for i, v in pairs]}


class Scheduler:
    def __init__(self, lm, max_wait_s: float, max_queue: int, metrics: Metrics | None = None):
        self.lm, self.max_wait_s, self.max_queue = lm, max_wait_s, max_queue
        self.block_size = lm.policy.block_size
        self.metrics = metrics or Metrics()
        self._pending: queue.Queue = queue.Queue()
        self._carried: list[ServeRequest] = []  # taken from the queue, for the next block
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stopping = False

    # ---- event loop side ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: ServeRequest) -> None:
        if self._stopping:
            raise QueueFull("the server is shutting down")
        if self.queue_depth() >= self.max_queue:
            raise QueueFull(f"{self.queue_depth()} requests are waiting (--max-queue "
                            f"{self.max_queue}); try again later")
        self._pending.put(request)

    def queue_depth(self) -> int:
        return self._pending.qsize() + len(self._carried)

    def stop(self, timeout: float | None = None) -> None:
        """Finish every request already queued, then end the thread."""
        self._stopping = True
        self._pending.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        while (block := self._gather()) is not None:
            if not block:
                continue
            try:
                self._run_block(block)
            except Exception as e:  # noqa: BLE001 - the block's clients get a 500; we go on
                for r in block:
                    r.fail(f"the engine failed on this block: {type(e).__name__}: {e}")
                self.metrics.count("engine_errors")

    def _next(self, timeout: float | None):
        """The next waiting request (or the stop mark); raises queue.Empty on a timeout."""
        if self._carried:
            return self._carried.pop(0)
        if timeout is not None and timeout <= 0:
            return self._pending.get_nowait()
        return self._pending.get(timeout=timeout)

    def _gather(self) -> list[ServeRequest] | None:
        """The next block's requests (empty: all had gone), or None once stopped."""
        first = self._next(None)
        if first is None:
            return None
        block, deadline = [first], time.monotonic() + self.max_wait_s
        while len(block) < self.block_size:
            try:
                r = self._next(deadline - time.monotonic())
            except queue.Empty:
                break
            if r is None:
                self._pending.put(None)  # seen again once this block has run
                break
            block.append(r)
        for r in block:
            if r.cancelled.is_set():
                r.drop()
                self.metrics.count("requests_cancelled")
        block = [r for r in block if not r.finished]
        # every row's prompt is padded to the longest, and every row runs as many steps as
        # the longest answer: what does not fit the context with the others waits
        kept, context = [], self.lm.cfg.max_positions
        for r in block:
            if kept and max(len(k.ids) for k in kept + [r]) + \
                    max(k.max_tokens for k in kept + [r]) > context:
                self._carried.append(r)
            else:
                kept.append(r)
        return kept

    def _admit(self, block: list[ServeRequest]) -> tuple[list[ServeRequest], list[Sampler]]:
        """The rows that can run and their samplers. A row whose prompt holds an id outside
        the vocabulary, or whose sampler cannot be made, fails alone before the block runs
        (parsing refuses both; this keeps a request made another way from failing the
        others' block)."""
        rows, samplers = [], []
        for r in block:
            try:
                if not r.ids:
                    raise checks.Refused("the prompt is empty", "prompt")
                checks.token_ids(r.ids, self.lm.cfg.vocab_size, "prompt")
            except checks.Refused as e:
                r.fail(str(e), 400, e.param)
                self.metrics.count("row_errors")
                continue
            try:
                samplers.append(row_chooser(r.sampling, r.ids))
            except Exception as e:  # noqa: BLE001 - e.g. a seed the generator cannot take
                r.fail(f"this request's sampler cannot be made: {type(e).__name__}: {e}")
                self.metrics.count("row_errors")
                continue
            rows.append(r)
        return rows, samplers

    def _run_block(self, block: list[ServeRequest]) -> None:
        block, samplers = self._admit(block)
        if not block:
            return
        lm, real = self.lm, len(block)
        size, count = lm._block_shape(real)
        ids = [r.ids for r in block]
        ids += [ids[0]] * (size * count - real)  # equal GPU batches: dummy rows
        steps = max(r.max_tokens for r in block)
        for r in block:
            r.start(lm.tokenizer)
        chooser = RowChooser(block, size, lm.tokenizer, samplers)
        stop_ids = lm.stop_token_ids
        self.metrics.block_started(real, self.block_size)
        lm.engine.kv_policy.reset_stats()
        with closing(lm.engine.generate_block(lm._pad_batches(ids, size), steps,
                                              chooser)) as block_steps:
            for step in block_steps:
                tokens = torch.cat(step.tokens).tolist()
                for r, request in enumerate(block):
                    if request.finished:
                        continue
                    if r in chooser.failed:
                        request.fail(chooser.failed[r])
                        self.metrics.count("row_errors")
                        continue
                    if request.cancelled.is_set():
                        request.drop()
                        self.metrics.count("requests_cancelled")
                        continue
                    try:
                        made = request.take(tokens[r], stop_ids, chooser.logprobs[r])
                    except Exception as e:  # noqa: BLE001 - e.g. its text cannot be decoded
                        request.fail(f"this request's answer failed: {type(e).__name__}: {e}")
                        self.metrics.count("row_errors")
                        continue
                    self.metrics.count("generation_tokens", made)
                    if request.finished:
                        self.metrics.count("requests_finished")
                if all(r.finished for r in block) and lm.engine.stops_early:
                    break
        for i, r in enumerate(block):  # the longest answer may end the block first
            if not r.finished and i in chooser.failed:
                r.fail(chooser.failed[i])
                self.metrics.count("row_errors")
            elif not r.finished:
                r.finish("length")
                self.metrics.count("requests_finished")
        self.metrics.block_ended()
