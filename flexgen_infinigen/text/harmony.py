"""gpt-oss's answers in the harmony format, split into reasoning, content and tool calls.

A harmony answer is a run of messages, each a header, ``<|message|>`` and a body. The chat
template's generation prompt ends with ``<|start|>assistant``, so the answer opens with the
first message's header; later messages start with ``<|start|>assistant``. A header names a
channel (``<|channel|>analysis``) and may name a recipient (``to=functions.NAME``), before
or after the channel; ``<|constrain|>json`` or a bare ``json`` says the body's type. A body
ends at ``<|end|>`` (the answer goes on), ``<|return|>`` or ``<|call|>`` (the answer ends:
these are the model's stop tokens, so they never reach the text) or the text's end::

    <|channel|>analysis<|message|>User asks weather.<|end|><|start|>assistant<|channel|>
    commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}

- ``analysis`` bodies are the reasoning (``reasoning_content``);
- a body with a ``functions.NAME`` recipient is a call of NAME, its body the arguments;
- ``final`` bodies, and ``commentary`` bodies to no one (a preamble for the user), are
  the content.

The markers are the vocabulary's special tokens; the tokenizer keeps them in the decoded
text of a harmony model (:attr:`.tokenizer.Tokenizer.kept_ids`) so that they can be read
here. Text with no marker at all is content, as the model wrote it.
"""
from __future__ import annotations

import json
import re
import uuid

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)
# a body ends at one of these (START: a header that came without the body's end marker)
BODY_ENDS = (END, RETURN, CALL, START)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")


def speaks(template: str | None) -> bool:
    """Whether a chat template writes harmony (gpt-oss's)."""
    return bool(template) and CHANNEL in template and MESSAGE in template


def header(text: str) -> tuple[str, str | None]:
    """(channel, recipient or None) of a message's header (the text before ``<|message|>``,
    a leading ``<|start|>`` and role included)."""
    text = text.replace(START, "")
    found = _RECIPIENT.search(text)
    recipient = found.group(1) if found else None
    _, marker, after = text.partition(CHANNEL)
    channel = after.replace(CONSTRAIN, " ").split() if marker else []
    channel = [w for w in channel if not w.startswith("to=")]
    return (channel[0] if channel else ""), recipient


def _kind(channel: str, recipient: str | None, reasoning: bool, tools: bool) -> str:
    """Where a body goes: "call", "reasoning" or "content" (``tools``: calls are read)."""
    if tools and recipient is not None and recipient.startswith(FUNCTIONS) and \
            len(recipient) > len(FUNCTIONS):
        return "call"
    if channel == "analysis" and reasoning:
        return "reasoning"
    return "content"


def _new_call(name: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": ""}}


def _valid_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def split(text: str, reasoning: bool = True,
          tools: bool = True) -> tuple[str | None, str | None, list[dict]]:
    """(reasoning or None, content, tool calls) of a whole answer; the content is None when
    the answer is calls only. ``reasoning`` False: the analysis stays in the content
    (``--reasoning-format none``); ``tools`` False (none offered): a call's body is content.
    A call whose arguments are not JSON (cut short) is content, as written."""
    if _plain(text):
        return None, text, []
    thought, said, calls = [], [], []
    for channel, recipient, body in _messages(text):
        kind = _kind(channel, recipient, reasoning, tools)
        if kind == "call" and _valid_json(body.strip()):
            call = _new_call(recipient[len(FUNCTIONS):])
            call["function"]["arguments"] = body.strip()
            calls.append(call)
        elif kind == "reasoning":
            thought.append(body)
        else:
            said.append(body)
    content = "".join(said)
    return ("".join(thought) or None), (content or None) if calls else content, calls


def _messages(text: str):
    """(channel, recipient, body) of each message whose body began."""
    at = 0
    while True:
        opens = text.find(MESSAGE, at)
        if opens < 0:
            return
        channel, recipient = header(text[at:opens])
        begins = opens + len(MESSAGE)
        ends = [i for i in (text.find(m, begins) for m in BODY_ENDS) if i >= 0]
        ends = min(ends) if ends else len(text)
        yield channel, recipient, text[begins:ends]
        at = ends + next((len(m) for m in BODY_ENDS[:-1] if text.startswith(m, ends)), 0)


class HarmonyStream:
    """The split, piece by piece. :meth:`add` returns events that are final:
    ``("reasoning", text)``, ``("content", text)``, ``("call", {id, type, function})`` when
    a call's header is whole (its arguments "" so far) and ``("arguments", text)`` for the
    newest call. A tail that could begin a marker waits for the next piece."""

    def __init__(self, reasoning: bool = True, tools: bool = True):
        self.reasoning, self.tools = reasoning, tools
        self.buffer = ""  # a header not yet whole, or a body's tail that may begin a marker
        self.kind: str | None = None  # the body's kind while inside one (None: a header)
        self.seen = False  # a body has begun (the answer is harmony)
        self.calls = 0
        self.arguments = ""  # the newest call's arguments so far

    def add(self, piece: str) -> list[tuple[str, object]]:
        self.buffer += piece
        out = []
        while self.buffer:
            if self.kind is None:  # reading a header
                opens = self.buffer.find(MESSAGE)
                if opens < 0:
                    return out
                channel, recipient = header(self.buffer[:opens])
                self.buffer, self.seen = self.buffer[opens + len(MESSAGE):], True
                self.kind = _kind(channel, recipient, self.reasoning, self.tools)
                if self.kind == "call":
                    self.calls += 1
                    self.arguments = ""
                    out.append(("call", _new_call(recipient[len(FUNCTIONS):])))
                continue
            ends = [i for i in (self.buffer.find(m) for m in BODY_ENDS) if i >= 0]
            if ends:
                end = min(ends)
                self._body(self.buffer[:end], out)
                skip = 0 if self.buffer.startswith(START, end) else \
                    next(len(m) for m in BODY_ENDS if self.buffer.startswith(m, end))
                self.buffer, self.kind = self.buffer[end + skip:], None
                continue
            keep = _marker_tail(self.buffer)
            self._body(self.buffer[:len(self.buffer) - keep], out)
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return out
        return out

    def _body(self, text: str, out: list) -> None:
        if not text:
            return
        if self.kind == "call":
            self.arguments += text
            out.append(("arguments", text))
        else:
            out.append((self.kind, text))

    def finish(self) -> list[tuple[str, object]]:
        """The answer ended: what was held back, and whether the newest call's arguments
        are JSON (``("valid", bool)`` once a call was made)."""
        out = []
        if self.kind is not None:
            self._body(self.buffer, out)
        elif not self.seen and _plain(self.buffer):
            out.append(("content", self.buffer))  # no harmony at all
        self.buffer = ""
        if self.calls:
            out.append(("valid", _valid_json(self.arguments.strip())))
        return out


def _marker_tail(text: str) -> int:
    """Characters at the end of ``text`` that could begin a marker."""
    for n in range(min(max(len(m) for m in MARKERS) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in BODY_ENDS):
            return n
    return 0


def _plain(text: str) -> bool:
    """Text that is no harmony: the model wrote no channel or message marker."""
    return bool(text) and CHANNEL not in text and MESSAGE not in text
