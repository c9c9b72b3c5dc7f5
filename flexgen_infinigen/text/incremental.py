"""Text that grows one token at a time, released only where it can no longer change.

A token's text is not always final when it arrives: a byte-level token may hold half of a
UTF-8 character (decoded as U+FFFD until the rest comes), and a stop string may be starting
at the end of the text (``stop=["\\n\\n"]`` after one newline). :class:`TextStream` decodes
the whole sequence again at every token (the only decoding that equals the final text's) and
hands out the part before anything still undecided.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stops: list[str] | tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.ids: list[int] = []
        self.text = ""  # the decoded text so far (cut at a stop string once one is found)
        self.sent = 0  # characters of ``text`` released
        self.stopped = False  # a stop string was found: ``text`` ends before it

    def add(self, token_id: int) -> str:
        """Take one more token; return the text that became final (may be empty)."""
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        self.text = self.tokenizer.decode(self.ids)
        cut = self._first_stop()
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._undecided())

    def finish(self) -> str:
        """The sequence ended: everything not yet released."""
        return self._release(len(self.text))

    def _first_stop(self) -> int | None:
        # a stop string may only end inside the unreleased part, so search from just before it
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _undecided(self) -> int:
        """Characters at the end that may still change: an unfinished character, or the
        longest beginning of a stop string."""
        tail = len(self.text) - len(self.text.rstrip(REPLACEMENT))
        text = self.text[:len(self.text) - tail]
        held = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return tail + held

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out
