"""An HTTP body checked into a :class:`~.requests.ServeRequest`: the OpenAI Batch format's
rules of :mod:`..cli.openai_batch` and the value checks of :mod:`..cli.request_checks`, plus
what only a server serves (``stream``, ``stream_options`` and log-probabilities), the prompt's
token ids through the chat template, and how a thinking model's answer holds its reasoning.
"""
from __future__ import annotations

import functools
import logging
import uuid

from ..cli import openai_batch
from ..cli import request_checks as checks
from ..config import ConfigError
from ..sampling import SamplingConfig, generation_defaults
from ..text import harmony
from ..text.reasoning import mode as reasoning_mode
from .requests import ApiError, ServeRequest

log = logging.getLogger("uvicorn.error")  # uvicorn's --log-level applies


def parse_all(kind: str, body, lm, template: str | None, default_max_tokens: int,
              names: set[str], max_n: int, **kw) -> list[ServeRequest]:
    """A body's answers, one :class:`ServeRequest` each, in the order of their ``index``:
    a list of prompts on ``/v1/completions`` (several texts, or several lists of token
    ids) times ``n`` choices each (at most ``max_n``, the block's rows). A request seeded
    ``s`` gives its ``j``-th choice seed ``s + j``, so each choice differs and each repeats."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    n = body.get("n", 1)
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_n:
        raise ApiError(400, f"n must be 1 to {max_n} (the rows of a block)", param="n")
    prompts = [body.get("prompt")]
    given = body.get("prompt")
    if kind == "completion" and isinstance(given, list) and given and \
            all(isinstance(p, (str, list)) for p in given):
        prompts = given  # several prompts (texts, or lists of token ids)
    out = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            one = {**body, "n": 1}
            if kind == "completion":
                one["prompt"] = prompt
            if j and isinstance(body.get("seed"), int):
                one["seed"] = body["seed"] + j
            served = parse(kind, one, lm, template, default_max_tokens, names, **kw)
            served.index, served.first_of_prompt = i * n + j, j == 0
            out.append(served)
    return out


def parse(kind: str, body, lm, template: str | None, default_max_tokens: int,
          names: set[str], control_tokens: bool = False,
          context: int | None = None, reasoning: bool = True,
          grammars=None) -> ServeRequest:
    """A request from an HTTP body; :class:`ApiError` for anything that cannot be served as
    asked (nothing is ever silently dropped that would change the answer). Every value goes
    through :mod:`..cli.request_checks`, the layer ``batch`` uses too. ``control_tokens``:
    control-token text in a prompt or message (``<|im_start|>``) is encoded as the control
    token; by default it is plain text. ``context``: the tokens a prompt and its answer may
    fill (``--max-model-len``; default the model's). ``reasoning``: a thinking model's
    reasoning goes in ``reasoning_content`` (``--reasoning-format none``: in ``content``).
    ``grammars`` (:class:`.grammar.Grammars`): ``response_format`` JSON and ``tool_choice``
    ``required`` or a named function are enforced through it (None: refused)."""
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
    served = {"stream", "stream_options", "logprobs", "top_logprobs", "response_format",
              "echo"}
    forced = body.get("tool_choice")  # a call the answer must make: a grammar, below
    forced = forced if forced == "required" or isinstance(forced, dict) else None
    if forced is not None:
        served.add("tool_choice")
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
    echo = _flag(body, "echo")
    if echo and kind == "chat":
        raise ApiError(400, "echo goes with /v1/completions", param="echo")
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
    grammar = grammar_of(body.get("response_format"), forced, request, grammars)
    if request["ignored"]:  # accepted, and changing nothing: said once, per request
        log.info("request ignores fields that do not change its answer: %s",
                 ", ".join(request["ignored"]))
    served = ServeRequest(kind, ids, max_tokens, sampling_config(settings), request["stop"],
                          _top_logprobs(kind, body), stream, include_usage, model,
                          ignore_eos=settings.get("ignore_eos", False),
                          stop_token_ids=settings.get("stop_token_ids", ()),
                          tool_format=request.get("tool_format"), tools=request.get("tools"),
                          reasoning=_thought(kind, reasoning, template, lm.tokenizer, ids),
                          harmony=kind == "chat" and bool(request.get("harmony")),
                          constraint=grammars.constraint(grammar) if grammar else None)
    if echo:  # the prompt's text before the answer's, and its tokens' log-probabilities
        served.echo = [lm.tokenizer.decode([t]) if lm.tokenizer else "" for t in ids]
        served.echo_text = lm.tokenizer.decode(ids) if lm.tokenizer else ""
    return served


def grammar_of(fmt, forced, request: dict, grammars) -> str | None:
    """The grammar the answer is held to: ``response_format`` ``fmt``'s JSON, or the call a
    ``tool_choice`` of ``required`` or a named function (``forced``) asks for, from the
    request's ``tools``; None: a free answer. A server's request and a batch line alike."""
    wants_json = fmt is not None and fmt != {"type": "text"}
    if forced is None and not wants_json:
        return None
    if grammars is None:
        raise ApiError(400, "response_format JSON and tool_choice \"required\" are not "
                            "served here", param="tool_choice" if forced else "response_format")
    if forced is not None:
        if wants_json:
            raise ApiError(400, "tool_choice \"required\" (or a named function) and a JSON "
                                "response_format cannot both hold one answer",
                           param="tool_choice")
        if not request.get("tools"):
            raise ApiError(400, "tool_choice asks for a call, but no tools are given",
                           param="tool_choice")
        name = None
        if isinstance(forced, dict):
            fn = forced.get("function")
            if forced.get("type") != "function" or not isinstance(fn, dict) or \
                    not isinstance(fn.get("name"), str):
                raise ApiError(400, "a named tool_choice is {\"type\": \"function\", "
                                    "\"function\": {\"name\": ...}}", param="tool_choice")
            name = fn["name"]
        return grammars.tool_call(request["tools"], name, request.get("tool_format"))
    return grammars.response_format(fmt)


def _thought(kind: str, reasoning: bool, template: str | None, tokenizer,
             ids: list[int]) -> str | None:
    """How a chat's answer holds its reasoning: None (not split), "inside" (the prompt's
    last tokens open the thought), "outside" or "harmony" (the analysis channel)."""
    if kind != "chat" or not reasoning:
        return None
    if harmony.speaks(template):
        return "harmony"
    return reasoning_mode(template, tokenizer, ids)


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
    try:
        return checks.top_logprobs(kind, body.get("logprobs"), body.get("top_logprobs"))
    except checks.Refused as e:
        raise _refused(e) from None


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
