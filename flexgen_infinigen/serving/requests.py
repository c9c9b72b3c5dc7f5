"""One HTTP request to the server (its body is checked by :mod:`.parse`): its token ids,
settings and what goes back: OpenAI's response, stream chunk and error objects. The request
is also the channel between the engine thread, which adds its tokens
(:meth:`ServeRequest.take`), and the event loop, which reads :attr:`ServeRequest.events`.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..cli import openai_batch
from ..sampling import SamplingConfig
from ..text.incremental import TextStream
from ..text.reasoning import split as split_reasoning


class ApiError(Exception):
    """An answer other than 200: its status and OpenAI's error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass
class ServeRequest:
    kind: str  # "chat" or "completion"
    ids: list[int]  # the prompt's token ids
    max_tokens: int
    sampling: SamplingConfig
    stops: list[str]
    top_logprobs: int | None  # None: no log-probabilities; n: the chosen token's and n more
    stream: bool
    include_usage: bool
    model: str
    ignore_eos: bool = False  # the model's end and stop tokens do not end this row
    stop_token_ids: tuple[int, ...] = ()  # the request's own stop ids (always end it)
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    # the channel: set by the event loop before the request is queued
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    # the engine thread's state of this row
    text: TextStream | None = None
    generated: int = 0
    finished: bool = False
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix pages
    tool_format: str | None = None  # how the answer writes tool calls (tools offered)
    tools: list | None = None  # the tools offered
    # a thinking model's reasoning split out: None (not split), "inside" (the prompt opened
    # the thought), "outside", or "harmony" (gpt-oss's analysis channel)
    reasoning: str | None = None
    harmony: bool = False  # the answer is written in harmony (text.harmony reads it)
    constraint: object = None  # the grammar the answer is held to (.grammar.Constraint)
    # echo (a completion's): each prompt token's text; its log-probability entries are kept
    # as its row feeds the prompt a token a step (the first token's has none)
    echo: list[str] | None = None
    echo_text: str = ""  # the prompt's text, decoded whole (a character may span tokens)
    prompt_logprobs: list[dict] = field(default_factory=list)
    index: int = 0  # the choice's index in the body's answer (n > 1, several prompts)
    first_of_prompt: bool = True  # its prompt's tokens count in usage (once a prompt)
    # latencies: the histograms to observe (set when queued) and the times seen so far
    metrics: object = None
    arrived: float = field(default_factory=time.monotonic)
    last_token: float | None = None

    def __post_init__(self):
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4().hex[:24]}"

    # ---- engine thread ------------------------------------------------------------------
    def start(self, tokenizer) -> None:
        self.text = TextStream(tokenizer, self.stops)
        if self.metrics is not None:
            self.metrics.queued.observe(time.monotonic() - self.arrived)

    def _timed(self) -> None:
        """A token came: the time to the first, or since the last."""
        now = time.monotonic()
        if self.metrics is not None:
            if self.last_token is None:
                self.metrics.ttft.observe(now - self.arrived)
            else:
                self.metrics.between.observe(now - self.last_token)
        self.last_token = now

    def take(self, token: int, stop_ids: set[int], logprob: dict | None) -> int:
        """The row's next token; sends what became final to the client. Returns the tokens
        that count as generated (0 once the row has finished)."""
        if self.finished:
            return 0
        self.generated += 1
        self._timed()
        if token in self.stop_token_ids or (token in stop_ids and not self.ignore_eos):
            self.finish("stop")
            return 1
        piece = self.text.add(token)
        self._send(("token", piece, logprob))
        if self.text.stopped:
            self.finish("stop")
        elif self.generated >= self.max_tokens:
            self.finish("length")
        return 1

    def finish(self, reason: str) -> None:
        if not self.finished:
            self.finished = True
            if self.metrics is not None:
                self.metrics.e2e.observe(time.monotonic() - self.arrived)
            self._send(("done", self.text.finish(), reason))

    def fail(self, message: str, status: int = 500, param: str | None = None) -> None:
        """The request ends with an error (500: the engine's fault; 4xx: the request's)."""
        if not self.finished:
            self.finished = True
            kind = "server_error" if status >= 500 else "invalid_request_error"
            self._send(("error", ApiError(status, message, kind, param), None))

    def drop(self) -> None:
        """The client has gone: nothing more is computed or kept for it."""
        self.finished = True
        self.text = None

    def _send(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (the server is exiting)
            self.finished = True

    # ---- event loop ---------------------------------------------------------------------
    def usage(self) -> dict:
        out = {"prompt_tokens": len(self.ids), "completion_tokens": self.generated,
               "total_tokens": len(self.ids) + self.generated}
        if self.cached_tokens:  # OpenAI's name for prompt tokens a cache answered
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return out

    def response(self, text: str, reason: str, logprobs: list[dict]) -> dict:
        choice = {"index": self.index, "finish_reason": reason,
                  "logprobs": self.logprobs_object(logprobs)}
        if self.kind == "chat":
            thought = None
            if self.reasoning in ("inside", "outside"):
                thought, text = split_reasoning(text, self.reasoning == "inside")
            choice["message"] = openai_batch.assistant_message(
                {"tool_format": self.tool_format, "tools": self.tools,
                 "harmony": self.harmony}, text, reasoning=self.reasoning == "harmony")
            if thought is not None:
                choice["message"]["reasoning_content"] = thought
            if "tool_calls" in choice["message"]:
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = text
        if self.echo is not None:  # the prompt first, in text and in log-probabilities
            choice["text"] = self.echo_text + text
            first = {"token": self.echo[0], "logprob": None, "top": None}
            choice["logprobs"] = self.logprobs_object([first, *self.prompt_logprobs,
                                                       *logprobs])
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat"
                else "text_completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str | None, reason: str | None, logprobs: list[dict],
              first: bool = False, calls: list[dict] | None = None,
              reasoning: str | None = None) -> dict:
        """One SSE chunk: new text (``None``: no choice, the usage chunk); ``calls``: tool
        call deltas in OpenAI's shape (each with its ``index``); ``reasoning``: a piece of a
        thinking model's reasoning."""
        choices = []
        if text is not None:
            choice = {"index": self.index, "finish_reason": reason,
                      "logprobs": self.logprobs_object(logprobs)}
            if calls:
                choice["delta"] = {"tool_calls": calls}
            elif reasoning:
                choice["delta"] = {"reasoning_content": reasoning}
            elif self.kind == "chat":
                choice["delta"] = {"role": "assistant", "content": text} if first \
                    else {"content": text} if text or reason is None else {}
            else:
                choice["text"] = text
            choices.append(choice)
        out = {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat"
               else "text_completion", "created": self.created, "model": self.model,
               "choices": choices}
        if self.include_usage:
            out["usage"] = self.usage() if text is None else None
        return out

    def logprobs_object(self, entries: list[dict]):
        """OpenAI's ``logprobs`` of a choice: ``content`` entries for a chat, the four lists
        of the legacy completions."""
        if self.top_logprobs is None:
            return None
        if self.kind == "chat":
            return {"content": [{"token": e["token"], "logprob": e["logprob"],
                                 "bytes": list(e["token"].encode("utf-8")),
                                 "top_logprobs": [{"token": t, "logprob": lp,
                                                   "bytes": list(t.encode("utf-8"))}
                                                  for t, lp in e["top"]]} for e in entries]}
        offsets, at = [], 0
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        return {"tokens": [e["token"] for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [None if e["top"] is None else dict(e["top"])
                                 for e in entries] if self.top_logprobs else None,
                "text_offset": offsets}


def usage(served: list[ServeRequest]) -> dict:
    """A body's usage: every prompt once, every choice's tokens."""
    prompt = sum(len(one.ids) for one in served if one.first_of_prompt)
    made = sum(one.generated for one in served)
    out = {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}
    cached = sum(one.cached_tokens for one in served if one.first_of_prompt)
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def combined(served: list[ServeRequest], answers: list) -> dict:
    """One body's answer with every choice (n > 1, several prompts)."""
    bodies = [one.response(*answer) for one, answer in zip(served, answers)]
    out = bodies[0]
    out["choices"] = [body["choices"][0] for body in bodies]
    out["usage"] = usage(served)
    return out
