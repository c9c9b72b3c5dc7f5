"""The FastAPI application: OpenAI's routes over a :class:`~.scheduler.Scheduler`.

Every error is OpenAI's error JSON with its status (400 for a body that cannot be served as
asked, 401 without the API key, 404 for another model, 408, 413, 415 and 421 for what
:mod:`.guard` refuses, 503 when the queue is full, 500 when the server itself fails) and the
server goes on. A streamed answer is Server-Sent Events, one ``data:`` chunk per piece of
text, then ``data: [DONE]``; a client that goes away, streamed or not, cancels its row at the
engine's next step.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .guard import Guard, Limits, decode_json, endpoint, read_body, server_error
from . import tokens
from .grammar import Grammars
from .parse import parse_all
from .requests import ApiError, ServeRequest, combined
from .scheduler import QueueFull, Scheduler
from .stream import sse, watch


def create_app(scheduler: Scheduler, model: str, names: set[str], template: str | None,
               default_max_tokens: int, api_key: str | None = None,
               limits: Limits | None = None, control_tokens: bool = False):
    """The ASGI app: the routes behind :class:`~.guard.Guard`'s checks. ``control_tokens``:
    control-token text in user content is encoded as the control token (by default, as
    plain text)."""
    lm, metrics = scheduler.lm, scheduler.metrics
    limits = limits or Limits()
    created = int(time.time())
    grammars = Grammars(lm)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        # the server has stopped taking requests and answered every one in flight
        await asyncio.to_thread(scheduler.stop)

    async def failed(request: Request, e: Exception) -> JSONResponse:
        # an exception no route turned into an answer; Guard logs it once
        metrics.answered(endpoint(request.url.path), 500)
        failure = server_error(e)
        return JSONResponse(failure.body(), status_code=500, headers={"connection": "close"})

    async def refused(request: Request, e: HTTPException) -> JSONResponse:
        # the router's own answers (no such route, another method) in OpenAI's shape
        metrics.answered(endpoint(request.url.path), e.status_code)
        words = {404: f"there is no route {request.url.path}",
                 405: f"{request.url.path} does not take {request.method}"}
        return JSONResponse(ApiError(e.status_code, words.get(e.status_code, str(e.detail)),
                                     code="not_found" if e.status_code == 404 else None).body(),
                            status_code=e.status_code, headers=e.headers)

    docs = limits.docs
    app = FastAPI(title="flexgen_infinigen", lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None,
                  exception_handlers={Exception: failed, HTTPException: refused})

    def error(endpoint: str, e: ApiError) -> JSONResponse:
        metrics.answered(endpoint, e.status)
        # a body too slow to come is not waited for; the rest of one too large is read
        # and dropped for --request-timeout-s at most (see guard.http_protocol), so that
        # a client still sending sees this answer, not a reset connection
        headers = {"connection": "close"} if e.status == 408 else {}
        if e.status == 503:  # when a slot is likely free: about one block from now
            headers["retry-after"] = str(scheduler.retry_after_s())
        return JSONResponse(e.body(), status_code=e.status, headers=headers or None)

    def decode_and_parse(kind: str, raw: bytes) -> list[ServeRequest]:
        return parse_all(kind, decode_json(raw, limits.max_json_depth), lm, template,
                         default_max_tokens, names, scheduler.block_size,
                         control_tokens=control_tokens, context=scheduler.context,
                         reasoning=limits.reasoning_format != "none", grammars=grammars)

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        pages = scheduler.pages
        held = {"host": pages.in_memory, "disk": pages.on_disk} if pages is not None else None
        return PlainTextResponse(metrics.render(scheduler.queue_depth(), scheduler.block_size,
                                                lm.tiers.bytes_moved, held),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model",
                                            "created": created, "owned_by": "flexgen_infinigen",
                                            "max_model_len": scheduler.context}]}

    async def complete(kind: str, endpoint: str, request: Request):
        try:
            raw = await read_body(request, limits)
            every = await asyncio.to_thread(decode_and_parse, kind, raw)
            for one in every:
                one.loop, one.events = asyncio.get_running_loop(), asyncio.Queue()
            queued = []
            try:
                for one in every:
                    scheduler.submit(one)
                    queued.append(one)
            except QueueFull as e:
                for one in queued:  # all of a body's answers, or none
                    one.cancelled.set()
                raise ApiError(503, str(e), "server_overloaded") from None
        except ApiError as e:
            return error(endpoint, e)
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            metrics.answered(endpoint, 499)
            return JSONResponse({}, status_code=499)
        metrics.count("requests_admitted", len(every))
        metrics.count("prompt_tokens", sum(len(one.ids) for one in every))
        if every[0].stream:  # every choice in one stream, each chunk naming its index
            metrics.answered(endpoint, 200)
            return StreamingResponse(sse(every, request, limits.sse_keepalive_s),
                                     media_type="text/event-stream")
        try:
            answers = await _collect(every, request)
        except ApiError as e:
            return error(endpoint, e)
        if answers is None:  # the client left
            metrics.answered(endpoint, 499)
            return JSONResponse({}, status_code=499)
        metrics.answered(endpoint, 200)
        return combined(every, answers)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete("chat", "/v1/chat/completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete("completion", "/v1/completions", request)

    async def tokenizer_route(path: str, request: Request, answer):
        try:
            raw = await read_body(request, limits)
            body = decode_json(raw, limits.max_json_depth)
            out = await asyncio.to_thread(answer, body)
        except ApiError as e:
            return error(path, e)
        except ClientDisconnect:
            metrics.answered(path, 499)
            return JSONResponse({}, status_code=499)
        metrics.answered(path, 200)
        return out

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await tokenizer_route("/tokenize", request, lambda body: tokens.tokenize(
            body, lm, template, control_tokens, scheduler.context))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await tokenizer_route("/detokenize", request,
                                     lambda body: tokens.detokenize(body, lm))

    return Guard(app, limits, api_key, metrics)


async def _collect(served: list[ServeRequest], request: Request):
    """Each answer's (text, finish reason, log-probability entries), whole; None when the
    client left before they were done. One watch for all of a body's answers (a request's
    messages go to one reader)."""
    watcher = asyncio.create_task(watch(served, request))
    try:
        answers = await asyncio.gather(*(_answer(one) for one in served))
    finally:
        watcher.cancel()
        for one in served:
            one.cancelled.set()  # a no-op once the row has finished
    return None if any(a is None for a in answers) else answers


async def _answer(served: ServeRequest):
    pieces, entries = [], []
    while True:
        kind, piece, extra = await served.events.get()
        if kind == "gone":
            return None
        if kind == "error":
            raise piece
        pieces.append(piece)
        if kind == "done":
            return "".join(pieces), extra, entries
        if extra is not None:
            entries.append(extra)
