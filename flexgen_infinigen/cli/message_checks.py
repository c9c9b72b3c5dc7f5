"""The checks of a chat's inputs: its messages (text content parts, tool calls and tool
results), the tools it offers and its ``tool_choice``, the template's keyword arguments and
documents. Each refuses with a :class:`~.request_checks.Refused` naming the field."""
from __future__ import annotations

import json

from .request_checks import ROLES, Refused, _shown, _type_name, text


def messages(value) -> list[dict]:
    """A chat: ``[{"role", "content"}]`` with content as text (text parts are joined)."""
    if not isinstance(value, list) or not value:
        raise Refused("\"messages\" must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise Refused(f"{where} must be an object with \"role\" and \"content\"", where)
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        for key in ("role",) if calls else ("role", "content"):
            if key not in m:
                raise Refused(f"{where}.{key} is missing: every message needs \"role\" and "
                              "\"content\"", f"{where}.{key}")
        role = m["role"]
        if not isinstance(role, str) or role not in ROLES:
            raise Refused(f"{where}.role must be one of {', '.join(ROLES)} (got "
                          f"{_shown(role)})", f"{where}.role")
        content = m.get("content")
        message = {"role": role,
                   "content": "" if calls and content is None else
                   _content(content, f"{where}.content")}
        if calls:
            message["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        if role == "tool" and m.get("tool_call_id") is not None:
            message["tool_call_id"] = text(m["tool_call_id"], f"{where}.tool_call_id")
        out.append(message)
    return out


def _tool_calls(value, where: str) -> list[dict]:
    """An assistant message's ``tool_calls``, as a chat template reads them: each
    ``{"id", "type": "function", "function": {"name", "arguments"}}`` with its arguments as
    an object (OpenAI sends a JSON text; templates write the object with ``tojson``)."""
    if not isinstance(value, list) or not value:
        raise Refused(f"{where} must be a non-empty list", where)
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise Refused(f"{where}[{j}] must be {{\"type\": \"function\", \"function\": "
                          "{\"name\", \"arguments\"}}", f"{where}[{j}]")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise Refused(f"{where}[{j}].function.arguments is not JSON",
                              f"{where}[{j}].function.arguments") from None
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def tools(value) -> list[dict] | None:
    """``tools``: functions the model may call, ``[{"type": "function", "function":
    {"name", "description", "parameters"}}]``."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise Refused(f"tools must be a list (got {_type_name(value)})", "tools")
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or \
                not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not fn["name"]:
            raise Refused(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                          "{\"name\", \"description\", \"parameters\"}}", f"tools[{i}]")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise Refused(f"tools[{i}].function.parameters must be a JSON schema object",
                          f"tools[{i}].function.parameters")
    return value or None


def tool_choice(value, offered: list[dict] | None) -> str:
    """``tool_choice``: ``auto`` (default), ``none``, ``required`` or a named function
    (``"named"``); the last two hold the answer to a call through a grammar
    (:func:`..serving.parse.grammar_of`, which checks a named function's shape)."""
    if value is None or value == "auto":
        return "auto"
    if value == "none":
        return "none"
    if value == "required":
        return "required"
    if isinstance(value, dict):
        return "named"
    raise Refused(f"tool_choice must be \"auto\", \"none\", \"required\" or a named "
                  f"function (got {_shown(value)})", "tool_choice")


def _content(content, where: str) -> str:
    if isinstance(content, list):  # content parts: text only
        pieces = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else None
                raise Refused(f"{where}[{j}].type is {_shown(kind)}: only text content parts "
                              "are served (no images or audio)", f"{where}[{j}].type")
            pieces.append(text(part.get("text"), f"{where}[{j}].text"))
        return "".join(pieces)
    if not isinstance(content, str):
        raise Refused(f"message content must be text ({where} is {_type_name(content)})",
                      where)
    return text(content, where)



def template_kwargs(value) -> dict | None:
    """``chat_template_kwargs``: an object of names the chat template reads
    (``enable_thinking``)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise Refused(f"chat_template_kwargs must be an object (got {_type_name(value)})",
                      "chat_template_kwargs")
    return value


def documents(value) -> list[dict] | None:
    """``documents``: a list of objects (``{"title", "text"}``) for a template that cites them."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(d, dict) for d in value):
        raise Refused("documents must be a list of objects", "documents")
    return value
