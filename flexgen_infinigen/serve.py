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
import os
import sys

from .cli.args import add_model_args, add_policy_args, check_policy_args, policy_from_args
from .config import DEFAULT_MODEL, ConfigError
from .kv import kv_policy_from_args
from .runtime.guards import Terminated, run_command


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
    g.add_argument("--api-key", default=os.environ.get("FLEXGEN_INFINIGEN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: the "
                        "FLEXGEN_INFINIGEN_API_KEY environment variable; none: open)")
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
    check_policy_args(a)
    _check_listen(a.host, a.port)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ConfigError("the server needs FastAPI and uvicorn: pip install "
                          "'flexgen_infinigen[serve]'") from None


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
    from .serving.scheduler import Scheduler
    from .text.chat import store_template

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
        app = create_app(scheduler, name, names, store_template(lm.store_path), a.max_tokens,
                         a.api_key)
        server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port,
                                               log_level=a.log_level, access_log=False))
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
