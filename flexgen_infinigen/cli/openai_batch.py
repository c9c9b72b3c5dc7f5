"""OpenAI Batch API files for the ``batch`` command: requests in, responses out.

An input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url``
``/v1/chat/completions`` (``body.messages``) or ``/v1/completions`` (``body.prompt``: text or
token ids). What a body may set: ``max_tokens`` (``max_completion_tokens``), ``temperature``
and ``top_p`` (OpenAI's defaults, 1.0, when absent), ``seed``, ``stop`` (strings; the text is
cut at the first one), ``model`` (informational: the command's ``--model`` runs), ``n`` 1,
``stream`` false. Anything else that changes what comes back (``n`` > 1, ``logprobs``,
``tools``, ``echo``, penalties, ...) is refused for that line, and so is any value that
:mod:`.request_checks` refuses (the layer the server shares): its output line carries an
``error`` naming the field and the job goes on. A line that is not a request of this format
(or a file that mixes formats) is one error naming the line, before any work.

An output line is ``{"id", "custom_id", "response": {"status_code": 200, "request_id",
"body": {... "choices": [{"message" | "text", "finish_reason"}], "usage"}}, "error": null}``,
or ``response: null`` and ``error: {"code", "message", "param"}`` for a refused request.
"""
from __future__ import annotations

import time
import uuid

from ..config import ConfigError
from . import request_checks as checks

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# body fields that change nothing here (or that we honour below)
ACCEPTED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens",
            "temperature", "top_p", "seed", "stop", "n", "stream", "user", "metadata",
            "store", "response_format", "logprobs", "top_logprobs", "echo",
            "presence_penalty", "frequency_penalty", "stream_options"}


def is_openai(item) -> bool:
    """Whether a parsed input line is written in the OpenAI Batch format."""
    return isinstance(item, dict) and ("custom_id" in item or "body" in item)


def parse(item: dict, where: str, defaults: dict, vocab_size: int | None = None) -> dict:
    """A request from one OpenAI line: structural faults raise (the job stops before any
    work); a value that cannot be served (:mod:`.request_checks`) becomes the request's
    ``refused`` message and ``param``, the field it names. ``vocab_size``: prompt token ids
    are checked against it when given."""
    for name in ("custom_id", "url", "body"):
        if name not in item:
            raise ConfigError(f"{where}: an OpenAI batch line needs \"{name}\"")
    if item.get("method", "POST") != "POST":
        raise ConfigError(f"{where}: method must be POST (got {item['method']!r})")
    kind = URLS.get(item["url"]) if isinstance(item["url"], str) else None
    if kind is None:
        raise ConfigError(f"{where}: url {item['url']!r} is not served; use "
                          f"{' or '.join(URLS)}")
    body = item["body"]
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: \"body\" must be an object")
    request = {"id": str(item["custom_id"]), "format": "openai", "kind": kind,
               "prompt": None, "messages": None, "stop": [], "refused": None, "param": None,
               "model": None}
    settings = {**defaults, "temperature": 1.0, "top_p": 1.0}
    try:
        request["model"] = checks.model(body.get("model"))
        if kind == "chat":
            request["messages"] = checks.messages(body.get("messages"))
        else:
            request["prompt"] = checks.prompt(body.get("prompt"), vocab_size)
        _check_options(body)
        for name in ("max_tokens", "max_completion_tokens"):
            if body.get(name) is not None:
                settings["gen_len"] = checks.max_tokens(body[name], name)
        if settings["gen_len"] < 1:
            raise checks.Refused("max_tokens must be at least 1", "max_tokens")
        for name, check in (("temperature", checks.temperature), ("top_p", checks.top_p),
                            ("seed", checks.seed)):
            if body.get(name) is not None:
                settings[name] = check(body[name])
        request["stop"] = checks.stops(body.get("stop"))
    except checks.Refused as e:
        request["refused"], request["param"] = str(e), e.param
    request["settings"] = settings
    return request


def _check_options(body: dict) -> None:
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise checks.Refused(f"not served: {', '.join(map(str, unknown))}", str(unknown[0]))
    if body.get("n") is not None and checks.integer(body["n"], "n") != 1:
        raise checks.Refused("n > 1 is not served (one choice per request)", "n")
    if body.get("stream"):
        raise checks.Refused("stream is not served in a batch", "stream")
    for name in ("logprobs", "top_logprobs", "echo"):
        if body.get(name):
            raise checks.Refused(f"{name} is not served here (no logprobs or echo)", name)
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) is not None and checks.number(body[name], name) != 0:
            raise checks.Refused(f"{name} is not served (no penalties)", name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise checks.Refused("response_format other than text is not served",
                             "response_format")


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string (not included), and whether one was found."""
    cuts = [text.find(s) for s in stops if s in text]
    return (text[:min(cuts)], True) if cuts else (text, False)


def response_line(request: dict, text: str, completion_tokens: int, prompt_tokens: int,
                  finish_reason: str, model: str) -> dict:
    kind = request["kind"]
    choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    body = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": request["id"],
            "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
            "error": None}


def error_line(request: dict, message: str, param: str | None = None) -> dict:
    """A refused or failed request's line; ``param``: the field at fault (default: the one
    parsing named)."""
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": request["id"],
            "response": None, "error": {"code": "invalid_request", "message": message,
                                        "param": param or request.get("param")}}
