"""Grammar-constrained sampling: ``response_format`` ``json_object`` and ``json_schema``, and
``tool_choice`` ``required`` or a named function, enforced token by token.

The grammars are llguidance's (the library llama.cpp and vLLM use): it compiles a JSON
schema or a Lark grammar against the model's own ``tokenizer.json`` and, at each step,
gives the set of tokens that keep the answer inside the grammar. It was chosen over xgrammar
because it needs no torch or transformers tokenizer (it reads ``tokenizer.json``), ships one
wheel for every Python, and reports a schema it cannot compile with a reason a client can
read. A row's mask is applied in the block's sampler to that row alone
(:class:`~.rows.RowChooser`): constrained and free rows share a block, and a free row's
tokens are the ones it would have alone.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from .requests import ApiError


# A harmony call's arguments written as gpt-oss's template writes them (``tojson``): one
# space after each separator and no other whitespace, which also keeps a model from
# spending its tokens on whitespace that JSON allows
COMPACT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                          "key_separator": ": "}}


def _library():
    try:
        import llguidance
    except ImportError:
        raise ApiError(400, "structured output needs llguidance: pip install "
                            "'flexgen_infinigen[serve]'", param="response_format") from None
    return llguidance


class Grammars:
    """The served model's grammar compiler: its tokenizer (the store's ``tokenizer.json``,
    the model's vocabulary size and end tokens) read once, when a request first needs it."""

    def __init__(self, lm):
        self.lm = lm
        self._tokenizer = None
        self._lock = threading.Lock()  # parsing runs in worker threads

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                store = self.lm.store_path
                path = Path(store) / "tokenizer.json" if store is not None else None
                if path is None or not path.is_file():
                    raise ApiError(400, "structured output needs the model's tokenizer.json, "
                                        "which this model's store does not hold",
                                   param="response_format")
                self._tokenizer = _library().LLTokenizer(
                    str(path), n_vocab=self.lm.cfg.vocab_size,
                    eos_token=sorted(self.lm.stop_token_ids))
            return self._tokenizer

    def response_format(self, value) -> str | None:
        """The grammar ``response_format`` asks for (None: plain text), checked: a schema the
        library cannot compile is a 400 with its reason."""
        if value is None or value == {"type": "text"}:
            return None
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            schema = {"type": "object"}
        elif kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ApiError(400, "response_format.json_schema must be an object with a "
                                    "\"schema\" object", param="response_format.json_schema")
            schema = spec.get("schema", {})
        else:
            raise ApiError(400, "response_format.type must be text, json_object or "
                                f"json_schema (got {kind!r})", param="response_format.type")
        return self._checked(self._from_schema(schema), "response_format")

    def tool_call(self, tools: list[dict], name: str | None, fmt: str | None) -> str:
        """A grammar for one call, in the template's format, of the named tool (None: any
        offered tool), its arguments held to the tool's ``parameters`` schema."""
        if fmt not in ("hermes", "harmony"):
            raise ApiError(400, "tool_choice \"required\" or a named function is served for "
                                "models whose template writes <tool_call> blocks or harmony "
                                "(gpt-oss)", param="tool_choice")
        chosen = [t for t in tools if name is None or t["function"]["name"] == name]
        if not chosen:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools",
                           param="tool_choice")
        if fmt == "harmony":  # a commentary message to the function, its body the arguments
            lit = self._literal
            calls = [f'call{i}: {lit("<|channel|>")} '
                     f'{json.dumps("commentary to=functions." + t["function"]["name"] + " ")} '
                     f'{lit("<|constrain|>")} "json" {lit("<|message|>")} args{i}\n'
                     f'args{i}: %json {json.dumps({**_parameters(t), **COMPACT})}\n'
                     for i, t in enumerate(chosen)]
            lark = f"start: {' | '.join(f'call{i}' for i in range(len(chosen)))}\n" + \
                "".join(calls)
            return self._checked(_library().LLMatcher.grammar_from_lark(lark), "tool_choice")
        schema = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]},
            "arguments": _parameters(t)},
            "required": ["name", "arguments"], "additionalProperties": False}
            for t in chosen]}
        lark = (f'start: {self._literal("<tool_call>")} "\\n" call "\\n" '
                f'{self._literal("</tool_call>")}\n'
                f"call: %json {json.dumps(schema)}\n")
        return self._checked(_library().LLMatcher.grammar_from_lark(lark), "tool_choice")

    def _literal(self, text: str) -> str:
        """``text`` in a Lark grammar: the special token it is in this vocabulary (a model
        writes ``<tool_call>`` as one token, which no byte string matches), else quoted."""
        tok = self.tokenizer()
        ids = tok.tokenize_str(text, parse_special=True)
        if len(ids) == 1 and tok.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def _from_schema(self, schema: dict) -> str:
        try:
            return _library().LLMatcher.grammar_from_json_schema(schema)
        except ValueError as e:
            raise ApiError(400, f"the schema cannot be compiled: {e}",
                           param="response_format") from None

    def _checked(self, grammar: str, param: str) -> str:
        why = _library().LLMatcher.validate_grammar(grammar, self.tokenizer())
        if why and not why.startswith("WARNING"):
            raise ApiError(400, f"the schema cannot be compiled: {why}", param=param)
        return grammar

    def constraint(self, grammar: str) -> "Constraint":
        return Constraint(_library().LLMatcher(self.tokenizer(), grammar, log_level=0))


def _parameters(tool: dict) -> dict:
    """A tool's arguments schema (any object when it gives none)."""
    return tool["function"].get("parameters") or {"type": "object"}


class Constraint:
    """One answer's grammar state: the mask of its next token, and each token taken."""

    def __init__(self, matcher):
        self.matcher = matcher

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [1, vocab] with every token the grammar forbids at -inf."""
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()),
                                   dtype=torch.uint8)[:logits.shape[-1]].bool()
        return logits.masked_fill(~allowed, float("-inf"))

    def take(self, token: int) -> str | None:
        """The chosen token goes into the grammar; the reason when it cannot."""
        if self.matcher.is_stopped() or self.matcher.consume_token(token):
            return None
        return f"the answer left its grammar: {self.matcher.get_error()}"
