"""Tool calls streamed as the model writes them, in OpenAI's delta shape.

A call's first delta carries its index, id, type and name (arguments ``""``); each later
delta carries the next piece of its arguments, as written. Content before the first call is
sent as it comes; a tail that could begin a call waits for the next piece.

A call streams once its head is read: ``{"name": "NAME", "arguments": `` (or
``"parameters"``; Llama 3.x) before an object or array, or Mistral's ``NAME[ARGS]``. Its
arguments are the characters of that JSON value, up to the bracket that closes it (a scan
that follows strings and escapes). Anything else (keys in another order, text between
calls, arguments given as a JSON string) is held, and the answer's calls go out whole at
its end, as :func:`.tool_calls.parse` reads them.

The arguments streamed are the model's text, so their concatenation is the JSON value the
unstreamed answer holds (equal once parsed; the unstreamed answer writes it back with
``json.dumps``). A call whose head went out but whose answer then fails to parse (cut by
``max_tokens``) cannot be taken back: the stream has sent what the model wrote.
"""
from __future__ import annotations

import json
import re
import uuid

from .tool_calls import MARKERS, parse

_NAME = r'"((?:[^"\\]|\\.)+)"'
HEADS = (re.compile(r'\{\s*"name"\s*:\s*' + _NAME + r'\s*,\s*"(?:arguments|parameters)"\s*:\s*'
                    r'(?=[{\[])'),
         re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z_][\w.\-]*)\[ARGS\](?=[{\[])"))
# what may stand between calls (markers, list punctuation, the close of a call's object)
_BETWEEN = re.compile(r"<tool_call>|</tool_call>|\[TOOL_CALLS\]|<\|python_tag\|>|[\s\[\],;}]")


class CallStream:
    """Streamed content and calls: :meth:`add` returns (content that is surely content,
    tool-call deltas); :meth:`finish` returns the same for the rest once the answer is whole,
    the calls that did not stream going out whole."""

    def __init__(self, fmt: str, names=()):
        self.fmt, self.marker, self.names = fmt, MARKERS[fmt], set(names)
        self.text = ""
        self.sent = 0  # characters of text released as content
        self.region: int | None = None  # where the calls begin (content stops there)
        self.at = 0  # how far the call scanner has read
        self.calls: list[list] = []  # [name, arguments streamed, whole] per streamed call
        self.held = False  # the scanner gave up: the rest goes out whole at the end
        self.scan: tuple[int, bool, bool] | None = None  # (depth, in a string, escaped)

    def add(self, piece: str) -> tuple[str, list[dict]]:
        self.text += piece
        content = self._content() if self.region is None else ""
        return content, self._calls() if self.region is not None and not self.held else []

    def _content(self) -> str:
        if self.sent == 0:
            lead = self.text.lstrip()
            # the answer may be a call (a JSON object, maybe after the marker): nothing of it
            # is content until it is known
            if not lead or self.marker.startswith(lead):
                return ""
            if lead.startswith(("{", self.marker)):
                self.region = self.at = len(self.text) - len(lead)
                return ""
        start = self.text.find(self.marker, self.sent)
        if start >= 0:
            self.region = self.at = start
        else:  # keep back a tail that could be the marker's beginning
            start = len(self.text)
            for n in range(min(len(self.marker) - 1, len(self.text) - self.sent), 0, -1):
                if self.marker.startswith(self.text[-n:]):
                    start = len(self.text) - n
                    break
        out = self.text[self.sent:start]
        self.sent = start
        return out

    def _calls(self) -> list[dict]:
        out = []
        while not self.held:
            if self.scan is None:  # between calls: the next head, or wait for it
                head = self._head()
                if head is None:
                    return out
                name, self.at = head
                self.calls.append([name, "", False])
                self.scan = (0, False, False)
                out.append({"index": len(self.calls) - 1, "id": f"call_{uuid.uuid4().hex[:24]}",
                            "type": "function", "function": {"name": name, "arguments": ""}})
                continue
            end, closed = self._value_end()
            piece, self.at = self.text[self.at:end], end
            if piece:
                self.calls[-1][1] += piece
                out.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
            if not closed:
                return out
            self.calls[-1][2], self.scan = True, None
        return out

    def _head(self) -> tuple[str, int] | None:
        found = [m for m in (h.search(self.text, self.at) for h in HEADS) if m]
        if not found:
            return None
        m = min(found, key=lambda m: m.start())
        gap = _BETWEEN.sub("", self.text[self.at:m.start()])
        name = m.group(1)
        if gap or (self.names and name not in self.names):
            self.held = True  # not a plain run of calls: parsed whole at the end
            return None
        return name, m.end()

    def _value_end(self) -> tuple[int, bool]:
        """Where the arguments' value read so far ends, and whether it has closed."""
        depth, quoted, escaped = self.scan
        for i in range(self.at, len(self.text)):
            c = self.text[i]
            if quoted:
                escaped, quoted = (False, True) if escaped else (c == "\\", c != '"')
            elif c == '"':
                quoted = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self.scan = (0, False, False)
                    return i + 1, True
        self.scan = (depth, quoted, escaped)
        return len(self.text), False

    def finish(self) -> tuple[str, list[dict]]:
        """(the content not yet sent, the deltas of the calls not yet sent)."""
        content, calls = parse(self.text, self.fmt, self.names)
        streamed = len(self.calls)
        if streamed and not self._agrees(calls):
            return "", []  # sent already; the rest is not a call (see the module's note)
        deltas = [{"index": i, **c} for i, c in enumerate(calls) if i >= streamed]
        if not calls:
            return self.text[self.sent:], []
        # the content sent already is the answer's text before its first call
        rest = (content or "")[self.sent:] if content and content.startswith(
            self.text[:self.sent]) else ""
        return rest, deltas

    def _agrees(self, calls: list[dict]) -> bool:
        """Whether the calls streamed are the first of ``calls``, name and arguments."""
        if len(calls) < len(self.calls):
            return False
        for (name, arguments, whole), call in zip(self.calls, calls):
            try:
                same = json.loads(arguments) == json.loads(call["function"]["arguments"])
            except ValueError:
                return False
            if not whole or name != call["function"]["name"] or not same:
                return False
        return True

    @property
    def called(self) -> bool:
        """A call went out while streaming."""
        return bool(self.calls)
