"""The engine thread: the one thread that runs the model. It gathers waiting requests into a
block of the policy's ``gpu_batch_size x num_gpu_batches`` rows (the unit the zig-zag
schedule loads each layer's weights once for), runs the block one step at a time, and hands
each row's token to its request at every step.

- A block starts when it is full, or ``max_wait_s`` after its first request came: the wait
  trades first-token latency for fuller blocks. A short block takes as few GPU batches as
  hold its rows (as :meth:`~..api.OffloadedLM.generate` does).
- Requests also join a running block: when a row has ended, the next waiting request
  takes it between two steps (:mod:`..engine.join`): its prompt is prefilled alone into the
  row, its first token goes out at once, and it decodes with the others from the next step
  (each layer's weights read once for all of them), answering what it answers alone. Where
  the caches cannot take a row's columns, its prompt goes in one token a step instead
  (:meth:`~..engine.schedule.Engine.restart_row`). A request joins when its answer fits the
  steps the block has left and its prompt is at most ``admit_prompt_tokens``; a block is
  given twice its longest answer in steps, so that there is room to join.
- Sampling is per row: each row has its own settings (temperature, top-k, top-p, min-p,
  penalties, logit bias; :mod:`..sampling`), stop ids and random generator (seeded by its
  request), so an answer does not depend on the other rows of its block: a greedy row that
  moves no logits is the plain argmax whatever its neighbours ask.
- With prefix pages (:mod:`..engine.prefix_pages`, ``--prefix-cache-gb``), a block's
  prefill skips the columns every row's cached prefix covers, and when the block ends each
  row's prompt and answer are kept as pages: the next turn of a chat prefills its new
  tokens, not its history. Rows that share a block share the skipped width (the shortest
  cover, counted from each row's left padding).
- A request whose client has gone is skipped in the queue, and dropped from its block at the
  next step; the block stops as soon as no row is left.
- A row fails alone: a prompt id outside the vocabulary or a sampler that cannot be made
  fails its request before the block runs; a row whose choice (or its text) raises during
  the block fails its request and the others go on with the tokens they would have had
  (:class:`~.rows.RowChooser`). Only an error of the block's shared work fails every row.
"""
from __future__ import annotations

import math
import queue
import threading
import time

from ..engine import prefix_reuse
from ..engine.prefix_pages import PrefixPages
from .block_run import BlockRun
from .metrics import Metrics
from .requests import ServeRequest


# a block's free columns by default: room for a chat's next turn (the last answer and a new
# message) beyond the block's longest prompt
FREE_COLUMNS = 512


class QueueFull(Exception):
    """More requests are waiting than ``max_queue``."""


class Scheduler(BlockRun):
    def __init__(self, lm, max_wait_s: float, max_queue: int, metrics: Metrics | None = None,
                 prefix_pages: PrefixPages | None = None, admit_prompt_tokens: int = 1024,
                 context: int | None = None, block_answers: int = 2,
                 free_columns: int | None = None, alone_prompt_tokens: int = 128,
                 spare_rows: int = 1):
        """``admit_prompt_tokens``: the longest prompt that joins a running block (0: none
        joins; requests wait for the next block). ``context``: the tokens a prompt and its
        answer may fill (``--max-model-len``; default the model's). ``block_answers``: a
        block (its caches) holds this many times its longest answer in steps, within the
        context, so that ended rows can be taken (their columns are not reused).
        ``free_columns``: a block starts with this many columns of padding before its
        prompts (default ``FREE_COLUMNS``, at most ``admit_prompt_tokens``), which its
        prefill skips, so that a joiner whose prompt is longer than the block so far (a
        chat's next turn) fits in a row at once; each costs every row a column of cache.
        ``alone_prompt_tokens``: a block's prompt at least this long is prefilled alone into
        its row at the first step, where weights are read in place (a CPU's memory),
        instead of padded beside the others. ``spare_rows``: a block that is not full starts
        with this many free rows more than its requests (within the policy's block size), so
        that a request that comes while it runs joins at once; each costs every decode step
        a row's compute."""
        self.lm, self.max_wait_s, self.max_queue = lm, max_wait_s, max_queue
        self.block_answers = block_answers
        self.context = min(context or lm.cfg.max_positions, lm.cfg.max_positions)
        # a running block takes new rows where one process runs every layer (a joiner's
        # prompt is prefilled alone into its row, or, where the caches cannot take a row's
        # columns, fed a token a step: not for a policy that reads the prompt's queries);
        # prefills start from pages where the policy's caches allow it; else requests
        # join at block boundaries and prefill everything
        usable = prefix_reuse.usable(lm.engine)
        self.admit_prompt_tokens = admit_prompt_tokens if prefix_reuse.whole(lm.engine) else 0
        self.feeds_prompts = self.pages_usable = usable
        self.pages = prefix_pages if usable else None
        self.free_columns = min(admit_prompt_tokens, FREE_COLUMNS) if free_columns is None \
            else free_columns
        # a prompt prefilled alone reads every weight again: cheap where a CPU computes on
        # weights in its own memory, not where they cross a link or come from disk
        self.prefills_alone = not lm.tiers.is_cuda and all(
            seg.tier != "disk" for t in lm.engine.weights.values() for seg in t.segments)
        self.alone_prompt_tokens = alone_prompt_tokens
        self.spare_rows = spare_rows
        self.joins: bool | None = None  # whether a request can join a block (its first tells)
        self.block_size = lm.policy.block_size
        self.metrics = metrics or Metrics()
        self._pending: queue.Queue = queue.Queue()
        self._carried: list[ServeRequest] = []  # taken from the queue, for the next block
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stopping = False
        self.last_block_s = 1.0  # how long the last block ran (Retry-After's estimate)
        self._in_block: list[ServeRequest] = []  # the running block's requests, joiners too

    # ---- event loop side ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, request: ServeRequest) -> None:
        if self._stopping:
            raise QueueFull("the server is shutting down")
        if self.queue_depth() >= self.max_queue:
            raise QueueFull(f"{self.queue_depth()} requests are waiting (--max-queue "
                            f"{self.max_queue}); try again later")
        request.metrics = self.metrics
        request.arrived = time.monotonic()
        self._pending.put(request)

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: the last block's length, 1 to 60."""
        return max(1, min(60, math.ceil(self.last_block_s)))

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
            started = time.monotonic()
            self._in_block = list(block)  # and every request that joins it
            try:
                self._run_block(block)
            except Exception as e:  # noqa: BLE001 - the block's clients get a 500; we go on
                for r in self._in_block:
                    r.fail(f"the engine failed on this block: {type(e).__name__}: {e}")
                self.metrics.count("engine_errors")
            self.last_block_s = time.monotonic() - started

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
        kept, context = [], self.context
        for r in block:
            if kept and max(len(k.ids) for k in kept + [r]) + \
                    max(k.max_tokens for k in kept + [r]) > context:
                self._carried.append(r)
            else:
                kept.append(r)
        return kept
