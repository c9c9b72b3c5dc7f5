"""The ``batch`` command's files: the requests in ``--input`` (the project's own line format
or the OpenAI Batch format, :mod:`.openai_batch`), and the result and error lines of
``--output``, which a rerun reads back to skip what is done.

What fails where:

- a line that is not a request at all (not JSON, no ``id``/``custom_id``, neither prompt nor
  messages, a ``gen_len`` that is not a whole number >= 1, an OpenAI line without
  ``url``/``body``), a file mixing the two formats, an id given twice: one error naming the
  line, before any work (nothing can be written for a line that has no id);
- a request whose values are refused (a sampling value out of range or not finite, a seed
  outside 64 bits, an option that is not served): its own error line, and the job goes on.

An output line is a result (``{"id", "text", "token_ids", "prompt_tokens", "finish_reason",
"error": null}``; OpenAI's ``{"id", "custom_id", "response", "error": null}``) or an error
(``{"id", "error": {"code", "message", "param"}}``; OpenAI's ``"response": null, "error":
{"code", "message", "param"}``; ``param`` names the field at fault, when one is). Either
counts as done: a rerun skips its id.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from ..config import ConfigError
from ..sampling import SamplingConfig
from . import openai_batch
from . import message_checks
from . import request_checks as checks

# our format's length: gen_len, or its OpenAI names
LENGTHS = ("gen_len", "max_tokens", "max_completion_tokens")
# fields of other APIs that would change the answer, refused by name rather than ignored
# (any other field is the user's own, kept out of the way)
NOT_SERVED = ("n", "best_of", "logprobs", "top_logprobs", "echo", "min_tokens", "stream",
              "tools", "tool_choice", "functions", "response_format", "suffix",
              "logits_processors")
INVALID, FAILED = "invalid_request", "generation_failed"  # the error lines' codes


def read_requests(path: str, defaults: dict) -> list[dict]:
    """The input lines, checked: one error naming the line for anything that is not a
    request; a request whose values are refused carries its message in ``refused``."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read --input {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--input {path} is not UTF-8 text") from None
    requests, seen, first = [], set(), None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--input {path} line {n}"
        try:
            item = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise ConfigError(f"{where} is not JSON ({getattr(e, 'msg', 'nested too deep')})"
                              ) from None
        openai = openai_batch.is_openai(item)
        if first is None:
            first = (n, openai)
        elif openai != first[1]:
            formats = ("our format", "the OpenAI Batch format")
            raise ConfigError(f"{where} is in {formats[openai]} but line {first[0]} is in "
                              f"{formats[first[1]]}; one file holds one format")
        request = _openai(item, where, defaults) if openai else ours(item, where, defaults)
        if request["id"] in seen:
            raise ConfigError(f"{where}: id {request['id']!r} appears twice; ids must be "
                              "unique")
        seen.add(request["id"])
        requests.append(request)
    if not requests:
        raise ConfigError(f"--input {path} holds no requests (one JSON object per line)")
    return requests


def _openai(item: dict, where: str, defaults: dict) -> dict:
    """An OpenAI line: a line that is no request stops the job; one whose values are
    refused (:func:`.openai_batch.parse`) gets an error line."""
    try:
        request = openai_batch.parse(item, where, defaults)
    except (ConfigError, ValueError, TypeError, OverflowError) as e:
        if not _addressable(item):
            raise
        return {"id": str(item["custom_id"]), "format": "openai", "kind": openai_batch.URLS[
            item["url"]], "prompt": None, "messages": None, "stop": [], "model": None,
            "settings": dict(defaults), "refused": _message(e), "param": None}
    return request


def _addressable(item: dict) -> bool:
    """An OpenAI line that is a request of a served url: its faults are its own."""
    url = item.get("url")
    return ("custom_id" in item and isinstance(item.get("body"), dict) and
            isinstance(url, str) and url in openai_batch.URLS and
            item.get("method", "POST") == "POST")


def _message(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def ours(item, where: str, defaults: dict) -> dict:
    """A request in this command's own format (see the module docstring); its values are
    checked by :mod:`.request_checks`, the layer the server shares."""
    if not isinstance(item, dict) or "id" not in item:
        raise ConfigError(f"{where} needs an object with an \"id\"")
    key = str(item["id"])
    if ("prompt" in item) == ("messages" in item):
        raise ConfigError(f"{where}: give exactly one of \"prompt\" and \"messages\"")
    prompt = item.get("prompt")
    if prompt is not None and not (isinstance(prompt, str) and prompt.strip() or
                                   isinstance(prompt, list) and prompt and
                                   all(_is_int(t) for t in prompt)):
        raise ConfigError(f"{where}: \"prompt\" must be non-empty text or token ids")
    messages = item.get("messages")
    if messages is not None and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages)):
        raise ConfigError(f"{where}: \"messages\" must be a list of {{role, content}}")
    lengths = [name for name in LENGTHS if name in item]
    if len(lengths) > 1:
        raise ConfigError(f"{where}: give one of {', '.join(lengths)} (they are one setting)")
    settings = dict(defaults)
    if lengths:
        try:
            settings["gen_len"] = checks.max_tokens(item[lengths[0]], lengths[0])
        except checks.Refused as e:
            raise ConfigError(f"{where}: {e}") from None
    request = {"id": key, "format": "ours", "prompt": prompt, "messages": messages,
               "settings": settings, "refused": None, "param": None, "stop": []}
    try:
        unserved = [name for name in NOT_SERVED if name in item]
        if unserved:
            raise checks.Refused(f"not served: {', '.join(unserved)} (our format reads id, "
                                 "prompt or messages, gen_len, stop and "
                                 f"{', '.join(openai_batch.SAMPLING)})", unserved[0])
        if messages is not None:
            request["messages"] = message_checks.messages(messages)
        elif isinstance(prompt, str):
            checks.text(prompt, "prompt")
        for name, check in openai_batch.SAMPLING.items():  # token ids: checked once loaded
            if name in item:
                settings[name] = check(item[name], None)
        request["stop"] = checks.stops(item.get("stop"))
        _sampler_takes(settings)
    except checks.Refused as e:
        request["refused"], request["param"] = str(e), e.param
    return request


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sampler_takes(settings: dict) -> None:
    """The sampler's own checks, worded for a request's fields rather than the flags."""
    try:
        SamplingConfig(settings["temperature"], settings["top_p"], settings.get("seed", 0),
                       settings["repetition_penalty"], settings.get("top_k", -1),
                       settings.get("min_p", 0.0), settings.get("presence_penalty", 0.0),
                       settings.get("frequency_penalty", 0.0),
                       settings.get("logit_bias", ())).validate()
    except ConfigError as e:
        message = re.sub(r"--([a-z-]+)", lambda m: m[1].replace("-", "_"), str(e))
        field = message.split()[0]
        raise checks.Refused(message, field if field in settings else None) from None


# -- the output file -------------------------------------------------------------------------

def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (a link or another spelling included)."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return Path(a).resolve() == Path(b).resolve()


def _result_id(raw: bytes) -> str | None:
    """The id of a result or error line this command writes; None for anything else."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(row, dict):
        return None
    if "custom_id" in row and ("response" in row or "error" in row):
        return str(row["custom_id"])
    if "id" in row and ("text" in row or "error" in row):
        return str(row["id"])
    return None


def done_ids(path: str) -> set[str]:
    """Ids already in ``--output``. What a killed run left at the file's end (a last line cut
    short, damaged lines after the last result) is dropped with a warning and runs again; a
    file with damage before a result, or with no result at all, is refused in one line (it
    may be another file: it is left as it is)."""
    out = Path(path)
    if not out.is_file():
        return set()
    data = out.read_bytes()
    ids, good_end, damaged = set(), 0, None  # damaged: (line number, what) of the first one
    start, n = 0, 0
    while start < len(data):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end + 1
        raw, n = data[start:end], n + 1
        if raw.strip():
            key = _result_id(raw) if raw.endswith(b"\n") else None
            if key is None:
                damaged = damaged or (n, "cut short" if not raw.endswith(b"\n") and
                                      raw.lstrip().startswith(b"{") else "not a result line")
            elif damaged is not None:
                raise ConfigError(
                    f"--output {path} line {damaged[0]} is {damaged[1]} (not JSON with an "
                    f"\"id\" or \"custom_id\"); delete that line (its request runs again) "
                    "or give another --output")
            else:
                ids.add(key)
                good_end = end
        elif damaged is None:
            good_end = end
        start = end
    if damaged is None:
        return ids
    interrupted = damaged[1] == "cut short" and damaged[0] == n
    if not ids and not interrupted:
        raise ConfigError(f"--output {path} holds no result lines (line {damaged[0]} is "
                          f"{damaged[1]}); it is not this command's output: give a new file")
    with open(out, "r+b") as f:
        f.truncate(good_end)
    if not interrupted:
        print(f"warning: --output {path}: dropped its damaged end (from line {damaged[0]}, "
              f"{damaged[1]}); those requests run again", file=sys.stderr)
    return ids


def result_line(request: dict, ids: list[int], text: str, prompt_tokens: int,
                finish_reason: str, model: str) -> dict:
    """One answered request, in its format."""
    if request["format"] == "ours":
        return {"id": request["id"], "text": text, "token_ids": ids,
                "prompt_tokens": prompt_tokens, "finish_reason": finish_reason, "error": None}
    return openai_batch.response_line(request, text, len(ids), prompt_tokens, finish_reason,
                                      model)


def error_line(request: dict, message: str, code: str = INVALID) -> dict:
    """One failed request, in its format: the job goes on without it."""
    if request["format"] == "ours":
        return {"id": request["id"], "error": {"code": code, "message": message,
                                               "param": request.get("param")}}
    line = openai_batch.error_line(request, message)
    line["error"]["code"] = code
    return line
