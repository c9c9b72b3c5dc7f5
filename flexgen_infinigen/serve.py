"""Command line: an OpenAI-compatible HTTP server.

    python -m flexgen_infinigen.serve --model smollm2-135m --gpu-batch-size 8 \\
        --num-gpu-batches 2 --max-wait-ms 50 --port 8000

Serves ``/v1/chat/completions`` and ``/v1/completions`` (streamed over SSE with
``"stream": true``), ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus). Waiting
requests are gathered into blocks of ``gpu_batch_size x num_gpu_batches`` rows, the unit the
schedule reuses each layer's weights over; a block starts when it is full or ``--max-wait-ms``
after its first request. SIGTERM or Ctrl-C stops taking requests, answers every one already
taken, and exits. See docs/usage/serving.md.
"""
from __future__ import annotations

import argparse
import sys

from .switches import API_KEY
from .cli.args import add_model_args, add_policy_args, check_policy_args, policy_from_args
from .config import DEFAULT_MODEL, ConfigError
from .kv import kv_policy_from_args
from .guards import Terminated, run_command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flexgen_infinigen.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_policy_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface; give --api-key then)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--max-wait-ms", type=float, default=50.0,
                   help="how long a block waits for more requests after its first one before "
                        "it starts (0: start with whatever is waiting); longer fills blocks "
                        "better at the cost of first-token latency")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait for a block; more are answered 503")
    g.add_argument("--max-tokens", type=int, default=256,
                   help="tokens generated for a request that does not set max_tokens (cut to "
                        "what the context has room for)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the "
                        "model's name)")
    g.add_argument("--api-key", default=API_KEY.get(),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: the FLEXGEN_INFINIGEN_API_KEY environment variable; "
                        "none: open)")
    g.add_argument("--allowed-hosts", default=None, metavar="NAME[,NAME...]",
                   help="Host header names answered besides the loopback ones (localhost, "
                        "127.0.0.1, ::1); on a loopback --host any other Host is refused "
                        "(421: the guard against DNS rebinding). '*': answer any Host")
    g.add_argument("--max-body-mb", type=float, default=2.0,
                   help="largest request body, in MiB; a larger one is refused with 413 "
                        "before it is read (default 2)")
    g.add_argument("--request-timeout-s", type=float, default=30.0,
                   help="seconds a client has to send a request's line and headers, and "
                        "then its body; a half-sent request is answered 408 and closed "
                        "(default 30)")
    g.add_argument("--max-json-depth", type=int, default=64,
                   help="deepest nesting of a JSON body (default 64)")
    g.add_argument("--docs", action="store_true",
                   help="serve the interactive API docs at /docs, /redoc and /openapi.json "
                        "(off by default; /docs loads its scripts from a CDN)")
    g.add_argument("--allow-control-tokens", action="store_true",
                   help="encode control-token text in user content (such as <|im_start|>) "
                        "as the control token; by default it is encoded as plain text")
    g.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    return p


def check_args(a) -> None:
    if not 0 < a.port < 65536:
        raise ConfigError(f"--port must be 1 to 65535 (got {a.port})")
    if a.max_wait_ms < 0:
        raise ConfigError(f"--max-wait-ms must be >= 0 (got {a.max_wait_ms})")
    for flag, v in (("--max-queue", a.max_queue), ("--max-tokens", a.max_tokens)):
        if v < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {v})")
    if a.api_key is not None and not a.api_key.strip():
        raise ConfigError("--api-key is empty; give a key or drop the flag")
    for flag, v in (("--max-body-mb", a.max_body_mb),
                    ("--request-timeout-s", a.request_timeout_s)):
        if not 0 < v < float("inf"):
            raise ConfigError(f"{flag} must be a positive number (got {v:g})")
    if a.max_body_mb * 2**20 < 1024:
        raise ConfigError(f"--max-body-mb {a.max_body_mb:g} is under 1 KiB; no request fits")
    if not 1 <= a.max_json_depth <= 512:
        raise ConfigError(f"--max-json-depth must be 1 to 512 (got {a.max_json_depth})")
    if a.allowed_hosts is not None and not _allowed_hosts(a.allowed_hosts):
        raise ConfigError("--allowed-hosts is empty; give names separated by commas, or '*'")
    check_policy_args(a)
    _check_listen(a.host, a.port)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ConfigError("the server needs FastAPI and uvicorn: pip install "
                          "'flexgen_infinigen[serve]'") from None


def _allowed_hosts(given: str) -> set[str]:
    from .serving.guard import host_name

    return {host_name(n) for n in given.split(",") if n.strip()}


def limits_from_args(a):
    """The server's :class:`~.serving.guard.Limits` from its flags."""
    from .serving.guard import Limits, is_loopback

    hosts = _allowed_hosts(a.allowed_hosts) if a.allowed_hosts is not None else set()
    if "*" in hosts or (not hosts and not is_loopback(a.host)):
        allowed = None  # any Host: the address is reachable from other machines anyway
    else:
        allowed = frozenset(hosts)
    return Limits(max_body_bytes=int(a.max_body_mb * 2**20),
                  request_timeout_s=a.request_timeout_s, max_json_depth=a.max_json_depth,
                  allowed_hosts=allowed, docs=a.docs)


def _check_listen(host: str, port: int) -> None:
    """One error now, not after loading the model, when the address cannot be listened on."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(infos[0][4])
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another "
                          "--port (or --host)") from None


def main(argv=None) -> int:
    return run_command(_main, argv)


def _main(argv=None) -> int:
    import uvicorn

    from .api import OffloadedLM
    from .serving.app import create_app
    from .serving.guard import HEAD_LIMIT_KB, KEEP_ALIVE_S, http_protocol
    from .serving.scheduler import Scheduler
    from .text.chat import chat_template

    a = build_parser().parse_args(argv)
    check_args(a)
    kv = kv_policy_from_args(a)
    policy, _ = policy_from_args(a)  # `auto` needs lengths: it says to use `optimize`
    model = a.model if (a.model or a.path) else DEFAULT_MODEL
    lm = OffloadedLM.load(model=model, path=a.path, dummy=a.dummy, policy=policy,
                          device=a.device, dtype=a.dtype, kv_policy=kv,
                          offload_dir=a.offload_dir, seed=a.seed)
    with lm:
        if lm.tokenizer is None:
            raise ConfigError("the server answers text and this model has no tokenizer "
                              "(--dummy weights); give a real model")
        name = a.served_model_name or lm.cfg.name
        names = {name, lm.cfg.name} | ({a.model} if a.model else set())
        scheduler = Scheduler(lm, a.max_wait_ms / 1000, a.max_queue)
        limits = limits_from_args(a)
        app = create_app(scheduler, name, names, chat_template(lm.store_path, a.chat_template),
                         a.max_tokens, a.api_key, limits, control_tokens=a.allow_control_tokens)
        server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port,
                                               log_level=a.log_level, access_log=False,
                                               http=http_protocol(a.request_timeout_s),
                                               timeout_keep_alive=KEEP_ALIVE_S,
                                               h11_max_incomplete_event_size=HEAD_LIMIT_KB
                                               * 1024))
        print(f"serving {name} on http://{a.host}:{a.port}/v1 (blocks of "
              f"{policy.gpu_batch_size} x {policy.num_gpu_batches}, --max-wait-ms "
              f"{a.max_wait_ms:g}); Ctrl-C or SIGTERM drains and exits", file=sys.stderr,
              flush=True)
        try:
            server.run()  # SIGTERM / Ctrl-C: uvicorn drains, then raises the signal again
        except (KeyboardInterrupt, Terminated):
            print("server stopped: every request taken was answered", file=sys.stderr)
            raise
        if scheduler.alive:
            scheduler.stop(timeout=5)
    print("server stopped: every request taken was answered", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
