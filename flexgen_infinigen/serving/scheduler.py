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
from contextlib import closing

import torch

from ..cli import request_checks as checks
from ..engine import prefix_reuse
from ..engine.prefix_pages import PrefixPages
from ..sampling import Sampler, row_chooser
from .metrics import Metrics
from .requests import ServeRequest
from .rows import Row, RowChooser


# a block's free columns by default: room for a chat's next turn (the last answer and a new
# message) beyond the block's longest prompt
FREE_COLUMNS = 512


class QueueFull(Exception):
    """More requests are waiting than ``max_queue``."""


class Scheduler:
    def __init__(self, lm, max_wait_s: float, max_queue: int, metrics: Metrics | None = None,
                 prefix_pages: PrefixPages | None = None, admit_prompt_tokens: int = 1024,
                 context: int | None = None, block_answers: int = 2,
                 free_columns: int | None = None, alone_prompt_tokens: int = 128):
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
        instead of padded beside the others."""
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
        # free columns before the prompts, for a joiner's prompt longer than the block so
        # far: padding every row has, so the prefill skips them (zeros, never attended)
        free = self.free_columns if self.admit_prompt_tokens and self.pages_usable else 0
        # a long prompt is prefilled alone into its row at the first step (as a joiner),
        # not padded beside the others: no padding computed, and its first token comes
        # after its own prefill, not the whole block's
        alone = [len(r.ids) >= self.alone_prompt_tokens for r in block] \
            if self.prefills_alone and free else [False] * real
        # (its columns end at the block's last: the free columns hold the longest)
        free = max([free] + [len(r.ids) for r, a in zip(block, alone) if a])
        dummy = [self.lm.cfg.pad_token_id]
        ids = [dummy if a else r.ids for r, a in zip(block, alone)]
        ids += [ids[0]] * (size * count - real)  # equal GPU batches: dummy rows
        width = max(map(len, ids))
        longest = max(r.max_tokens for r in block)
        steps = longest if not self.admit_prompt_tokens else \
            max(longest, min(self.block_answers * longest,
                             self.context - max(len(r.ids) for r in block)))
        for r in block:
            r.start(lm.tokenizer)
        width += free
        rows = [Row(None) if a else Row(r, s, width - len(r.ids), list(r.ids))
                for r, s, a in zip(block, samplers, alone)]
        rows += [Row(None, None, width - len(ids[0]), []) for _ in range(len(ids) - real)]
        later = [(i, r, s) for i, (r, s, a) in enumerate(zip(block, samplers, alone)) if a]
        chooser = RowChooser(rows, size, lm.tokenizer)
        self.metrics.block_started(real, self.block_size)
        lm.engine.kv_policy.reset_stats()
        batches = lm._pad_batches(ids, size, width)
        prefix = self._prefix([r for r, a in zip(block, alone) if not a], ids, batches)
        at_end = (lambda: self._keep_pages(rows)) if self.pages is not None else None
        with closing(lm.engine.generate_block(batches, steps, chooser, prefix=prefix,
                                              at_end=at_end)) as block_steps:
            fed_next = None  # the tokens the step after this one feeds, by row
            for step in block_steps:
                if fed_next is not None:
                    for row, t in zip(rows, fed_next):
                        row.fed.append(t)
                tokens = torch.cat(step.tokens).tolist()
                self._deliver(rows, chooser, tokens)
                fed_next = tokens
                if later and not lm.engine.takes_rows():  # (known once caches exist)
                    self.prefills_alone = False  # this policy's rows: in the block's prefill
                    self._carried[:0] = [r for _, r, _ in later]  # first in the next block
                    later = []
                for i, r, s in later:  # the long prompts, each prefilled alone
                    self._join_by_prefill(i, r, s, chooser, fed_next, size, step.index)
                later = []
                if self.admit_prompt_tokens:
                    self._join(rows, chooser, fed_next, steps - step.index - 1, size,
                               step.index)
                self.metrics.running_rows = sum(not r.idle for r in rows)
                if all(r.idle for r in rows) and lm.engine.stops_early:
                    break
        for i, row in enumerate(rows):  # the longest answer may end the block first
            r = row.request
            if r is None or r.finished:
                continue
            if i in chooser.failed:
                r.fail(chooser.failed[i])
                self.metrics.count("row_errors")
            else:
                r.finish("length")
                self.metrics.count("requests_finished")
        self.metrics.block_ended()

    def _deliver(self, rows: list[Row], chooser: RowChooser, tokens: list[int]) -> None:
        """Each row's token to its request (not a prompt token a joining row fed)."""
        for i, row in enumerate(rows):
            if not row.idle and i not in chooser.feeding:
                self._deliver_row(i, row, chooser, tokens[i])

    def _deliver_row(self, i: int, row: Row, chooser: RowChooser, token: int) -> None:
        """Row ``i``'s token to its request: it fails alone if its choice or its text did."""
        request = row.request
        if i in chooser.failed:
            request.fail(chooser.failed[i])
            self.metrics.count("row_errors")
            return
        if request.cancelled.is_set():
            request.drop()
            self.metrics.count("requests_cancelled")
            return
        try:
            made = request.take(token, self.lm.stop_token_ids, chooser.logprobs[i])
        except Exception as e:  # noqa: BLE001 - e.g. its text cannot be decoded
            request.fail(f"this request's answer failed: {type(e).__name__}: {e}")
            self.metrics.count("row_errors")
            return
        self.metrics.count("generation_tokens", made)
        if request.finished:
            self.metrics.count("requests_finished")
            if self.pages is not None:  # found by the chat's next turn, even mid-block
                self._keep_pages([r if j == i else Row(None)
                                  for j, r in enumerate(chooser.rows)])

    def _join(self, rows: list[Row], chooser: RowChooser, fed_next: list[int], left: int,
              size: int, step: int) -> None:
        """Waiting requests into the rows that have ended, in arrival order, while the head
        of the queue can join: its prompt at most ``admit_prompt_tokens``, and its answer
        within the ``left`` steps the block has after this one. A joiner's prompt is
        prefilled alone into its row (it answers as alone, and its first token goes out
        now); where the caches cannot take a row's columns, it is fed a token a step (its
        prompt then counts in ``left`` too). A head that must wait for the block's columns
        to grow stays at the head. ``fed_next``: the next step's input by row."""
        engine = self.lm.engine
        for index in range(len(rows)):
            while rows[index].idle:
                try:
                    request = self._next(0)
                except queue.Empty:
                    return
                if request is None:  # stopping: seen again by _gather
                    self._pending.put(None)
                    return
                if request.cancelled.is_set():
                    request.drop()
                    self.metrics.count("requests_cancelled")
                    continue
                n = len(request.ids)
                by_prefill = engine.can_join(n)
                by_feeding = (not by_prefill and self.feeds_prompts and not engine.takes_rows()
                              and n + request.max_tokens <= left)
                if n > self.admit_prompt_tokens or request.max_tokens - 1 > left or \
                        not (by_prefill or by_feeding):
                    self._carried.insert(0, request)  # first in line at the next step
                    return
                admitted, samplers = self._admit([request])
                if not admitted:
                    continue
                if self.pages is not None:  # the row's last answer, before it is hidden
                    self._keep_pages([r if i == index else Row(None)
                                      for i, r in enumerate(rows)])
                request.start(self.lm.tokenizer)
                self._in_block.append(request)
                if by_prefill:
                    self._join_by_prefill(index, request, samplers[0], chooser, fed_next,
                                          size, step)
                    self.metrics.count("requests_joined_prefilled")
                else:
                    engine.restart_row(index // size, index % size, request.ids[0])
                    fed_next[index] = request.ids[0]
                    chooser.replace(index, Row(request, samplers[0], engine.columns(), [],
                                               list(request.ids[1:])))
                self.metrics.count("requests_joined")

    def _join_by_prefill(self, index: int, request: ServeRequest, sampler, chooser: RowChooser,
                         fed_next: list[int], size: int, step: int) -> None:
        """Row ``index`` takes ``request``: its prompt prefilled alone into the row (from
        the prefix pages where they hold its start), its first token chosen and delivered."""
        engine, ids = self.lm.engine, request.ids
        prefix = None
        if self.pages is not None:
            one = [(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))]
            prefix = prefix_reuse.block_prefix(self.pages, engine, [ids], one)
            request.cached_tokens = prefix.length if prefix else 0
            self.metrics.count("prefix_cache_hits", request.cached_tokens)
            self.metrics.count("prefix_cache_queries", len(ids))
        new = Row(request, sampler, engine.columns() - len(ids), list(ids), [])
        chooser.replace(index, new)
        token = engine.join_row(index // size, index % size, ids,
                                lambda logits: chooser.choose(index, logits.float().cpu(),
                                                              step),
                                prefix)
        fed_next[index] = token
        self.metrics.count("requests_prefilled_alone")
        self._deliver_row(index, new, chooser, token)

    def _prefix(self, block: list[ServeRequest], ids: list[list[int]], batches):
        """The block's known first columns from the prefix pages and its free columns (None:
        none), each request's cached prompt tokens noted and counted."""
        if not self.pages_usable:
            return None
        prefix = prefix_reuse.block_prefix(self.pages, self.lm.engine, ids, batches)
        if self.pages is None:
            return prefix
        width = batches[0][0].shape[1]
        for r in block:
            r.cached_tokens = max(0, prefix.length - (width - len(r.ids))) if prefix else 0
            self.metrics.count("prefix_cache_hits", r.cached_tokens)
            self.metrics.count("prefix_cache_queries", len(r.ids))
        return prefix

    def _keep_pages(self, rows: list[Row]) -> None:
        """Every row's prompt and the answer tokens fed back so far kept as pages (while the
        block's caches still hold them); a free or dropped row keeps nothing."""
        try:
            prefix_reuse.keep_rows(self.pages, self.lm.engine,
                                   [(row.first_column, row.sequence()) for row in rows])
        except Exception:  # noqa: BLE001 - a cache that cannot be read back keeps nothing
            self.metrics.count("prefix_cache_errors")
