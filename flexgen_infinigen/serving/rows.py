"""The rows of a running block: which request each holds, what it has fed into the caches,
and the sampler that chooses every row's next token.

A row admitted while the block runs takes its prompt's prefill, run alone, into its columns
(:mod:`~..engine.join`) and answers from the next step on. Where the caches cannot take a
row's columns it feeds its prompt one token a step instead
(:meth:`~..engine.schedule.Engine.restart_row`): its chooser hands the next prompt token
back instead of choosing, and its request sees tokens only once the prompt is in.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling import Sampler
from .requests import ServeRequest


@dataclass
class Row:
    """One row of the block. ``request`` None: a free row (a short block's dummy).

    ``first_column``: the cache column of its first token; ``fed``: every token it has put
    into the caches since, in order (its prompt, then its answer as fed back); ``feed``: its
    prompt tokens still to go in (a row admitted mid-block)."""

    request: ServeRequest | None
    sampler: Sampler | None = None
    first_column: int = 0
    fed: list[int] = field(default_factory=list)
    feed: list[int] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        """Free for a waiting request: no request, or one that has ended."""
        return self.request is None or self.request.finished

    def sequence(self) -> list[int]:
        """What its caches hold of its request: the prompt and the answer tokens fed back
        (tokens fed after the request ended are not its own)."""
        if self.request is None or self.request.text is None:  # free, or dropped
            return []
        return self.fed[:len(self.request.ids) + self.request.generated]


class RowChooser:
    """The engine's sampler for one block: every row chooses with its own request's settings,
    and the log-probabilities each row asked for are kept for the step.

    A row still feeding its prompt takes its next prompt token (listed in
    :attr:`feeding` for the step: its request sees nothing). A row whose choice raises fails
    alone: it takes the argmax (so the step's shapes stay whole) and is listed in
    :attr:`failed`; the scheduler ends its request with the error and the block goes on. The
    other rows' choices never read it, so they are the tokens they would have been without
    it."""

    def __init__(self, rows: list[Row], batch_size: int, tokenizer):
        self.rows, self.batch_size, self.tokenizer = rows, batch_size, tokenizer
        self.logprobs: list[dict | None] = [None] * len(rows)
        self.failed: dict[int, str] = {}  # row -> why its choice failed (not yet reported)
        self.feeding: set[int] = set()  # rows that took a prompt token at this step

    def replace(self, index: int, row: Row) -> None:
        """Row ``index`` holds a new request from the next step on."""
        self.rows[index] = row
        self.logprobs[index] = None
        self.failed.pop(index, None)

    def __call__(self, logits: torch.Tensor, step: int = 0, batch: int = 0) -> torch.Tensor:
        logits = logits.float().cpu()
        tokens = logits.argmax(-1)
        first = batch * self.batch_size
        for r in range(logits.shape[0]):
            index = first + r
            self.feeding.discard(index)
            row = self.rows[index]
            if row.idle or index in self.failed:
                continue  # a free row, or one that has ended: its token is never read
            if row.feed:  # the prompt is not all in yet: its next token, no choice
                tokens[r] = row.feed.pop(0)
                self.feeding.add(index)
                request = row.request
                if request.echo is not None and request.top_logprobs is not None:
                    request.prompt_logprobs.append(self._logprobs(
                        logits[r], int(tokens[r]), request.top_logprobs))
                continue
            tokens[r] = self.choose(index, logits[r], step)
        return tokens

    def choose(self, index: int, logits: torch.Tensor, step: int) -> int:
        """Row ``index``'s token from its logits ``[vocab]`` (float32, on the CPU), chosen
        with its request's settings; a choice that raises takes the argmax and lists the row
        in :attr:`failed`."""
        row = self.rows[index]
        request, token = row.request, int(logits.argmax())
        try:
            constraint = request.constraint
            if constraint is not None:  # only the tokens its grammar allows
                token = int(row.sampler(constraint.masked(logits[None]), step, 0)[0])
                why = constraint.take(token)
                if why is not None:
                    raise ValueError(why)
            elif request.sampling.temperature > 0 or request.sampling.moves_logits:
                # the row's own chooser, on its row alone (its history is its own)
                token = int(row.sampler(logits[None], step, 0)[0])
            if request.top_logprobs is not None:
                self.logprobs[index] = self._logprobs(logits, token, request.top_logprobs)
        except Exception as e:  # noqa: BLE001 - this row's request fails, not the block
            token = int(logits.argmax())
            self.failed[index] = f"choosing this request's token failed: " \
                                 f"{type(e).__name__}: {e}"
        return token

    def _logprobs(self, logits: torch.Tensor, token: int, top: int) -> dict:
        """The model's own log-probabilities (before temperature and top-p)."""
        lp = torch.log_softmax(logits, -1)
        best = lp.topk(top) if top else None
        pairs = [] if best is None else list(zip(best.indices.tolist(), best.values.tolist()))
        return {"token": self.tokenizer.decode([token]), "logprob": float(lp[token]),
                "top": [(self.tokenizer.decode([i]), v) for i, v in pairs]}
