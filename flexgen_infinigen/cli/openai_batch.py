"""OpenAI Batch API files for the ``batch`` command: requests in, responses out.

An input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url``
``/v1/chat/completions`` (``body.messages``) or ``/v1/completions`` (``body.prompt``: text or
token ids). What a body may set (:data:`SERVED`): ``max_tokens`` (``max_completion_tokens``),
``temperature`` and ``top_p`` (OpenAI's defaults, 1.0, when absent), ``top_k``, ``min_p``,
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``seed``
(see :mod:`..sampling` for what each does), ``stop`` (strings; the text is cut at the first
one), ``stop_token_ids`` and ``ignore_eos``, ``chat_template_kwargs``, ``documents`` and
``tools`` with ``tool_choice`` (a chat's, passed to its template; calls in the answer come
back as ``tool_calls``; ``required`` or a named function holds the answer to one call of it),
``response_format`` ``json_object`` or ``json_schema`` (grammar-constrained, as the server
does), ``n`` (up to :data:`MAX_N` choices, choice ``j`` seeded ``seed + j``), ``logprobs``
(and a chat's ``top_logprobs``), a completion's ``echo`` (these three, and ``response_format``
and a forced call, need the refilled rows, ``batch``'s default), ``model`` (informational:
the command's ``--model`` runs), ``stream`` false. A field left out takes the model's
``generation_config.json`` value where it has one (:func:`apply_model_defaults`). Fields that
change nothing in the answer (:data:`IGNORED`: ``user``, ``metadata``, ...) are accepted and
named in the request's ``ignored``. Anything else (``best_of``, ``suffix``, ...) is refused
for that line, and so is any value that :mod:`.request_checks`
refuses (the layer the server shares): its output line carries an ``error`` naming the field
and the job goes on. A line that is not a request of this format (or a file that mixes
formats) is one error naming the line, before any work.

An output line is ``{"id", "custom_id", "response": {"status_code": 200, "request_id",
"body": {... "choices": [{"message" | "text", "finish_reason"}], "usage"}}, "error": null}``,
or ``response: null`` and ``error: {"code", "message", "param"}`` for a refused request.
"""
from __future__ import annotations

import time
import uuid

from ..config import ConfigError
from . import message_checks
from . import request_checks as checks

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# the sampling fields a body may set, each with its check (``vocab``: the model's size, when
# known, for the fields that name token ids)
SAMPLING = {
    "temperature": lambda v, vocab: checks.temperature(v),
    "top_p": lambda v, vocab: checks.top_p(v),
    "top_k": lambda v, vocab: checks.top_k(v),
    "min_p": lambda v, vocab: checks.min_p(v),
    "seed": lambda v, vocab: checks.seed(v),
    "repetition_penalty": lambda v, vocab: checks.repetition_penalty(v),
    "presence_penalty": lambda v, vocab: checks.penalty(v, "presence_penalty"),
    "frequency_penalty": lambda v, vocab: checks.penalty(v, "frequency_penalty"),
    "logit_bias": lambda v, vocab: checks.logit_bias(v, vocab),
    "stop_token_ids": lambda v, vocab: checks.stop_token_ids(v, vocab),
    "ignore_eos": lambda v, vocab: checks.flag(v, "ignore_eos"),
}
# body fields served (the values below are checked; n, stream, logprobs and echo only where
# they ask for what one answer is)
SERVED = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stop", "n",
          "stream", "response_format", "logprobs", "top_logprobs", "echo",
          "chat_template_kwargs", "documents", "tools", "tool_choice", *SAMPLING}
# body fields that change nothing in the answer: accepted, named once in a log line.
# parallel_tool_calls: the model writes as many calls as it does; prediction (Predicted
# Outputs) only speeds OpenAI's answer up; stream_options reaches here only in a batch,
# which never streams
IGNORED = {"user", "metadata", "store", "service_tier", "safety_identifier",
           "prompt_cache_key", "parallel_tool_calls", "prediction", "stream_options"}


MAX_N = 128  # a batch line's choices (each takes a row of the job in turn)


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
               "model": None, "template_kwargs": None, "documents": None, "given": set(),
               "tools": None, "tool_format": None, "response_format": None,
               "forced_call": None, "n": 1, "top_logprobs": None, "echo": False,
               "ignored": sorted(str(k) for k in body if k in IGNORED)}
    settings = {**defaults, "temperature": 1.0, "top_p": 1.0}
    try:
        request["model"] = checks.model(body.get("model"))
        if kind == "chat":
            request["messages"] = message_checks.messages(body.get("messages"))
            request["template_kwargs"] = message_checks.template_kwargs(
                body.get("chat_template_kwargs"))
            request["documents"] = message_checks.documents(body.get("documents"))
            offered = message_checks.tools(body.get("tools"))
            if message_checks.tool_choice(body.get("tool_choice"), offered) != "none":
                request["tools"] = offered  # "none": the prompt shows no tools
        else:
            request["prompt"] = checks.prompt(body.get("prompt"), vocab_size)
        _check_options(body, kind)
        # choices, log-probabilities and echo: answered by the rows of a refilled job
        request["n"] = 1 if body.get("n") is None else checks.integer(body["n"], "n", 1, MAX_N)
        request["top_logprobs"] = checks.top_logprobs(kind, body.get("logprobs"),
                                                      body.get("top_logprobs"))
        request["echo"] = body.get("echo") is not None and checks.flag(body["echo"], "echo")
        if request["echo"] and kind == "chat":
            raise checks.Refused("echo goes with /v1/completions", "echo")
        # a grammar the answer is held to (compiled once the model is loaded: batch._prepare)
        request["response_format"] = body.get("response_format")
        choice = body.get("tool_choice")
        if choice == "required" or isinstance(choice, dict):
            request["forced_call"] = choice
        for name in ("max_tokens", "max_completion_tokens"):
            if body.get(name) is not None:
                settings["gen_len"] = checks.max_tokens(body[name], name)
        if settings["gen_len"] < 1:
            raise checks.Refused("max_tokens must be at least 1", "max_tokens")
        for name, check in SAMPLING.items():
            if body.get(name) is not None:
                settings[name] = check(body[name], vocab_size)
                request["given"].add(name)
        request["stop"] = checks.stops(body.get("stop"))
    except checks.Refused as e:
        request["refused"], request["param"] = str(e), e.param
    request["settings"] = settings
    return request


def apply_model_defaults(request: dict, model_defaults: dict) -> None:
    """The model's ``generation_config.json`` values (:func:`..sampling.generation_defaults`)
    for the sampling fields the request left out: a request's own value comes first, then
    the model's, then OpenAI's default (as vLLM does)."""
    for name, value in model_defaults.items():
        if name not in request["given"]:
            request["settings"][name] = value


def chat_ids(tokenizer, template: str, request: dict, control_tokens: bool = False) -> list[int]:
    """A chat request's prompt ids through ``template``, with its ``tools``, ``documents``
    and ``chat_template_kwargs``; a request with tools learns the format its answer's calls
    take (``tool_format``), and one whose template shows no tools is refused."""
    from ..text import harmony, reasoning
    from ..text.chat import chat_prompt_ids
    from ..text.template import TemplateInputError
    from ..text.tool_calls import format_of

    request["harmony"] = harmony.speaks(template)
    if request.get("tools"):
        request["tool_format"] = format_of(template)
        if request["tool_format"] is None:
            raise TemplateInputError("this model's chat template shows no tools, so it cannot "
                                     "be offered any; drop \"tools\" (or give a template "
                                     "that has them: --chat-template)", "tools")
    ids = chat_prompt_ids(tokenizer, template, request["messages"],
                          control_tokens=control_tokens, tools=request.get("tools"),
                          documents=request.get("documents"),
                          template_kwargs=request.get("template_kwargs"))
    # a thinking model's answer: its reasoning goes in reasoning_content (assistant_message)
    request["thought"] = None if request["harmony"] else reasoning.mode(template, tokenizer, ids)
    return ids


def _check_options(body: dict, kind: str) -> None:
    unknown = sorted(str(k) for k in set(body) - SERVED - IGNORED)
    if unknown:
        raise checks.Refused(f"not served: {', '.join(unknown)}", unknown[0])
    if body.get("stream"):
        raise checks.Refused("stream is not served in a batch", "stream")
    if kind != "chat":
        for name in ("chat_template_kwargs", "documents", "tools", "tool_choice"):
            if body.get(name) is not None:
                raise checks.Refused(f"{name} goes with /v1/chat/completions (a completion's "
                                     "prompt is not rendered through a template)", name)


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string (not included), and whether one was found."""
    cuts = [text.find(s) for s in stops if s in text]
    return (text[:min(cuts)], True) if cuts else (text, False)


def response_line(request: dict, text: str, completion_tokens: int, prompt_tokens: int,
                  finish_reason: str, model: str) -> dict:
    kind = request["kind"]
    choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if kind == "chat":
        choice["message"] = assistant_message(request, text)
        if "tool_calls" in choice["message"]:
            choice["finish_reason"] = "tool_calls"
    else:
        choice["text"] = text
    body = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    return body_line(request, body)


def body_line(request: dict, body: dict) -> dict:
    """The output line of an answered request whose response body is ``body``."""
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": request["id"],
            "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
            "error": None}


def assistant_message(request: dict, text: str, reasoning: bool = True) -> dict:
    """The answer as OpenAI's assistant message: its calls in ``tool_calls`` when the request
    offered tools and the answer calls them (content: the text around them, or None). A
    harmony answer (gpt-oss) is read by its channels, its analysis in ``reasoning_content``
    (``reasoning`` False: left in the content)."""
    from ..text import harmony
    from ..text.reasoning import split as split_thought
    from ..text.tool_calls import parse

    names = {t["function"]["name"] for t in request.get("tools") or ()}
    thought = None
    if request.get("thought") and reasoning:  # <think>...</think> before the answer
        thought, text = split_thought(text, request["thought"] == "inside")
    if request.get("harmony"):
        thought, content, calls = harmony.split(text, reasoning, tools=bool(names))
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        if thought is not None:
            message["reasoning_content"] = thought
        return message
    content, calls = parse(text, request.get("tool_format"), names)
    message = {"role": "assistant", "content": content if calls else text}
    if calls:
        message["tool_calls"] = calls
    if thought is not None:
        message["reasoning_content"] = thought
    return message


def error_line(request: dict, message: str, param: str | None = None) -> dict:
    """A refused or failed request's line; ``param``: the field at fault (default: the one
    parsing named)."""
    return {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": request["id"],
            "response": None, "error": {"code": "invalid_request", "message": message,
                                        "param": param or request.get("param")}}
