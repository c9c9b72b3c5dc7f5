"""The FastAPI application: OpenAI's routes over a :class:`~.scheduler.Scheduler`.

Every error is OpenAI's error JSON with its status (400 for a body that cannot be served as
asked, 401 without the API key, 404 for another model, 503 when the queue is full) and the
server goes on. A streamed answer is Server-Sent Events, one ``data:`` chunk per piece of
text, then ``data: [DONE]``; a client that goes away cancels its row.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .requests import ApiError, ServeRequest, parse
from .scheduler import QueueFull, Scheduler

POLL_S = 1.0  # how often a waiting handler checks that its client is still there


def create_app(scheduler: Scheduler, model: str, names: set[str], template: str | None,
               default_max_tokens: int, api_key: str | None = None) -> FastAPI:
    lm, metrics = scheduler.lm, scheduler.metrics
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        # the server has stopped taking requests and answered every one in flight
        await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="flexgen_infinigen", lifespan=lifespan)

    def error(endpoint: str, e: ApiError) -> JSONResponse:
        metrics.answered(endpoint, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "a valid API key is needed: send the header Authorization: "
                                "Bearer <key>", code="invalid_api_key")

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(scheduler.queue_depth(), scheduler.block_size,
                                                lm.tiers.bytes_moved),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            check_key(request)
        except ApiError as e:
            return error("/v1/models", e)
        return {"object": "list", "data": [{"id": model, "object": "model",
                                            "created": created, "owned_by": "flexgen_infinigen",
                                            "max_model_len": lm.cfg.max_positions}]}

    async def complete(kind: str, endpoint: str, request: Request):
        try:
            check_key(request)
            try:
                body = json.loads(await request.body())
            except ValueError as e:
                raise ApiError(400, f"the request body is not JSON ({e})") from None
            served = await asyncio.to_thread(parse, kind, body, lm, template,
                                             default_max_tokens, names)
            served.loop, served.events = asyncio.get_running_loop(), asyncio.Queue()
            try:
                scheduler.submit(served)
            except QueueFull as e:
                raise ApiError(503, str(e), "server_overloaded") from None
        except ApiError as e:
            return error(endpoint, e)
        metrics.count("requests_admitted")
        metrics.count("prompt_tokens", len(served.ids))
        if served.stream:
            metrics.answered(endpoint, 200)
            return StreamingResponse(_sse(served, request), media_type="text/event-stream")
        try:
            text, reason, entries = await _collect(served, request)
        except ApiError as e:
            return error(endpoint, e)
        if reason is None:  # the client left
            metrics.answered(endpoint, 499)
            return JSONResponse({}, status_code=499)
        metrics.answered(endpoint, 200)
        return served.response(text, reason, entries)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete("chat", "/v1/chat/completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete("completion", "/v1/completions", request)

    return app


async def _next_event(served: ServeRequest, request: Request):
    """The engine's next event for this request, or None once the client has gone."""
    while True:
        try:
            return await asyncio.wait_for(served.events.get(), POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return None


async def _collect(served: ServeRequest, request: Request):
    """(text, finish reason, log-probability entries) of a whole answer; reason None when
    the client left before it was done."""
    pieces, entries = [], []
    try:
        while True:
            event = await _next_event(served, request)
            if event is None:
                return "", None, []
            kind, piece, extra = event
            if kind == "error":
                raise piece
            pieces.append(piece)
            if kind == "done":
                return "".join(pieces), extra, entries
            if extra is not None:
                entries.append(extra)
    finally:
        served.cancelled.set()  # a no-op once the row has finished


async def _sse(served: ServeRequest, request: Request):
    """The answer as Server-Sent Events; leaving (the client's disconnect closes this
    generator) cancels the row."""
    def data(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    try:
        if served.kind == "chat":
            yield data(served.chunk("", None, [], first=True))
        while True:
            event = await _next_event(served, request)
            if event is None:
                return
            kind, piece, extra = event
            if kind == "error":
                yield data(piece.body())
                return
            if kind == "done":
                yield data(served.chunk(piece, extra, []))
                break
            if piece or extra is not None:
                yield data(served.chunk(piece, None, [] if extra is None else [extra]))
        if served.include_usage:
            yield data(served.chunk(None, None, []))
        yield "data: [DONE]\n\n"
    finally:
        served.cancelled.set()
