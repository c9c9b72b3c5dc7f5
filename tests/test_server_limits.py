"""The server's limits and exposure (issue 71): half-sent requests, oversize and deep bodies,
text that is not Unicode, the wrong content type, a foreign Host, the API key on every
route, a client that leaves a non-streamed request, and an exception inside a route.

Each abuse is sent as raw HTTP (sockets for what a client library would not send) and must
answer its documented status with OpenAI's error JSON; the server stays up, and a
temperature-0 answer asked before the abuse is the same after it."""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from flexgen_infinigen.serving.app import create_app  # noqa: E402
from flexgen_infinigen.serving.guard import Limits  # noqa: E402
from flexgen_infinigen.serving.metrics import Metrics  # noqa: E402

MODEL = "smollm2-135m"
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
BODY_MB = 0.25  # the server's --max-body-mb
TIMEOUT_S = 3  # its --request-timeout-s
DEPTH = 16  # its --max-json-depth
REFERENCE = dict(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_store):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flexgen_infinigen.serve", "--path", str(smollm2_store),
         "--port", str(port), "--gpu-batch-size", "2", "--max-wait-ms", "20",
         "--api-key", KEY, "--max-body-mb", str(BODY_MB), "--request-timeout-s",
         str(TIMEOUT_S), "--max-json-depth", str(DEPTH)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
    yield SimpleNamespace(url=url, port=port, proc=proc)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def before(client):
    """The reference answer, asked before any abuse."""
    return client.completions.create(**REFERENCE).choices[0].text


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", headers=AUTH).text.splitlines():
        if line.startswith(f"flexgen_infinigen_{name} "):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {name}")


def _exchange(port: int, data: bytes, then: bytes = b"") -> tuple[int, dict]:
    """Sends ``data`` (and ``then``, if the connection is still open) on a fresh connection
    and reads until the server closes it: (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(data)
        if then:
            s.sendall(then)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
            head, _, body = reply.partition(b"\r\n\r\n")
            length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")]
            if length and len(body) >= length[0]:
                break
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head, "no answer"
    return int(head.split()[1]), json.loads(body)


def _request(port: int, body: bytes, headers: dict, path: str = "/v1/completions",
             host: str | None = None) -> tuple[int, dict]:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host or f'127.0.0.1:{port}'}",
             f"Content-Length: {len(body)}", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]
    return _exchange(port, ("\r\n".join(lines) + "\r\n\r\n").encode() + body)


def _completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "max_tokens": 2, "temperature": 0, **fields}).encode()


def _check(status: int, body: dict, want: int, words: str, server) -> None:
    assert status == want, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"] and "Traceback" not in error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200  # and it stays up


def test_a_reference_answer(before):
    assert before


def test_a_half_sent_request_head_times_out(server):
    # the request line and one header, then nothing: 408 once --request-timeout-s is over
    status, body = _exchange(server.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    _check(status, body, 408, "request line and headers", server)


def test_a_half_sent_body_times_out(server):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}"
            "\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    status, body = _exchange(server.port, head, b'{"model": "sm')
    _check(status, body, 408, "body did not arrive", server)


def test_an_oversize_body_is_refused_before_it_is_read(server):
    # the headers announce more than --max-body-mb and no byte of the body is ever sent:
    # the answer comes from the headers alone
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {10 * 2**20}\r\n\r\n")
    status, body = _exchange(server.port, head.encode())
    _check(status, body, 413, "--max-body-mb", server)


def test_an_oversize_chunked_body_is_counted_as_it_comes(server):
    # no Content-Length: the limit holds on the bytes that arrive
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}"
            "\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    piece = b"x" * 65536
    chunks = (f"{len(piece):x}\r\n".encode() + piece + b"\r\n") * (int(BODY_MB * 16) + 1)
    status, body = _exchange(server.port, head, chunks)
    _check(status, body, 413, "--max-body-mb", server)


@pytest.mark.parametrize("body, words, param", [
    (b"[" * 100_000 + b"]" * 100_000, f"deeper than {DEPTH}", None),
    (_completion(prompt="hi", stop=[[[[[[[[[[[[[[[[[["a"]]]]]]]]]]]]]]]]]]), f"deeper than {DEPTH}",
     None),
    (b'{"model": "smollm2-135m", "prompt": "a \\ud800 b"}', "lone UTF-16 surrogate", "prompt"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\\udc00"}]}',
     "lone UTF-16 surrogate", "messages[0].content"),
    (b'{"model": "smollm2-135m", "prompt": "\xed\xa0\x80"}', "not UTF-8", None),  # a surrogate
    (b'{"model": "smollm2-135m", "prompt": "\xff"}', "not UTF-8", None),
    (b'{"model": "smollm2-135m", "prompt": ', "not JSON", None),
])
def test_bodies_that_are_not_json_text(server, body, words, param):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, answer = _request(server.port, body, JSON, path)
    _check(status, answer, 400, words, server)
    assert answer["error"]["param"] == param


@pytest.mark.parametrize("kind", [None, "text/plain", "application/x-www-form-urlencoded",
                                  "multipart/form-data; boundary=x"])
def test_a_body_not_declared_json_is_refused(server, kind):
    # what a web page can send without a CORS preflight
    headers = dict(AUTH) if kind is None else {**AUTH, "Content-Type": kind}
    status, body = _request(server.port, _completion(prompt="hi"), headers)
    _check(status, body, 415, "Content-Type: application/json", server)


def test_json_with_parameters_is_accepted(server, before):
    status, body = _request(server.port, json.dumps(REFERENCE).encode(),
                            {**AUTH, "Content-Type": "Application/JSON; charset=utf-8"})
    assert status == 200 and body["choices"][0]["text"] == before


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "localhost@evil.example"])
def test_a_foreign_host_is_refused(server, host):
    status, body = _request(server.port, _completion(prompt="hi"), JSON, host=host)
    _check(status, body, 421, "--allowed-hosts", server)
    assert body["error"]["code"] == "host_not_allowed"


@pytest.mark.parametrize("host", ["localhost", "localhost:{port}", "127.0.0.1", "[::1]:{port}"])
def test_loopback_hosts_are_answered(server, host):
    status, body = _request(server.port, json.dumps({"model": "other"}).encode(), JSON,
                            host=host.format(port=server.port))
    assert status == 404 and body["error"]["code"] == "model_not_found"  # past the guard


def test_a_request_that_is_not_http_gets_openai_json(server):
    status, body = _exchange(server.port, b"NOT HTTP AT ALL\r\n\r\n")
    _check(status, body, 400, "not valid HTTP/1.1", server)


def test_every_route_but_health_needs_the_key(server):
    keyless = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        keyless.models.list()
    with pytest.raises(openai.AuthenticationError):
        keyless.completions.create(**REFERENCE)
    with pytest.raises(openai.AuthenticationError):
        keyless.chat.completions.create(model=MODEL, max_tokens=2,
                                        messages=[{"role": "user", "content": "hi"}])
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models", "/nowhere"):
        r = httpx.get(f"{server.url}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics", headers=AUTH).status_code == 200
    # the interactive docs are off without --docs; an unknown route is OpenAI's 404
    for path in ("/docs", "/redoc", "/openapi.json", "/nowhere"):
        r = httpx.get(f"{server.url}{path}", headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["message"], path


def test_a_client_that_leaves_a_non_streamed_request_cancels_it(server, client):
    """The abandoned request asks for 3000 tokens; it is dropped at the step after its
    client leaves, so the request after it is answered without waiting for them."""
    url = server.url
    cancelled = _metric(url, "requests_cancelled_total")
    made = _metric(url, "generation_tokens_total")
    body = _completion(prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=3000)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head.encode() + body)
        s.settimeout(0.05)
        deadline = time.monotonic() + 120
        while _metric(url, "generation_tokens_total") - made < 5:  # it is running
            assert time.monotonic() < deadline, "the request never ran"
            try:
                early = s.recv(65536)
            except TimeoutError:
                continue
            raise AssertionError(f"answered before it ran: {early[:300]!r}")
    # joins at the next block boundary: after the abandoned row is dropped
    after = client.completions.create(**REFERENCE)
    assert after.choices[0].text
    assert _metric(url, "requests_cancelled_total") - cancelled == 1
    abandoned = _metric(url, "generation_tokens_total") - made - after.usage.completion_tokens
    assert abandoned < 1000


# ---- in-process: an exception inside a route, and --docs ----------------------------------

class _Broken:
    """Raises on every use: the route fails where no check of the request can see it."""

    def __getattr__(self, name):
        raise RuntimeError("secret internals")


class _BrokenLM(_Broken):
    cfg = SimpleNamespace(max_positions=64, vocab_size=100)
    tiers = SimpleNamespace(bytes_moved={})
    tokenizer = _Broken()


def _app(docs: bool = False):
    scheduler = SimpleNamespace(lm=_BrokenLM(), metrics=Metrics(), queue_depth=lambda: 0,
                                block_size=1, alive=True, start=lambda: None, context=64,
                                pages=None, retry_after_s=lambda: 1,
                                stop=lambda timeout=None: None)
    return create_app(scheduler, MODEL, {MODEL}, None, 4, KEY, Limits(docs=docs)), scheduler


async def _ask(app, method: str, path: str, **kwargs) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
        return await c.request(method, path, **kwargs)


def test_an_exception_in_a_route_is_openai_json_logged_once(caplog):
    app, scheduler = _app()
    with caplog.at_level(logging.ERROR):
        r = asyncio.run(_ask(app, "POST", "/v1/completions", headers=AUTH,
                             json={"model": MODEL, "prompt": "hi", "max_tokens": 2}))
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and set(error) == {"message", "type", "param", "code"}
    assert "secret internals" not in r.text and "Traceback" not in r.text
    logged = [rec for rec in caplog.records if rec.exc_info]
    assert len(logged) == 1 and "secret internals" in str(logged[0].exc_info[1])
    assert scheduler.metrics.snapshot()["requests"] == {("/v1/completions", 500): 1}


def test_docs_are_served_with_the_flag_and_the_key():
    app, _ = _app(docs=True)
    assert asyncio.run(_ask(app, "GET", "/docs")).status_code == 401
    assert asyncio.run(_ask(app, "GET", "/docs", headers=AUTH)).status_code == 200
    spec = asyncio.run(_ask(app, "GET", "/openapi.json", headers=AUTH))
    assert "/v1/completions" in spec.json()["paths"]


def test_the_same_answer_after_the_abuse(client, before, server):
    assert client.completions.create(**REFERENCE).choices[0].text == before
    assert server.proc.poll() is None
