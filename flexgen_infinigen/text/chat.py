"""Chat prompts: the model's own chat template, rendered with jinja2 in a sandbox (as the
ecosystem renders them), from a store's ``chat_template.jinja`` (written by the converters
from GGUF metadata or ``tokenizer_config.json``)."""
from __future__ import annotations

import json
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


def chat_prompt_ids(tokenizer, template: str, messages: list[dict]) -> list[int]:
    """Token ids of a rendered chat: the template writes every special token itself."""
    bos = tokenizer.tok.id_to_token(tokenizer.bos_token_id) or "" \
        if tokenizer.bos_token_id is not None else ""
    eos = tokenizer.tok.id_to_token(tokenizer.eos_token_id) or "" \
        if tokenizer.eos_token_id is not None else ""
    text = render(template, messages, bos, eos)
    return tokenizer.tok.encode(text, add_special_tokens=False).ids
