"""A thinking model's reasoning split from its answer, as llama-server, vLLM and SGLang
return it (``reasoning_content``).

Models that think (Qwen3, DeepSeek-R1 and their kind) write ``<think>reasoning</think>``
before the answer; their chat template shows the tags. Some templates open the thought in
the prompt (the generation prompt ends with ``<think>``): the answer then starts inside it,
and everything up to ``</think>`` is reasoning, all of it when ``</think>`` never comes (cut
by ``max_tokens``). Otherwise an answer is reasoning only when it opens with ``<think>``.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None) -> bool:
    """Whether a chat template teaches the ``<think>`` tags."""
    return bool(template) and CLOSE in template


def mode(template: str | None, tokenizer, ids: list[int]) -> str | None:
    """How an answer to the prompt ``ids`` holds its reasoning: None (the template shows no
    thought), "inside" (the prompt's last tokens open the thought) or "outside"."""
    if not thinks(template):
        return None
    return "inside" if tokenizer.decode(ids[-4:]).rstrip().endswith(OPEN) else "outside"


def split(text: str, inside: bool) -> tuple[str | None, str]:
    """(reasoning or None, content) of an answer; ``inside``: the prompt opened the
    thought."""
    if not inside:
        stripped = text.lstrip()
        if not stripped.startswith(OPEN):
            return None, text
        text = stripped[len(OPEN):]
    reasoning, close, content = text.partition(CLOSE)
    return reasoning.strip("\n") or None, content.lstrip("\n") if close else ""


class ThinkStream:
    """The split, piece by piece: :meth:`add` returns (reasoning, content) text that is
    final; a tail that could begin a tag waits for the next piece."""

    def __init__(self, inside: bool):
        self.mode = "think" if inside else "start"
        self.buffer = ""
        self.fresh = True  # at the start of reasoning or of content: leading newlines go

    def add(self, piece: str) -> tuple[str, str]:
        self.buffer += piece
        reasoning = content = ""
        if self.mode == "start":
            lead = self.buffer.lstrip()
            if OPEN.startswith(lead):  # still could be the opening tag
                return "", ""
            if lead.startswith(OPEN):
                self.mode, self.buffer = "think", lead[len(OPEN):]
            else:
                self.mode = "content"
        if self.mode == "think":
            at = self.buffer.find(CLOSE)
            if at >= 0:
                reasoning, self.buffer = self.buffer[:at], self.buffer[at + len(CLOSE):]
                self.mode, done = "content", True
            else:
                keep = next((n for n in range(min(len(CLOSE) - 1, len(self.buffer)), 0, -1)
                             if CLOSE.startswith(self.buffer[-n:])), 0)
                reasoning = self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                done = False
            reasoning = self._trim(reasoning)
            if done:
                self.fresh = True
        if self.mode == "content":
            content, self.buffer = self._trim(self.buffer), ""
        return reasoning, content

    def _trim(self, text: str) -> str:
        if self.fresh:
            text = text.lstrip("\n")
            self.fresh = not text
        return text

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning inside an unclosed thought, else content."""
        rest, self.buffer = self.buffer, ""
        if self.mode == "think":
            return self._trim(rest), ""
        return "", self._trim(rest)
