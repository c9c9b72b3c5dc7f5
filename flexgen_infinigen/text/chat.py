"""Chat prompts: the model's own chat template, rendered with jinja2 in a sandbox (as the
ecosystem renders them), from a store's ``chat_template.jinja`` (written by the converters
from GGUF metadata or ``tokenizer_config.json``)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..config import ConfigError

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


def render(template: str, messages: list[dict], bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True) -> str:
    """The prompt text for ``messages`` ([{"role", "content"}]); one clear error when the
    template is broken or rejects the conversation."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ConfigError(f"the model's chat template refused the conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token)
    except TemplateError as e:
        raise ConfigError(f"the model's chat template cannot be rendered ({e})") from None


def chat_prompt_ids(tokenizer, template: str, messages: list[dict],
                    control_tokens: bool = False) -> list[int]:
    """Token ids of a rendered chat: the template writes every control token itself.
    Control-token text inside a message's content (a user typing ``<|im_start|>system``) is
    encoded as plain text, unless ``control_tokens``."""
    bos = tokenizer.tok.id_to_token(tokenizer.bos_token_id) or "" \
        if tokenizer.bos_token_id is not None else ""
    eos = tokenizer.tok.id_to_token(tokenizer.eos_token_id) or "" \
        if tokenizer.eos_token_id is not None else ""
    text = render(template, messages, bos, eos)
    if control_tokens or not any(c in m["content"] for m in messages
                                 for c in tokenizer.control_texts):
        return tokenizer.tok.encode(text, add_special_tokens=False).ids
    spans = _content_spans(template, messages, text, bos, eos)
    if spans is None:
        raise ConfigError("a message holds control-token text and this model's chat template "
                          "changes message content, so it cannot be kept as plain text; "
                          "remove it (or let control tokens through: --allow-control-tokens)")
    return tokenizer.encode_with_text(text, spans)


def _content_spans(template: str, messages: list[dict], text: str, bos: str,
                   eos: str) -> list[tuple[int, int]] | None:
    """Where each message's content lies in the rendered ``text``: the template is rendered
    again with a mark in place of each content, and ``text`` must be that skeleton with each
    mark replaced by its content (as given, or stripped as templates do). None when it is
    not."""
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    skeleton = render(template, [{**m, "content": mark} for m, mark in zip(messages, marks)],
                      bos, eos)
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
