"""Chat templates rendered as transformers' ``apply_chat_template`` renders them, so that a
model sees the prompt it was trained on: a sandboxed Jinja environment with ``trim_blocks``,
``lstrip_blocks`` and loop controls (``{% break %}``, ``{% continue %}``), a ``tojson`` that
keeps non-ASCII text and does not escape HTML, ``strftime_now``, ``raise_exception``; the
messages, ``tools``, ``documents``, ``add_generation_prompt`` and the caller's template
keyword arguments (``enable_thinking``) as the template's variables.

Templates come from model repositories and clients: untrusted code, hence the sandbox (which
refuses ``_``-prefixed attributes and methods that change their object)."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from ..config import ConfigError

# Variables the renderer sets itself; template keyword arguments may not replace them (in
# transformers they would collide with its own keyword arguments: a TypeError).
RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
# Older names of a message's reasoning; templates read ``reasoning_content`` (and gpt-oss's
# ``thinking``), so each is filled from the first one a message has, as transformers does.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateInputError(ConfigError):
    """A request's input that the template cannot take; ``param`` names the request field
    (``chat_template_kwargs``, ``tools``, ``documents`` or ``messages``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class _Refused(Exception):
    """``raise_exception`` in a template: the template refuses the conversation."""


def _raise_exception(message):
    raise _Refused(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson writes <, >, & and ' as \u003c... (HTML-safe) and escapes non-ASCII;
    # models were trained on prompts rendered by json.dumps with these arguments.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)  # local time, as transformers renders it


class _DictMaker:
    """``dict(...)`` and ``dict.fromkeys(...)`` in templates, without handing the template the
    ``dict`` type itself (whose attributes are a way to reach other types)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=1)
def _environment():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class SafeNamespace(Namespace):
        """``namespace()`` whose attribute names may not start with ``_``: a namespace answers
        attribute lookups from its own items, so ``ns.__class__`` could otherwise be set."""

        def __init__(*args, **kwargs):  # noqa: N805 (Namespace's signature: self may be a key)
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                SafeNamespace.check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            SafeNamespace.check(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not set {name!r} on a namespace")

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers' mark of the assistant's
        text (for training masks); a prompt renders its body as it is."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, Generation])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_DictMaker(), namespace=SafeNamespace)
    return env


@lru_cache(maxsize=16)
def compile_template(template: str):
    """The compiled template (cached: a server renders the same one for every request); one
    clear error when it does not parse."""
    from jinja2 import TemplateError

    try:
        return _environment().from_string(template)
    except TemplateError as e:
        raise ConfigError(f"the chat template does not parse ({e})") from None


def normalized_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: keys whose value is None dropped
    (clients send ``"content": null`` beside ``tool_calls``, which templates test with
    ``is defined``), and the reasoning filled under each name templates read."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_template(template: str, messages: list[dict], *, add_generation_prompt: bool,
                    variables: dict, tools=None, documents=None,
                    template_kwargs: dict | None = None) -> str:
    """The template's text for ``messages``. ``variables`` (the tokenizer's special tokens)
    come first; ``template_kwargs`` may replace them but not the reserved names."""
    from jinja2 import TemplateError

    kwargs = dict(template_kwargs or {})
    clash = [k for k in RESERVED if k in kwargs]
    if clash:
        raise TemplateInputError(f"chat_template_kwargs may not set {clash[0]!r}; it is "
                                 "given by the request itself", "chat_template_kwargs")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TemplateInputError("documents must be a list of objects (such as "
                                 "{\"title\": ..., \"text\": ...})", "documents")
    compiled = compile_template(template)
    try:
        return compiled.render(**{**variables, **kwargs}, messages=normalized_messages(messages),
                               tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt)
    except _Refused as e:
        raise ConfigError(f"the model's chat template refused the conversation: {e}") from None
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError,
            ArithmeticError) as e:  # a template's own slip on this input: not a server fault
        raise ConfigError(f"the model's chat template cannot be rendered ({e})") from None
