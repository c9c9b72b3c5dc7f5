"""OpenAI Batch API files for the ``batch`` command: requests in, responses out.

An input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url``
``/v1/chat/completions`` (``body.messages``) or ``/v1/completions`` (``body.prompt``: text or
token ids). What a body may set: ``max_tokens`` (``max_completion_tokens``), ``temperature``
and ``top_p`` (OpenAI's defaults, 1.0, when absent), ``seed``, ``stop`` (strings; the text is
cut at the first one), ``model`` (informational: the command's ``--model`` runs), ``n`` 1,
``stream`` false. Anything else that changes what comes back (``n`` > 1, ``logprobs``,
``tools``, ``echo``, penalties, ...) is refused for that line: its output line carries an
``error`` and the job goes on. A line that is not a request of this format (or a file that
mixes formats) is one error naming the line, before any work.

An output line is ``{"id", "custom_id", "response": {"status_code": 200, "request_id",
"body": {... "choices": [{"message" | "text", "finish_reason"}], "usage"}}, "error": null}``,
or ``response: null`` and ``error: {"code", "message"}`` for a refused request.
"""
from __future__ import annotations

import time
import uuid

from ..config import ConfigError

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# body fields that change nothing here (or that we honour below)
ACCEPTED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens",
            "temperature", "top_p", "seed", "stop", "n", "stream", "user", "metadata",
            "store", "response_format", "logprobs", "top_logprobs", "echo",
            "presence_penalty", "frequency_penalty", "stream_options"}


def is_openai(item) -> bool:
    """Whether a parsed input line is written in the OpenAI Batch format."""
    return isinstance(item, dict) and ("custom_id" in item or "body" in item)


def parse(item: dict, where: str, defaults: dict) -> dict:
    """A request from one OpenAI line: structural faults raise (the job stops before any
    work); unsupported options become the request's ``refused`` message."""
    for name in ("custom_id", "url", "body"):
        if name not in item:
            raise ConfigError(f"{where}: an OpenAI batch line needs \"{name}\"")
    if item.get("method", "POST") != "POST":
        raise ConfigError(f"{where}: method must be POST (got {item['method']!r})")
    kind = URLS.get(item["url"])
    if kind is None:
        raise ConfigError(f"{where}: url {item['url']!r} is not served; use "
                          f"{' or '.join(URLS)}")
    body = item["body"]
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: \"body\" must be an object")
    request = {"id": str(item["custom_id"]), "format": "openai", "kind": kind,
               "prompt": None, "messages": None, "stop": [], "refused": None,
               "model": body.get("model")}
    settings = {**defaults, "temperature": 1.0, "top_p": 1.0}
    try:
        if kind == "chat":
            request["messages"] = _messages(body.get("messages"))
        else:
            request["prompt"] = _prompt(body.get("prompt"))
        _check_options(body)
        for name, key in (("max_tokens", "gen_len"), ("max_completion_tokens", "gen_len"),
                          ("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed")):
            if body.get(name) is not None:
                settings[key] = _number(body[name], name,
                                        float if key in ("temperature", "top_p") else int)
        if settings["gen_len"] < 1:
            raise _Refused("max_tokens must be at least 1")
        if settings["temperature"] < 0 or not 0 < settings["top_p"] <= 1:
            raise _Refused("temperature must be >= 0 and top_p in (0, 1]")
        request["stop"] = _stops(body.get("stop"))
    except _Refused as e:
        request["refused"] = str(e)
    request["settings"] = settings
    return request


class _Refused(Exception):
    """A request this runtime will not serve (its line gets an error; the job goes on)."""


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise _Refused("\"messages\" must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise _Refused("every message needs \"role\" and \"content\"")
        content = m["content"]
        if isinstance(content, list):  # content parts: text only
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise _Refused("only text content parts are served (no images or audio)")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise _Refused("message content must be text")
        if m.get("tool_calls") or m["role"] == "tool":
            raise _Refused("tool calls are not served")
        out.append({"role": m["role"], "content": content})
    return out


def _prompt(prompt):
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise _Refused("\"prompt\" must be one non-empty text or one list of token ids (several "
                   "prompts: one line each)")


def _check_options(body: dict) -> None:
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise _Refused(f"not served: {', '.join(unknown)}")
    if body.get("n", 1) != 1:
        raise _Refused("n > 1 is not served (one choice per request)")
    if body.get("stream"):
        raise _Refused("stream is not served in a batch")
    if body.get("logprobs") or body.get("top_logprobs") or body.get("echo"):
        raise _Refused("logprobs and echo are not served")
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        raise _Refused("presence and frequency penalties are not served")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _Refused("response_format other than text is not served")


def _number(value, name: str, kind):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Refused(f"{name} must be a number")
    return kind(value)


def _stops(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _Refused("stop must be a string or a list of strings")
    return stops


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


def error_line(request: dict, message: str) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": request["id"],
            "response": None, "error": {"code": "invalid_request", "message": message}}
