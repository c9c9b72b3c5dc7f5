"""A batch job's requests through the server's scheduler, without HTTP: every request takes a
row, and a row whose answer has ended is taken by the next request between two steps
(:mod:`..engine.join`), so rows with short answers do not sit idle until their block's
longest answer ends. Each request keeps its own settings (sampling, stops, stop ids), as a
server's request does; its answer at temperature 0 is the one it gets alone.

Requests are queued shortest prompt first (less padding in the blocks that start). Results
come back as each request ends, in the order they end.
"""
from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass, field

from .metrics import Metrics
from .requests import ApiError, ServeRequest
from .scheduler import Scheduler


@dataclass
class JobRequest(ServeRequest):
    """A server request that keeps the token ids it was given (a job's output lists them) and
    the input line it answers."""

    token_ids: list[int] = field(default_factory=list)
    line: dict | None = None
    pieces: list[str] = field(default_factory=list)  # the answer's text, as it was released
    entries: list[dict] = field(default_factory=list)  # its tokens' log-probability entries
    reason: str | None = None  # why it ended

    def answer(self) -> tuple[str, str | None, list[dict]]:
        """(text, finish reason, log-probability entries), as a server's answer is kept."""
        return "".join(self.pieces), self.reason, self.entries

    def take(self, token: int, stop_ids: set[int], logprob: dict | None) -> int:
        if not self.finished:
            self.token_ids.append(token)
        return super().take(token, stop_ids, logprob)


class _Direct:
    """The engine thread's events delivered where they happen (no event loop)."""

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


class _Ends:
    """A request's event channel: its text and log-probabilities kept in the request, its
    end (done or error) passed on."""

    def __init__(self, request: JobRequest, ended: queue.Queue):
        self.request, self.ended = request, ended

    def put_nowait(self, event) -> None:
        kind, piece, extra = event
        if kind in ("token", "done"):
            self.request.pieces.append(piece)
        if kind == "token" and extra is not None:
            self.request.entries.append(extra)
        if kind == "done":
            self.request.reason = extra
        if kind in ("done", "error"):
            self.ended.put((self.request, event))


def answer_all(lm, requests: list[JobRequest], timeout_s: float = 3600.0,
               metrics: Metrics | None = None, block_answers: int = 4
               ) -> Iterator[tuple[JobRequest, tuple]]:
    """(request, its end event) for every request, as each ends: ``("done", text, reason)``,
    or ``("error", ApiError, None)`` for one that failed (alone, or with its block).
    ``timeout_s``: the longest wait for the next request to end (a stuck engine raises);
    ``metrics``: the scheduler's counters (blocks, joins), when the caller reads them;
    ``block_answers``: a block's steps, in its longest answers (a longer block takes more
    requests into ended rows before it ends; its caches hold that many columns)."""
    if not requests:
        return
    ended: queue.Queue = queue.Queue()
    scheduler = Scheduler(lm, 0.0, len(requests) + 1, metrics=metrics,
                          admit_prompt_tokens=lm.cfg.max_positions,
                          block_answers=block_answers, spare_rows=0,
                          free_columns=min(max(len(r.ids) for r in requests), 1024))
    for r in sorted(requests, key=lambda r: (-r.max_tokens, len(r.ids))):
        r.loop, r.events = _Direct(), _Ends(r, ended)
        scheduler.submit(r)
    scheduler.start()
    try:
        for _ in requests:
            try:
                yield ended.get(timeout=timeout_s)
            except queue.Empty:
                raise RuntimeError(f"no request ended in {timeout_s:.0f} s: the engine is "
                                   f"stuck") from None
    finally:
        for r in requests:  # an abandoned job: the rows still running are dropped
            r.cancelled.set()
        scheduler.stop(timeout=60)


class LineGrammars:
    """The job's grammar-constrained lines (``response_format`` JSON, ``tool_choice``
    ``required`` or a named function): each compiled before any work, as the server compiles
    a request's (:mod:`.grammar`); they run in the refilled rows, each row masked
    alone."""

    def __init__(self, lm, refilled: bool):
        self.lm, self.refilled, self._grammars = lm, refilled, None

    def compile(self, request: dict) -> str | None:
        """Sets ``request["grammar"]`` (None: a free answer); the reason a line is refused."""
        from .parse import grammar_of

        fmt, forced = request.get("response_format"), request.get("forced_call")
        request["grammar"] = None
        if (fmt is None or fmt == {"type": "text"}) and forced is None:
            return None
        if not self.refilled:
            request["param"] = "response_format" if forced is None else "tool_choice"
            return ("response_format JSON and tool_choice \"required\" (or a named function) "
                    "run in refilled rows: drop --no-refill (and give a model with a tokenizer)")
        if self._grammars is None:
            from .grammar import Grammars
            self._grammars = Grammars(self.lm)
        try:
            request["grammar"] = grammar_of(fmt, forced, request, self._grammars)
        except ApiError as e:
            request["param"] = e.param
            return str(e)
        return None

    def constraint(self, request: dict):
        grammar = request.get("grammar")
        return self._grammars.constraint(grammar) if grammar else None
