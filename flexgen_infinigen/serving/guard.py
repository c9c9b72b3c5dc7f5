"""What stands between a connection and the routes: the server's limits and its exposure.

- :class:`Guard`, an ASGI layer around the app, refuses before any route runs a request
  whose ``Host`` is not one the server answers to (421, the DNS-rebinding guard of a server
  on a loopback address), that lacks the API key (401; every route but ``/health``), whose
  body is not declared JSON (415), or whose ``Content-Length`` is over the body limit (413).
  An exception that escapes a route answers OpenAI's error JSON with a 500 and is logged
  once, with its traceback, on the server only.
- :func:`read_body` reads a body under the same limit, counted as it streams in (a body
  without ``Content-Length``), and under the read timeout (408).
- :func:`decode_json` turns the bytes into JSON: UTF-8 only, no lone surrogates in any
  string, and no deeper nesting than the limit (400 for each).
- :func:`http_protocol` is uvicorn's HTTP/1.1 protocol with a timeout on the request head
  (a half-sent request line or headers is answered 408 and closed) and OpenAI's error JSON
  for a request that is not valid HTTP.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from dataclasses import dataclass

from .requests import ApiError

log = logging.getLogger("uvicorn.error")  # uvicorn's --log-level applies

ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
          "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json"}
OPEN = {"/health"}  # answered without the API key
HEAD_LIMIT_KB = 16  # the parser's limit on a request line and headers not yet complete
KEEP_ALIVE_S = 5  # an idle kept-alive connection is closed after this


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 2 * 2**20
    request_timeout_s: float = 30.0
    max_json_depth: int = 64
    # the Host names answered besides the loopback ones; None: any Host is answered
    allowed_hosts: frozenset[str] | None = frozenset()
    docs: bool = False  # /docs, /redoc and /openapi.json
    # an SSE comment this often while a streamed request waits or prefills, so that proxies
    # and clients with idle timeouts keep the connection (SSE parsers skip comments)
    sse_keepalive_s: float = 10.0
    max_model_len: int | None = None  # the context a request may fill (None: the model's)
    # "auto": a thinking model's reasoning in reasoning_content; "none": left in content
    reasoning_format: str = "auto"


def is_loopback(host: str) -> bool:
    """Whether a listening address (``--host``) is reachable from this machine only."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a ``Host`` header, without its port: ``[::1]:8000`` -> ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    name, colon, port = header.rpartition(":")
    return (name if colon and port.isdigit() else header).rstrip(".")


def endpoint(path: str) -> str:
    """The ``/metrics`` label of a path: a route's own, or ``other`` (a label per path a
    client makes up would grow the metrics without bound)."""
    return path if path in ROUTES else "other"


class Guard:
    """The ASGI layer of the checks that come before any route (the module's docstring)."""

    def __init__(self, app, limits: Limits, api_key: str | None, metrics):
        self.app, self.limits, self.metrics = app, limits, metrics
        self.key = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # the lifespan
            return await self.app(scope, receive, send)
        refused = self.refusal(scope)
        if refused is not None:
            self.metrics.answered(endpoint(scope["path"]), refused.status)
            # a body sent anyway is read and dropped (a client that is still sending
            # when the connection closes would see a reset, not this answer), for
            # --request-timeout-s at most: see http_protocol
            return await send_error(send, refused)
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:  # noqa: BLE001 - one answer and one log line, and go on
            log.error("%s %s failed", scope["method"], scope["path"], exc_info=e)
            if not started:
                self.metrics.answered(endpoint(scope["path"]), 500)
                await send_error(send, server_error(e), close=True)

    def refusal(self, scope) -> ApiError | None:
        headers: dict[bytes, list[bytes]] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, []).append(value)

        def header(name: bytes) -> str | None:
            values = headers.get(name)
            return None if not values else values[0].decode("latin-1")

        allowed = self.limits.allowed_hosts
        if allowed is not None:
            hosts = headers.get(b"host", [])
            name = host_name(hosts[0].decode("latin-1")) if len(hosts) == 1 else None
            if name is None or not (is_loopback(name) or name in allowed):
                shown = hosts[0].decode("latin-1") if len(hosts) == 1 else \
                    f"{len(hosts)} Host headers"
                return ApiError(421, f"this server does not answer to the Host {shown!r}: it "
                                     "listens on a loopback address, and answers to loopback "
                                     "names only (start it with --allowed-hosts NAME to add "
                                     "one)", code="host_not_allowed")
        if self.key is not None and scope["path"] not in OPEN:
            given = (header(b"authorization") or "").encode("latin-1")
            if not hmac.compare_digest(given, self.key):
                return ApiError(401, "a valid API key is needed: send the header "
                                     "Authorization: Bearer <key>", code="invalid_api_key")
        if scope["method"] == "POST":
            kind = header(b"content-type")
            if (kind or "").split(";")[0].strip().lower() != "application/json":
                return ApiError(415, "the body must be JSON sent with the header Content-Type: "
                                     f"application/json (got {kind or 'no Content-Type'})",
                                code="unsupported_media_type")
            length = header(b"content-length")
            if length is not None and length.strip().isdigit() and \
                    int(length) > self.limits.max_body_bytes:
                return too_large(self.limits)
        return None


def too_large(limits: Limits) -> ApiError:
    return ApiError(413, f"the request body is over the server's limit of "
                         f"{limits.max_body_bytes / 2**20:.3g} MiB (--max-body-mb)",
                    code="request_too_large")


def server_error(e: BaseException) -> ApiError:
    return ApiError(500, f"the server failed on this request ({type(e).__name__}); the "
                         "failure is in the server's log, and other requests go on",
                    "server_error")


async def send_error(send, e: ApiError, close: bool = False) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    if e.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_body(request, limits: Limits) -> bytes:
    """The whole body, or :class:`ApiError` 413 as soon as more than the limit has come
    (it is counted as it streams, whatever ``Content-Length`` said) and 408 when it is not
    all there ``request_timeout_s`` after the headers."""
    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise too_large(limits)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), limits.request_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within "
                            f"{limits.request_timeout_s:g} s (--request-timeout-s)",
                       code="request_timeout") from None


def decode_json(raw: bytes, max_depth: int):
    """The JSON value of a body: UTF-8 text, no string holding a lone surrogate, nested at
    most ``max_depth`` deep (a value inside an object or a list is one deeper)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 (byte {e.start}: {e.reason}); "
                            "send JSON in UTF-8") from None
    deep = ApiError(400, f"the request body nests deeper than {max_depth} levels "
                         "(--max-json-depth)", code="json_too_deep")
    try:
        value = json.loads(text)
    except RecursionError:  # the decoder's own bound: far deeper than any limit we allow
        raise deep from None
    except ValueError as e:
        raise ApiError(400, f"the request body is not JSON ({e})") from None
    # iterative, so that no nesting the decoder accepts can exhaust the stack here
    stack = [(value, 1, None)]
    while stack:
        item, depth, where = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > max_depth:
                raise deep
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if isinstance(key, str) and _surrogate(key):
                    raise _bad_text(where, in_key=True)
                if isinstance(child, (dict, list, str)):
                    stack.append((child, depth + 1, (where, key)))
        elif isinstance(item, str) and _surrogate(item):
            raise _bad_text(where)
    return value


def _surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _bad_text(where, in_key: bool = False) -> ApiError:
    """400 for a string with a lone surrogate, naming where it is: ``messages[0].content``
    (``where`` is ``(parent's where, key)``, None for the body itself)."""
    parts = []
    while where is not None:
        where, part = where
        parts.append(part)
    path = ""
    for part in reversed(parts):
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    shown = path if len(path) <= 80 else path[:77] + "..."
    where = ("a key of " if in_key else "") + (shown or "the request body")
    return ApiError(400, f"{where} holds a lone UTF-16 surrogate (\\ud800 to \\udfff "
                         "without its pair), which is not text; send valid Unicode",
                    param=shown or None)


def _raw_response(status: int, reason: str, e: ApiError) -> bytes:
    body = json.dumps(e.body()).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def http_protocol(timeout_s: float):
    """uvicorn's h11 protocol, plus: a request's line and headers must have come
    ``timeout_s`` after the connection opened or its last answer ended (uvicorn's own
    keep-alive timeout only closes a connection on which nothing at all was sent), a body
    still coming in after its answer is cut off then, and a request that is not valid HTTP
    gets OpenAI's error JSON."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # for the next request's head

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _timed_out(self) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            theirs, ours = self.conn.their_state, self.conn.our_state
            if theirs is h11.IDLE:  # no complete request head yet
                if self.conn.trailing_data[0]:  # part of one: tell the client why
                    self.transport.write(_raw_response(408, "Request Timeout", ApiError(
                        408, f"the request line and headers did not arrive within "
                             f"{timeout_s:g} s (--request-timeout-s)",
                        code="request_timeout")))
                self.transport.close()
            elif theirs is h11.SEND_BODY and ours in (h11.DONE, h11.MUST_CLOSE):
                self.transport.close()  # answered; the rest of its body is not waited for

        def send_400_response(self, msg: str) -> None:
            body = json.dumps(ApiError(
                400, f"the request is not valid HTTP/1.1, or its request line and headers "
                     f"are over {HEAD_LIMIT_KB} KB").body()).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return GuardedH11Protocol
