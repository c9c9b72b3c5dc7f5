"""The engine thread's work on one block (:class:`BlockRun`, the half of
:class:`~.scheduler.Scheduler` that runs what the queue side gathered): its rows and their
samplers, its steps, each row's token to its request, requests that take ended rows
(:mod:`..engine.join`), and the prefix pages it starts from and keeps.

A block's rows: one a request, the rest free. Its prompts are left-padded to one width
behind the block's free columns (padding every row has, skipped by the prefill); a long
prompt, where weights are read in place, takes its row at the first step by its own
prefill instead. A row whose request ends is taken by the next waiting one.
"""
from __future__ import annotations

import queue
from contextlib import closing

import torch

from ..cli import request_checks as checks
from ..engine import prefix_reuse
from ..sampling import Sampler, row_chooser
from .requests import ServeRequest
from .rows import Row, RowChooser


class BlockRun:
    """What the scheduler does with a block, given its settings and queue (set by
    :class:`~.scheduler.Scheduler`: ``lm``, ``metrics``, ``pages``, ``pages_usable``,
    ``feeds_prompts``, ``admit_prompt_tokens``, ``free_columns``, ``prefills_alone``,
    ``alone_prompt_tokens``, ``spare_rows``, ``joins``, ``block_answers``, ``block_size``,
    ``context``, ``_carried``, ``_pending``, ``_in_block`` and ``_next``)."""

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
        # spare rows: free from the start, for a request that comes while this one runs
        spare = self.spare_rows if self.admit_prompt_tokens and self.joins is not False else 0
        size, count = lm._block_shape(min(real + spare, max(real, self.block_size)))
        # free columns before the prompts, for a joiner's prompt longer than the block so
        # far: padding every row has, so the prefill skips them (zeros, never attended)
        free = self.free_columns if self.admit_prompt_tokens and self.pages_usable else 0
        # a long prompt is prefilled alone into its row at the first step (as a joiner),
        # not padded beside the others: no padding computed, and its first token comes
        # after its own prefill, not the whole block's
        # so is every prompt of a block whose padded prefill would be mostly padding (a lone
        # request beside its spare row): each prompt's own prefill computes its tokens only
        padded = size * count * max(len(r.ids) for r in block)
        mostly_padding = padded >= 2 * sum(len(r.ids) for r in block)
        alone = [(mostly_padding or len(r.ids) >= self.alone_prompt_tokens) and r.echo is None
                 for r in block] if self.prefills_alone and free else [False] * real
        # (its columns end at the block's last: the free columns hold the longest)
        free = max([free] + [len(r.ids) for r, a in zip(block, alone) if a])
        dummy = [self.lm.cfg.pad_token_id]  # a free row's one token (padding costs the same)
        # an echo row puts its first token in with the prefill and feeds the rest a token
        # a step: each step's logits score the next prompt token (a prefill keeps only the
        # last position's)
        ids = [dummy if a else r.ids[:1] if r.echo is not None else r.ids
               for r, a in zip(block, alone)]
        ids += [dummy] * (size * count - real)  # spare rows, and equal GPU batches
        width = max(map(len, ids))
        longest = max(r.max_tokens + (len(r.ids) - 1 if r.echo is not None else 0)
                      for r in block)
        steps = longest if not self.admit_prompt_tokens else \
            max(longest, min(self.block_answers * longest,
                             self.context - max(len(r.ids) for r in block)))
        for r in block:
            r.start(lm.tokenizer)
        width += free
        rows = [Row(None) if a else
                Row(r, s, width - 1, r.ids[:1], list(r.ids[1:])) if r.echo is not None else
                Row(r, s, width - len(r.ids), list(r.ids))
                for r, s, a in zip(block, samplers, alone)]
        rows += [Row(None, None, width - 1, []) for _ in range(len(ids) - real)]
        later = [(i, r, s) for i, (r, s, a) in enumerate(zip(block, samplers, alone)) if a]
        chooser = RowChooser(rows, size, lm.tokenizer)
        self.metrics.block_started(real, self.block_size)
        lm.engine.kv_policy.reset_stats()
        batches = lm._pad_batches(ids, size, width)
        prefix = self._prefix([r for r, a in zip(block, alone) if not a], ids, batches)
        # at the block's end, the rows still answering (an ended one kept its pages then)
        at_end = (lambda: self._keep_pages([r if r.request is not None and not r.request.finished
                                            else Row(None) for r in rows])) \
            if self.pages is not None else None
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
                if self.joins is None:  # known once caches exist: can a request join?
                    self.joins = lm.engine.takes_rows() or self.feeds_prompts
                if later and not lm.engine.takes_rows():
                    self.prefills_alone = False  # this policy's rows: in the block's prefill
                    moved = [r for _, r, _ in later]
                    self._carried[:0] = moved  # first in the next block, not this one's
                    self._in_block = [r for r in self._in_block if r not in moved]
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
                # an echo row's logits score its prompt: it feeds it, from a block's start
                by_prefill = engine.can_join(n) and request.echo is None
                by_feeding = (not by_prefill and self.feeds_prompts and not engine.takes_rows()
                              and n + request.max_tokens <= left)
                if n > self.admit_prompt_tokens or request.max_tokens - 1 > left or \
                        not (by_prefill or by_feeding):
                    self._carried.insert(0, request)  # first in line at the next step
                    return
                admitted, samplers = self._admit([request])
                if not admitted:
                    continue
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
        try:
            token = engine.join_row(index // size, index % size, ids,
                                    lambda logits: chooser.choose(index, logits.float().cpu(),
                                                                  step),
                                    prefix)
        except BaseException:  # the row holds none of it: nothing of it is kept as pages
            chooser.replace(index, Row(None))
            raise
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
            n = len(r.ids) if r.echo is None else 1  # an echo row feeds the rest
            r.cached_tokens = max(0, prefix.length - (width - n)) if prefix else 0
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
