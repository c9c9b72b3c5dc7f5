"""``/tokenize`` and ``/detokenize``: the served model's tokenizer over HTTP, in the shapes
llama-server and vLLM give them, so that a client can count a prompt's tokens (or see its
chat template's ids) without running it.

- ``/tokenize`` takes ``content`` (llama-server) or ``prompt`` (vLLM), or ``messages`` (a chat,
  through the model's template, as a chat completion would encode it), and answers
  ``{"tokens", "count", "max_model_len"}``; ``with_pieces: true`` adds each token's text.
- ``/detokenize`` takes ``tokens`` and answers ``{"content", "prompt"}`` (the same text under
  both names).

Text is checked as a request's text is (:mod:`..cli.request_checks`): control-token text is
encoded as text unless the server allows control tokens, ids must be in the vocabulary.
"""
from __future__ import annotations

from ..cli import message_checks
from ..cli import request_checks as checks
from .requests import ApiError


def _refused(e: checks.Refused) -> ApiError:
    return ApiError(400, str(e), param=e.param, code=e.code)


def _tokenizer(lm):
    if lm.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: its prompts are token ids")
    return lm.tokenizer


def tokenize(body, lm, template: str | None, control_tokens: bool,
             context: int | None = None) -> dict:
    from ..text.chat import chat_prompt_ids

    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    tokenizer = _tokenizer(lm)
    given = [k for k in ("content", "prompt", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise ApiError(400, "give one of \"content\", \"prompt\" (a text) or \"messages\" (a "
                            "chat)", param=given[1] if len(given) > 1 else "content")
    field = given[0]
    pieces = body.get("with_pieces", False)
    if not isinstance(pieces, bool):
        raise ApiError(400, "with_pieces must be true or false", param="with_pieces")
    try:
        if field == "messages":
            if template is None:
                raise ApiError(400, "this model has no chat template; tokenize a text",
                               param="messages")
            ids = chat_prompt_ids(tokenizer, template, message_checks.messages(body["messages"]),
                                  control_tokens=control_tokens)
        else:
            ids = tokenizer.encode(checks.text(body[field], field),
                                   control_tokens=control_tokens)
    except checks.Refused as e:
        raise _refused(e) from None
    out = {"tokens": ids, "count": len(ids), "max_model_len": context or lm.cfg.max_positions}
    if pieces:
        out["pieces"] = [tokenizer.decode([t]) for t in ids]
    return out


def detokenize(body, lm) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    tokenizer = _tokenizer(lm)
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise ApiError(400, "\"tokens\" must be a list of token ids", param="tokens")
    try:
        checks.token_ids(ids, lm.cfg.vocab_size, "tokens")
    except checks.Refused as e:
        raise _refused(e) from None
    text = tokenizer.decode(ids)
    return {"content": text, "prompt": text}
