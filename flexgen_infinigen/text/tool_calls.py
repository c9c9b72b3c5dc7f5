"""Tool calls in a model's answer, written the way its family writes them, turned into
OpenAI's ``tool_calls`` (:mod:`.call_stream` streams them as they are written).

The format comes from the model's chat template (what it was trained to write):

- ``hermes`` (Qwen 2.5/3, Hermes, and others): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one block per call, text around them being content;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` per call;
- ``llama3``: the whole answer one JSON object ``{"name": ..., "parameters": {...}}``
  (after ``<|python_tag|>`` when the model writes it), calls separated by ``;``;
- ``harmony`` (gpt-oss): a message to ``functions.NAME`` (:mod:`.harmony` reads it).

Some models write the call's JSON without its tags (Qwen2.5-Coder writes
``{"name": ..., "arguments": ...}`` bare): an answer whose every line is such an object,
naming a tool the request offered, is taken as calls in any format.

Text that does not parse as a call stays content: a call cut short by ``max_tokens`` is
returned as the text the model wrote, never as a call with arguments made up.
"""
from __future__ import annotations

import json
import re
import uuid

from . import harmony

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
# where a call begins, by format (a stream holds text back from here)
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>"}


def format_of(template: str | None) -> str | None:
    """The tool-call format a chat template teaches (None: it shows no tools)."""
    if not template:
        return None
    if harmony.speaks(template):
        return "harmony"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return None


def _call(obj) -> dict | None:
    """OpenAI's tool call from a parsed ``{"name", "arguments" | "parameters"}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # already a JSON text: kept as the model wrote it, if valid
        try:
            json.loads(args)
        except ValueError:
            return None
        text = args
    else:
        text = json.dumps(args, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": text}}


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _bare(text: str, names) -> list[dict]:
    """Calls written as bare JSON objects, one a line, each naming an offered tool."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not names or not lines or not lines[0].lstrip().startswith("{"):
        return []
    calls = [_call(_json(line)) for line in lines]
    if any(c is None or c["function"]["name"] not in names for c in calls):
        return []
    return calls


def parse(text: str, fmt: str | None, names=()) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of an answer in format ``fmt``; content None when the answer
    is calls only. With no format, or no call that parses, the text is all content.
    ``names``: the tools offered (bare JSON calls count only when they name one)."""
    if fmt == "harmony":  # the analysis stays in the content here (assistant_message splits)
        _, content, calls = harmony.split(text, reasoning=False)
        return (content or None) if calls else text, calls
    if fmt is not None:
        bare = _bare(text, names)
        if bare:
            return None, bare
    if fmt == "hermes":
        calls, kept, last = [], [], 0
        for m in HERMES_CALL.finditer(text):
            call = _call(_json(m.group(1)))
            if call is None:
                return text, []  # one malformed call: the whole answer stays text
            calls.append(call)
            kept.append(text[last:m.start()])
            last = m.end()
        kept.append(text[last:])
        if not calls:
            return text, []
        content = "".join(kept).strip()
        return content or None, calls
    if fmt == "mistral":
        head, marker, rest = text.partition(MARKERS["mistral"])
        if not marker:
            return text, []
        calls = []
        if "[ARGS]" in rest:  # name[ARGS]{...} per call, each after its own marker
            for part in rest.split(MARKERS["mistral"]):
                name, _, args = part.partition("[ARGS]")
                call = _call({"name": name.strip(), "arguments": _json(args.strip())})
                if call is None or _json(args.strip()) is None:
                    return text, []
                calls.append(call)
        else:
            items = _json(rest.strip())
            items = items if isinstance(items, list) else [items]
            calls = [_call(i) for i in items]
            if not calls or any(c is None for c in calls):
                return text, []
        return head.strip() or None, calls
    if fmt == "llama3":
        body = text.strip()
        body = body[len(MARKERS["llama3"]):].strip() if body.startswith(MARKERS["llama3"]) \
            else body
        if not body.startswith("{"):
            return text, []
        calls = [_call(_json(part)) for part in body.split(";") if part.strip()]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, calls
    return text, []
