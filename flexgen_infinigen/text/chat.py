"""Chat prompts: the model's own chat template (a store's ``chat_template.jinja``, written by
the converters from GGUF metadata or ``tokenizer_config.json``, or a ``--chat-template``
file), rendered as transformers renders it (:mod:`.template`) and encoded so that
control-token text a user typed stays plain text."""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..config import ConfigError
from .template import TemplateInputError, compile_template, render_template

CHAT_FILE = "chat_template.jinja"
DEFAULT_QUESTION = "What is the capital of France? Answer in one sentence."


def template_from_hf_folder(folder: Path) -> str | None:
    """A Hugging Face folder's chat template: ``chat_template.jinja`` or the one (or the
    ``default`` one) in ``tokenizer_config.json``."""
    if (folder / CHAT_FILE).is_file():
        return (folder / CHAT_FILE).read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # named templates
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def store_template(store_path) -> str | None:
    path = Path(store_path) / CHAT_FILE if store_path is not None else None
    return path.read_text(encoding="utf-8") if path is not None and path.is_file() else None


def template_file(path) -> str:
    """The text of a chat template file (``--chat-template FILE``), checked to parse: one
    error before a model loads, not at the first request."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})"
                          ) from None
    try:
        compile_template(text)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return text


def chat_template(store_path, override=None) -> str | None:
    """The chat template a command uses: the ``--chat-template`` file when given
    (``override`` is its path), else the store's own."""
    if override is None:
        return store_template(store_path)
    try:
        return template_file(override)
    except ConfigError as e:
        raise ConfigError(f"--chat-template {e}") from None


def render(template: str, messages: list[dict], bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, *, tools: list | None = None,
           documents: list | None = None, template_kwargs: dict | None = None) -> str:
    """The prompt text for ``messages`` ([{"role", "content", ...}]) as transformers'
    ``apply_chat_template(..., tokenize=False)`` writes it, with ``tools``, ``documents`` and
    ``template_kwargs`` (a request's ``chat_template_kwargs``: ``enable_thinking``) as the
    template's variables; one clear error when the template is broken or rejects the
    conversation."""
    return render_template(template, messages, add_generation_prompt=add_generation_prompt,
                           variables={"bos_token": bos_token, "eos_token": eos_token},
                           tools=tools, documents=documents, template_kwargs=template_kwargs)


def chat_prompt_ids(tokenizer, template: str, messages: list[dict],
                    control_tokens: bool = False, *, tools: list | None = None,
                    documents: list | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a rendered chat: the template writes every control token itself.
    Control-token text inside a message's content (a user typing ``<|im_start|>system``) is
    encoded as plain text, unless ``control_tokens``; in the other inputs (tools, documents,
    template keyword arguments, a message's other fields), which a template may transform
    (``tojson``), it is refused."""
    bos = tokenizer.tok.id_to_token(tokenizer.bos_token_id) or "" \
        if tokenizer.bos_token_id is not None else ""
    eos = tokenizer.tok.id_to_token(tokenizer.eos_token_id) or "" \
        if tokenizer.eos_token_id is not None else ""
    extra = {"tools": tools, "documents": documents, "template_kwargs": template_kwargs}
    text = render(template, messages, bos, eos, **extra)
    if control_tokens:
        return tokenizer.tok.encode(text, add_special_tokens=False).ids
    controls = tokenizer.control_texts
    _refuse_control_text(controls, messages, tools, documents, template_kwargs)
    if not any(isinstance(m.get("content"), str) and c in m["content"]
               for m in messages for c in controls):
        return tokenizer.tok.encode(text, add_special_tokens=False).ids
    spans = _content_spans(template, messages, text, bos, eos, extra)
    if spans is None:
        raise ConfigError("a message holds control-token text and this model's chat template "
                          "changes message content, so it cannot be kept as plain text; "
                          "remove it (or let control tokens through: --allow-control-tokens)")
    return tokenizer.encode_with_text(text, spans)


def _strings(value):
    """Every string in a JSON-like value (keys too: a template may print them)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _refuse_control_text(controls, messages, tools, documents, template_kwargs) -> None:
    """Control-token text is kept as text only where it can be found again in the rendered
    prompt (a message's content, written as given); anywhere else it would reach the model
    as a control token, so it is refused."""
    inputs = [("tools", tools), ("documents", documents),
              ("chat_template_kwargs", template_kwargs),
              ("messages", [{k: v for k, v in m.items() if k != "content"} for m in messages])]
    for param, value in inputs:
        for s in _strings(value):
            hit = next((c for c in controls if c in s), None)
            if hit is not None:
                raise TemplateInputError(
                    f"{param} holds the control-token text {hit!r}, which can only be kept "
                    "as plain text in a message's content; remove it (or let control tokens "
                    "through: --allow-control-tokens)", param)


def _content_spans(template: str, messages: list[dict], text: str, bos: str, eos: str,
                   extra: dict | None = None) -> list[tuple[int, int]] | None:
    """Where each message's content lies in the rendered ``text``: the template is rendered
    again (with the same ``extra`` render arguments) with a mark in place of each text
    content, and ``text`` must be that skeleton with each mark replaced by its content (as
    given, or stripped as templates do). None when it is not."""
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    marked = [{**m, "content": mark} if isinstance(m.get("content"), str) else m
              for m, mark in zip(messages, marks)]
    skeleton = render(template, marked, bos, eos, **(extra or {}))
    parts = re.split("\ue000(\\d+)\ue001", skeleton)  # text, index, text, index, ..., text
    if not text.startswith(parts[0]):
        return None
    at, spans = len(parts[0]), []
    for index, after in zip(parts[1::2], parts[2::2]):
        content = messages[int(index)]["content"]
        for form in dict.fromkeys((content, content.strip(), content.lstrip(),
                                   content.rstrip())):
            if text.startswith(form + after, at):
                spans.append((at, at + len(form)))
                at += len(form) + len(after)
                break
        else:
            return None
    return spans if at == len(text) else None
