"""A body's answers as Server-Sent Events: one ``data:`` chunk per piece of text, each
choice's chunks carrying its ``index`` (``n`` > 1, a list of prompts), interleaved as the rows
make them, then the usage chunk when asked, then ``data: [DONE]``. A client that goes away
cancels every row of its body at the engine's next step."""
from __future__ import annotations

import asyncio
import json

from starlette.requests import Request

from ..text.call_stream import CallStream
from ..text.harmony import HarmonyStream
from ..text.reasoning import ThinkStream
from .guard import log, server_error
from .requests import ServeRequest, usage

GONE = ("gone", None, None)  # the event that says the client has disconnected


async def watch(served: list[ServeRequest], request: Request) -> None:
    """Waits for the client to disconnect, then cancels its rows and wakes the handler.
    After the body, the next message of a request is its disconnect: this sees it at once,
    where a check between events would wait for an event to come."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for one in served:
        one.cancelled.set()  # the engine drops the row at its next step
        one.events.put_nowait(GONE)


class ChoiceStream:
    """One choice's events turned into its chunks: the role first (a chat), a thinking
    model's reasoning as its own deltas, tool calls as they are written (a call whose
    form the stream cannot follow goes out whole at the end)."""

    def __init__(self, served: ServeRequest):
        self.served, self.done = served, False
        self.role_sent = served.kind != "chat"
        names = {t["function"]["name"] for t in served.tools or ()}
        self.harmony = HarmonyStream(served.reasoning == "harmony", bool(names)) \
            if served.harmony else None
        self.calls = CallStream(served.tool_format, names) \
            if served.tool_format and not served.harmony else None
        self.think = ThinkStream(served.reasoning == "inside") \
            if served.reasoning in ("inside", "outside") else None
        self.called = False  # a tool call went out
        self.echoed = False  # an echoed prompt went out

    def chunks(self, kind: str, piece, extra) -> list[dict]:
        served, out = self.served, []
        if not self.role_sent:  # with the first token: the time a client sees is honest
            out.append(served.chunk("", None, [], first=True))
            self.role_sent = True
        if served.echo is not None and not self.echoed:  # the prompt, scored, comes first
            self.echoed = True  # (its entries are whole: the row fed it before answering)
            first = {"token": served.echo[0], "logprob": None, "top": None}
            out.append(served.chunk(served.echo_text, None, [first, *served.prompt_logprobs]))
        logprobs = [] if extra is None or kind == "done" else [extra]
        for what, value in self._parts(kind, piece or ""):
            if what == "reasoning":
                out.append(served.chunk("", None, logprobs, reasoning=value))
            elif what == "calls":
                self.called = True
                out.append(served.chunk("", None, logprobs, calls=value))
            else:
                out.append(served.chunk(value, None, logprobs))
            logprobs = []
        if kind == "done":
            reason = "tool_calls" if self.called and extra == "stop" else extra
            out.append(served.chunk("", reason, []))
            self.done = True
        elif logprobs:  # a token that made no text yet still has its log-probability
            out.append(served.chunk("", None, logprobs))
        return out

    def _parts(self, kind: str, piece: str) -> list[tuple[str, object]]:
        """("reasoning" | "content", text) and ("calls", deltas) of a piece, in order."""
        if self.harmony is not None:
            events = self.harmony.add(piece) + (self.harmony.finish() if kind == "done" else [])
            parts, index = [], self.harmony.calls - sum(e[0] == "call" for e in events) - 1
            for what, value in events:
                if what == "call":
                    index += 1
                    parts.append(("calls", [{"index": index, **value}]))
                elif what == "arguments":
                    parts.append(("calls", [{"index": index, "function": {"arguments": value}}]))
                elif what in ("reasoning", "content") and value:
                    parts.append((what, value))
            return parts
        parts = []
        if self.think is not None:
            thought, piece = self.think.add(piece)
            if kind == "done":
                more, rest = self.think.finish()
                thought, piece = thought + more, piece + rest
            if thought:
                parts.append(("reasoning", thought))
        if self.calls is None:
            return parts + ([("content", piece)] if piece else [])
        content, deltas = self.calls.add(piece)
        if kind == "done":
            rest, more = self.calls.finish()
            content, deltas = content + rest, deltas + more
        if content:
            parts.append(("content", content))
        if deltas:
            parts.append(("calls", deltas))
        return parts


async def sse(every: list[ServeRequest], request: Request, keepalive_s: float):
    """The body's answers as Server-Sent Events, one chunk stream with one id; a comment
    every ``keepalive_s`` while no row has made anything (a long prompt prefilling)."""
    first = every[0]

    def data(obj) -> str:
        obj["id"] = first.id  # every choice's chunks belong to the one completion
        return f"data: {json.dumps(obj)}\n\n"

    watcher = asyncio.create_task(watch(every, request))
    streams = [ChoiceStream(one) for one in every]
    getters: dict[int, asyncio.Future] = {}  # one get per choice, never cancelled by a keep-alive
    try:
        while not all(s.done for s in streams):
            for i, s in enumerate(streams):
                if not s.done and i not in getters:
                    getters[i] = asyncio.ensure_future(s.served.events.get())
            done, _ = await asyncio.wait(set(getters.values()), timeout=keepalive_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                yield ": keep-alive\n\n"
                continue
            for i in sorted(i for i, g in getters.items() if g in done):
                kind, piece, extra = getters.pop(i).result()
                if kind == "gone":
                    return
                if kind == "error":
                    yield data(piece.body())
                    return
                for chunk in streams[i].chunks(kind, piece, extra):
                    yield data(chunk)
        if first.include_usage:
            last = first.chunk(None, None, [])
            last["usage"] = usage(every)
            yield data(last)
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - the stream has begun: its last event says so
        log.error("a streamed answer failed", exc_info=e)
        yield data(server_error(e).body())
    finally:
        watcher.cancel()
        for getter in getters.values():
            getter.cancel()
        for one in every:
            one.cancelled.set()
