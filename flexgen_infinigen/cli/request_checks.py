"""Every value of one request, checked where the request is parsed: the validation layer that
``serve`` (:mod:`..serving.requests`) and ``batch`` (:mod:`.openai_batch`) share.

Each check returns the value as it will be used, or raises :class:`Refused` with a message
that names the field and what to send instead, and ``param``, the field as OpenAI's errors
name it (``max_tokens``, ``messages[0].content[1].text``). A value that passes cannot make the
engine fail:

- integers are JSON integers: a float (even ``16.0``), a boolean, Infinity or NaN is refused;
- numbers are finite;
- ``seed`` fits the sampler's 64-bit generator: ``-2**63`` to ``2**64 - 1``, what
  ``torch.Generator.manual_seed`` takes;
- ``top_p`` is at least float32's smallest normal (:data:`TOP_P_FLOOR`): the sampler keeps
  the tokens whose mass before them is below ``top_p``, compared in float32, and a smaller
  value rounds to 0 there and would keep none (``temperature`` 0 is the greedy choice);
- token ids are in the model's vocabulary, ``0`` to ``vocab_size - 1``;
- text is a string that UTF-8 can encode (a lone surrogate is refused by name);
- a message's ``role`` is one of :data:`ROLES`, its ``content`` a string or a list of text
  parts;
- ``top_k`` is an integer >= 0 or -1 (0 and -1: off, as vLLM takes them), ``min_p`` in
  [0, 1], ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] (OpenAI's),
  ``repetition_penalty`` above 0, ``logit_bias`` an object of token-id strings to numbers
  in [-100, 100], ``stop_token_ids`` a list of token ids, ``ignore_eos`` a boolean (the ids
  are checked against the vocabulary where its size is known).
"""
from __future__ import annotations


import math

from ..sampling import BIAS_LIMIT, PENALTY_LIMIT, SEED_MAX, SEED_MIN, TOP_P_FLOOR

ROLES = ("system", "developer", "user", "assistant", "tool")


class Refused(Exception):
    """A request value this runtime will not serve: the message names the field, ``param``
    is that field, ``code`` OpenAI's code where it has one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def _shown(value) -> str:
    """A short rendering of a refused value for a message (never the whole of a long one)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'list'}"
    text = repr(value)  # escapes surrogates, so the message itself is valid UTF-8
    return text if len(text) <= 40 else text[:37] + "..."


def _type_name(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "an object", type(None): "null"}.get(type(value),
                                                                        type(value).__name__)


def integer(value, param: str, low: int | None = None, high: int | None = None) -> int:
    """A JSON integer within ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise Refused(f"{param} must be an integer (got {_shown(value)})", param)
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"at least {low}" if high is None else f"from {low} to {high}" \
            if low is not None else f"at most {high}"
        raise Refused(f"{param} must be {span} (got {_shown(value)})", param)
    return value


def number(value, param: str) -> float:
    """A finite JSON number (an integer is taken as a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refused(f"{param} must be a number (got {_shown(value)})", param)
    try:
        out = float(value)
    except OverflowError:  # an integer too large for a float
        out = math.inf
    if not math.isfinite(out):
        raise Refused(f"{param} must be a finite number (got {_shown(value)})", param)
    return out


def max_tokens(value, param: str = "max_tokens") -> int:
    return integer(value, param, low=1)


def temperature(value) -> float:
    out = number(value, "temperature")
    if out < 0:
        raise Refused(f"temperature must be >= 0 (0 = greedy; got {_shown(value)})",
                      "temperature")
    return out


def top_p(value) -> float:
    out = number(value, "top_p")
    if not 0 < out <= 1:
        raise Refused(f"top_p must be in (0, 1] (got {_shown(value)})", "top_p")
    if out < TOP_P_FLOOR:
        raise Refused(f"top_p must be at least {TOP_P_FLOOR:.3g} (float32's smallest normal; "
                      f"a smaller one rounds to 0 and keeps no token); for the most likely "
                      f"token give temperature 0 (got {_shown(value)})", "top_p")
    return out


def seed(value) -> int:
    return integer(value, "seed", SEED_MIN, SEED_MAX)


def text(value, param: str) -> str:
    """A string that UTF-8 can encode."""
    if not isinstance(value, str):
        raise Refused(f"{param} must be a string (got {_type_name(value)})", param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Refused(f"{param} holds a lone surrogate (U+{ord(value[e.start]):04X} at "
                      f"character {e.start}), which is not Unicode text; send valid UTF-8",
                      param) from None
    return value


def model(value) -> str | None:
    """``model``: a string when given (None when absent)."""
    return None if value is None else text(value, "model")


def prompt(value, vocab_size: int | None = None) -> str | list[int]:
    """A completion's prompt: one non-empty text, or one list of token ids (in the
    vocabulary when its size is known)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str) and value:
        return text(value, "prompt")
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in value):
        return token_ids(value, vocab_size, "prompt")
    raise Refused("\"prompt\" must be one non-empty text or one list of token ids (several "
                  "prompts: one request each)", "prompt")


def token_ids(ids: list[int], vocab_size: int | None, param: str = "prompt") -> list[int]:
    """Ids the embedding can look up: none negative, none at or past ``vocab_size``."""
    high = None if vocab_size is None else vocab_size - 1
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or \
                (high is not None and t > high):
            limit = f"0 to {high}" if high is not None else "0 or more"
            raise Refused(f"{param}[{i}] is {_shown(t)}, not a token id of this model "
                          f"({limit})", param)
    return ids


def stops(value) -> list[str]:
    """``stop``: absent, one string, or a list of non-empty strings."""
    if value is None:
        return []
    listed = [value] if isinstance(value, str) else value
    if not isinstance(listed, list) or not all(isinstance(s, str) and s for s in listed):
        raise Refused("stop must be a string or a list of non-empty strings", "stop")
    return [text(s, "stop") for s in listed]


def room(prompt_len: int, asked: int, given: bool, context: int, param: str) -> int:
    """The tokens a request may generate: ``asked`` (cut to what the context has room for
    when the request did not set it); refused when the prompt leaves no room, or when a
    ``given`` length does not fit."""
    left = context - prompt_len
    if left < 1 or (given and asked > left):
        raise Refused(f"this model's maximum context length is {context} tokens; the prompt "
                      f"has {prompt_len}" + (f" and max_tokens asks for {asked}" if given
                                             else "") + "; shorten the prompt"
                      + (" or max_tokens" if given else ""), param,
                      "context_length_exceeded")
    return min(asked, left)


def top_k(value) -> int:
    """-1 or 0: every token (vLLM takes both); k >= 1: the k most likely."""
    return integer(value, "top_k", low=-1)


def min_p(value) -> float:
    out = number(value, "min_p")
    if not 0 <= out <= 1:
        raise Refused(f"min_p must be in [0, 1] (0 = off; got {_shown(value)})", "min_p")
    return out


def penalty(value, param: str) -> float:
    """``presence_penalty`` or ``frequency_penalty``: OpenAI's range, -2 to 2."""
    out = number(value, param)
    if not -PENALTY_LIMIT <= out <= PENALTY_LIMIT:
        raise Refused(f"{param} must be from -2 to 2 (got {_shown(value)})", param)
    return out


def repetition_penalty(value) -> float:
    out = number(value, "repetition_penalty")
    if out <= 0:
        raise Refused(f"repetition_penalty must be above 0 (1 = off; got {_shown(value)})",
                      "repetition_penalty")
    return out


def flag(value, param: str) -> bool:
    if not isinstance(value, bool):
        raise Refused(f"{param} must be true or false (got {_shown(value)})", param)
    return value


def logit_bias(value, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` -> ((id, bias), ...) sorted by id; biases from -100 to 100."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise Refused(f"logit_bias must be an object of token ids to numbers (got "
                      f"{_type_name(value)})", "logit_bias")
    out = {}
    for key, bias in value.items():
        where = f"logit_bias[{_shown(key)}]"
        if not isinstance(key, str) or not key.isascii() or not key.isdigit():
            raise Refused(f"logit_bias keys are token ids written as decimal strings (\"50256\"); "
                          f"got {_shown(key)}", "logit_bias")
        token = int(key)
        token_ids([token], vocab_size, "logit_bias")
        out[token] = number(bias, "logit_bias")
        if not -BIAS_LIMIT <= out[token] <= BIAS_LIMIT:
            raise Refused(f"{where} must be from -100 to 100 (got {_shown(bias)})", "logit_bias")
    return tuple(sorted(out.items()))


def stop_token_ids(value, vocab_size: int | None = None) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise Refused(f"stop_token_ids must be a list of token ids (got {_type_name(value)})",
                      "stop_token_ids")
    return tuple(token_ids(value, vocab_size, "stop_token_ids"))


MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}  # OpenAI's limits


def top_logprobs(kind: str, logprobs, top) -> int | None:
    """How many alternatives each token's log-probability entry lists (None: no entries),
    from a chat's ``logprobs: true`` and ``top_logprobs: N`` or a completion's
    ``logprobs: N``."""
    most = MAX_TOP_LOGPROBS[kind]
    if kind == "chat":
        if logprobs is not None and flag(logprobs, "logprobs"):
            n = 0 if top is None else top
        elif top is not None:
            raise Refused("top_logprobs needs logprobs: true", "top_logprobs")
        else:
            return None
    else:
        if top is not None:
            raise Refused("a completion takes logprobs: N (top_logprobs is the chat's)",
                          "top_logprobs")
        if logprobs is None:
            return None
        n = logprobs
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= most:
        raise Refused(f"the number of top log-probabilities must be 0 to {most}",
                      "top_logprobs" if kind == "chat" else "logprobs")
    return n
