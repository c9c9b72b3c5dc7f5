"""One HTTP request to the server: its body checked (the OpenAI Batch format's rules of
:mod:`..cli.openai_batch` and the value checks of :mod:`..cli.request_checks`, plus what only
a server serves: ``stream``, ``stream_options`` and log-probabilities), its token ids, and
what goes back: OpenAI's response, stream chunk and error objects. The request is also the
channel between the engine thread, which adds its tokens (:meth:`ServeRequest.take`), and
the event loop, which reads :attr:`ServeRequest.events`.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..cli import openai_batch
from ..cli import request_checks as checks
from ..config import ConfigError
from ..sampling import SamplingConfig, generation_defaults
from ..text.incremental import TextStream

MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}  # OpenAI's limits
log = logging.getLogger("uvicorn.error")  # uvicorn's --log-level applies


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
        choice = {"index": 0, "finish_reason": reason,
                  "logprobs": self.logprobs_object(logprobs)}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat"
                else "text_completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}

    def chunk(self, text: str | None, reason: str | None, logprobs: list[dict],
              first: bool = False) -> dict:
        """One SSE chunk: new text (``None``: no choice, the usage chunk)."""
        choices = []
        if text is not None:
            choice = {"index": 0, "finish_reason": reason,
                      "logprobs": self.logprobs_object(logprobs)}
            if self.kind == "chat":
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
                "top_logprobs": [dict(e["top"]) for e in entries] if self.top_logprobs
                else None, "text_offset": offsets}


def parse(kind: str, body, lm, template: str | None, default_max_tokens: int,
          names: set[str], control_tokens: bool = False,
          context: int | None = None) -> ServeRequest:
    """A request from an HTTP body; :class:`ApiError` for anything that cannot be served as
    asked (nothing is ever silently dropped that would change the answer). Every value goes
    through :mod:`..cli.request_checks`, the layer ``batch`` uses too. ``control_tokens``:
    control-token text in a prompt or message (``<|im_start|>``) is encoded as the control
    token; by default it is plain text. ``context``: the tokens a prompt and its answer may
    fill (``--max-model-len``; default the model's)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        model = checks.model(body.get("model"))
    except checks.Refused as e:
        raise _refused(e) from None
    if model is None:
        raise ApiError(400, "\"model\" is required (GET /v1/models lists it)", param="model")
    if model not in names:
        raise ApiError(404, f"the model {model!r} is not served here; this server serves "
                            f"{sorted(names)[0]!r}", param="model", code="model_not_found")
    served = {"stream", "stream_options", "logprobs", "top_logprobs"}
    rest = {k: v for k, v in body.items() if k not in served}
    url = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    try:
        request = openai_batch.parse({"custom_id": "http", "url": url, "body": rest}, "body",
                                     {"gen_len": default_max_tokens, "repetition_penalty": 1.0},
                                     vocab_size=lm.cfg.vocab_size)
    except ConfigError as e:
        raise ApiError(400, str(e)) from None
    if request["refused"]:
        raise ApiError(400, request["refused"], param=request["param"])
    openai_batch.apply_model_defaults(request, _model_defaults(getattr(lm, "store_path", None)))
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, "stream_options may hold include_usage only",
                       param="stream_options")
    if options and not stream:
        raise ApiError(400, "stream_options goes with stream: true", param="stream_options")
    include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    param = "messages" if kind == "chat" else "prompt"
    settings = request["settings"]
    given = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
    try:
        ids = checks.token_ids(_prompt_ids(request, lm, template, control_tokens),
                               lm.cfg.vocab_size, param)
        max_tokens = checks.room(len(ids), settings["gen_len"], given,
                                 context or lm.cfg.max_positions, param)
    except checks.Refused as e:
        raise _refused(e) from None
    if request["ignored"]:  # accepted, and changing nothing: said once, per request
        log.info("request ignores fields that do not change its answer: %s",
                 ", ".join(request["ignored"]))
    return ServeRequest(kind, ids, max_tokens, sampling_config(settings), request["stop"],
                        _top_logprobs(kind, body), stream, include_usage, model,
                        ignore_eos=settings.get("ignore_eos", False),
                        stop_token_ids=settings.get("stop_token_ids", ()))


def sampling_config(settings: dict) -> SamplingConfig:
    """A request's sampler settings (its checked values, and the model's defaults)."""
    seed = settings.get("seed")
    if seed is None:  # OpenAI: an unseeded request samples differently every time
        seed = int.from_bytes(uuid.uuid4().bytes[:6], "little")
    config = SamplingConfig(settings["temperature"], settings["top_p"], seed,
                            settings.get("repetition_penalty", 1.0), settings.get("top_k", -1),
                            settings.get("min_p", 0.0), settings.get("presence_penalty", 0.0),
                            settings.get("frequency_penalty", 0.0),
                            settings.get("logit_bias", ()))
    try:
        return config.validate()
    except ConfigError as e:  # the checks refuse first; this is the sampler's own word
        raise ApiError(400, str(e)) from None


@functools.lru_cache(maxsize=8)
def _model_defaults(store_path) -> dict:
    """The store's generation_config.json defaults, read once per store."""
    return generation_defaults(store_path)


def _refused(e: checks.Refused) -> ApiError:
    return ApiError(400, str(e), param=e.param, code=e.code)


def _flag(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{param or name} must be true or false", param=param or name)
    return bool(value)


def _top_logprobs(kind: str, body: dict) -> int | None:
    most = MAX_TOP_LOGPROBS[kind]
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "chat":
        if _flag(body, "logprobs"):
            n = 0 if top is None else top
        elif top is not None:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        else:
            return None
    else:
        if top is not None:
            raise ApiError(400, "a completion takes logprobs: N (top_logprobs is the chat's)",
                           param="top_logprobs")
        if logprobs is None:
            return None
        n = logprobs
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= most:
        raise ApiError(400, f"the number of top log-probabilities must be 0 to {most}",
                       param="top_logprobs" if kind == "chat" else "logprobs")
    return n


def _prompt_ids(request: dict, lm, template: str | None, control_tokens: bool) -> list[int]:
    try:
        if request["messages"] is not None:
            if template is None or lm.tokenizer is None:
                raise ApiError(400, "this model has no chat template; use /v1/completions")
            return openai_batch.chat_ids(lm.tokenizer, template, request, control_tokens)
        prompt = request["prompt"]
        if isinstance(prompt, list):
            return prompt
        if lm.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; give the prompt as token ids",
                           param="prompt")
        ids = lm.tokenizer.encode(prompt, control_tokens=control_tokens)
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
        return ids
    except ConfigError as e:  # a TemplateInputError names the field it refuses
        raise ApiError(400, str(e), param=getattr(e, "param", None) or (
            "messages" if request["messages"] is not None else "prompt")) from None
