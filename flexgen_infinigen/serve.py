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

from .switches import API_KEY
from .cli.args import (add_model_args, add_policy_args, check_policy_args, policy_from_args,
                       wants_plan)
from .config import DEFAULT_MODEL, ConfigError
from .kv import kv_policy_from_args
from .guards import Terminated, run_command

# a block's rows when --gpu-batch-size is not given: a server answers several requests at
# once (a row is a request), where the run command's batch of one is a single prompt
SERVE_ROWS = 4
# the prefix pages' default: a quarter of the memory free once the model is loaded, at most
# this many GB (four 16K-token chats of a 0.5B model in float32 take about 1.6 GB)
PREFIX_CACHE_GB = 8.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flexgen_infinigen.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_policy_args(p)
    p.set_defaults(gpu_batch_size=SERVE_ROWS)
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
    g.add_argument("--reasoning-format", choices=["auto", "none"], default="auto",
                   help="auto: a thinking model's reasoning (<think>, gpt-oss's analysis) is "
                        "returned as reasoning_content (streamed as its own deltas); none: it "
                        "stays in content")
    g.add_argument("--sse-keepalive-s", type=float, default=10.0,
                   help="send an SSE comment this often while a streamed request waits or "
                        "prefills, so that proxies keep the connection (default 10)")
    g.add_argument("--max-json-depth", type=int, default=64,
                   help="deepest nesting of a JSON body (default 64)")
    g.add_argument("--docs", action="store_true",
                   help="serve the interactive API docs at /docs, /redoc and /openapi.json "
                        "(off by default; /docs loads its scripts from a CDN)")
    g.add_argument("--allow-control-tokens", action="store_true",
                   help="encode control-token text in user content (such as <|im_start|>) "
                        "as the control token; by default it is encoded as plain text")
    g.add_argument("--typical-prompt-len", type=int, default=512,
                   help="--percent auto / --gpu-batch-size auto plan for prompts this long "
                        "(default 512)")
    g.add_argument("--typical-answer-len", type=int, default=None,
                   help="... and answers this long (default: --max-tokens)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="the tokens a prompt and its answer may fill, at most the model's "
                        "context (default: the model's); a longer prompt is answered 400")
    g.add_argument("--spare-rows", type=int, default=1,
                   help="a block that is not full starts with this many free rows, so that a "
                        "request that comes while it runs starts at once (each costs every "
                        "decode step a row's compute; 0: only ended rows are taken)")
    g.add_argument("--admit-prompt-tokens", type=int, default=1024,
                   help="a waiting request whose prompt is at most this long takes a row of "
                        "the running block as soon as one ends, its prompt prefilled alone "
                        "between two decode steps (the other rows wait for that prefill); a "
                        "longer one waits for the next block's prefill (0: requests join at "
                        "block boundaries only)")
    g.add_argument("--prefix-cache-gb", type=float, default=None,
                   help="CPU memory for the keys and values of prompts and answers seen "
                        "before, so that a request that starts the same way (a chat's next "
                        "turn, a shared system prompt) prefills only the rest (0: off; "
                        f"default: a quarter of the memory free with the model loaded, at "
                        f"most {PREFIX_CACHE_GB:g})")
    g.add_argument("--prefix-cache-disk-gb", type=float, default=0.0,
                   help="disk space for prefix pages evicted from memory, under "
                        "--prefix-cache-dir or else --offload-dir (default 0: none)")
    g.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="keep prefix pages in DIR, where a later server finds them again "
                        "(needs --prefix-cache-disk-gb; files are checked when read)")
    g.add_argument("--prefix-page-tokens", type=int, default=64,
                   help="tokens a prefix page holds: reuse is in whole pages (default 64)")
    g.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    return p


def check_args(a) -> None:
    if not 0 < a.port < 65536:
        raise ConfigError(f"--port must be 1 to 65535 (got {a.port})")
    if a.max_wait_ms < 0:
        raise ConfigError(f"--max-wait-ms must be >= 0 (got {a.max_wait_ms})")
    for flag, v in (("--prefix-cache-gb", a.prefix_cache_gb),
                    ("--prefix-cache-disk-gb", a.prefix_cache_disk_gb)):
        if v is not None and v < 0:
            raise ConfigError(f"{flag} must be >= 0 (got {v})")
    if not a.sse_keepalive_s > 0:
        raise ConfigError(f"--sse-keepalive-s must be > 0 (got {a.sse_keepalive_s})")
    for flag, v in (("--typical-prompt-len", a.typical_prompt_len),
                    ("--typical-answer-len", a.typical_answer_len)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {v})")
    if a.max_model_len is not None and a.max_model_len < 2:
        raise ConfigError(f"--max-model-len must be at least 2 (got {a.max_model_len})")
    if a.admit_prompt_tokens < 0:
        raise ConfigError(f"--admit-prompt-tokens must be >= 0 (got {a.admit_prompt_tokens})")
    if a.spare_rows < 0:
        raise ConfigError(f"--spare-rows must be >= 0 (got {a.spare_rows})")
    if a.prefix_page_tokens < 1:
        raise ConfigError(f"--prefix-page-tokens must be at least 1 (got "
                          f"{a.prefix_page_tokens})")
    if a.prefix_cache_dir and not a.prefix_cache_disk_gb:
        raise ConfigError("--prefix-cache-dir keeps pages on disk: give it space with "
                          "--prefix-cache-disk-gb GB")
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
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"the server needs FastAPI, uvicorn and prometheus-client ({e.name} "
                          "is missing): pip install 'flexgen_infinigen[serve]'") from None


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
                  allowed_hosts=allowed, docs=a.docs, sse_keepalive_s=a.sse_keepalive_s,
                  reasoning_format=a.reasoning_format)


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


def prefix_cache_bytes(asked_gb: float | None, free_host: float) -> int:
    """Memory for prefix pages: what --prefix-cache-gb asks, else a quarter of what is free,
    at most PREFIX_CACHE_GB."""
    if asked_gb is not None:
        return int(asked_gb * 1e9)
    return int(max(0.0, min(PREFIX_CACHE_GB * 1e9, free_host / 4)))


def prefix_pages(a, lm):
    """The server's prefix pages as the flags ask (None: off)."""
    if a.prefix_cache_gb == 0 and not a.prefix_cache_disk_gb:
        return None
    from .engine.prefill_cache import model_key
    from .engine.prefix_pages import PrefixPages

    from .engine.memory_plan import available
    from .memory.tiers import DISK, HOST

    folder = a.prefix_cache_dir
    if folder is None and a.prefix_cache_disk_gb and a.offload_dir:
        folder = os.path.join(a.offload_dir, f"prefix-pages-{os.getpid()}")
    free = available(lm.tiers.device, folder)
    # the pages grow as requests come: what cannot fit is refused now, not when it runs out
    if a.prefix_cache_gb is not None and a.prefix_cache_gb * 1e9 > free[HOST]:
        raise ConfigError(f"--prefix-cache-gb {a.prefix_cache_gb:g} is more than the "
                          f"{free[HOST] / 1e9:.1f} GB of memory free with the model loaded; "
                          "give less")
    if folder is not None and a.prefix_cache_disk_gb * 1e9 > free[DISK]:
        raise ConfigError(f"--prefix-cache-disk-gb {a.prefix_cache_disk_gb:g} is more than "
                          f"the {free[DISK] / 1e9:.1f} GB free on the disk of {folder}; give "
                          "less")
    return PrefixPages(model_key(lm), a.prefix_page_tokens,
                       prefix_cache_bytes(a.prefix_cache_gb, free[HOST]),
                       folder, int(a.prefix_cache_disk_gb * 1e9),
                       persistent=a.prefix_cache_dir is not None)


def _main(argv=None) -> int:
    import uvicorn

    from .api import OffloadedLM
    from .serving.app import create_app
    from .serving.guard import HEAD_LIMIT_KB, KEEP_ALIVE_S, http_protocol
    from .serving.scheduler import FREE_COLUMNS, Scheduler
    from .text.chat import chat_template

    a = build_parser().parse_args(argv)
    check_args(a)
    kv = kv_policy_from_args(a)
    model = a.model if (a.model or a.path) else DEFAULT_MODEL
    if wants_plan(a):  # the optimizer's choice for the typical request
        from .engine.loading import find_weights

        cfg, _, _ = find_weights(model, a.path, a.dummy, a.seed, progress=True)
        answer = a.typical_answer_len or a.max_tokens
        prompt = min(a.typical_prompt_len, max(1, cfg.max_positions - answer))
        if a.admit_prompt_tokens:  # what a block's caches hold with admission: its free
            # columns before the prompts, and twice its answer in steps (Scheduler)
            prompt += min(a.admit_prompt_tokens, FREE_COLUMNS)
            answer *= 2
        policy, _ = policy_from_args(a, cfg, (prompt, answer))
    else:
        policy, _ = policy_from_args(a)
    lm = OffloadedLM.load(model=model, path=a.path, dummy=a.dummy, policy=policy,
                          device=a.device, dtype=a.dtype, kv_policy=kv,
                          offload_dir=a.offload_dir, seed=a.seed)
    with lm:
        if lm.tokenizer is None:
            raise ConfigError("the server answers text and this model has no tokenizer "
                              "(--dummy weights); give a real model")
        name = a.served_model_name or lm.cfg.name
        names = {name, lm.cfg.name} | ({a.model} if a.model else set())
        pages = prefix_pages(a, lm)
        scheduler = Scheduler(lm, a.max_wait_ms / 1000, a.max_queue, prefix_pages=pages,
                              admit_prompt_tokens=a.admit_prompt_tokens,
                              context=a.max_model_len, spare_rows=a.spare_rows)
        if a.max_model_len is not None and a.max_model_len > lm.cfg.max_positions:
            raise ConfigError(f"--max-model-len {a.max_model_len} is longer than the model's "
                              f"context ({lm.cfg.max_positions}); give at most that")
        limits = limits_from_args(a)
        app = create_app(scheduler, name, names, chat_template(lm.store_path, a.chat_template),
                         a.max_tokens, a.api_key, limits, control_tokens=a.allow_control_tokens)
        server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port,
                                               log_level=a.log_level, access_log=False,
                                               http=http_protocol(a.request_timeout_s),
                                               timeout_keep_alive=KEEP_ALIVE_S,
                                               h11_max_incomplete_event_size=HEAD_LIMIT_KB
                                               * 1024))
        kept = (f"{pages.memory_bytes / 1e9:.1f} GB of prefix pages" if pages is not None
                else "no prefix pages")
        print(f"serving {name} on http://{a.host}:{a.port}/v1 (blocks of "
              f"{policy.gpu_batch_size} x {policy.num_gpu_batches}, --max-wait-ms "
              f"{a.max_wait_ms:g}, {kept}); Ctrl-C or SIGTERM drains and exits",
              file=sys.stderr, flush=True)
        try:
            server.run()  # SIGTERM / Ctrl-C: uvicorn drains, then raises the signal again
        except (KeyboardInterrupt, Terminated):
            print("server stopped: every request taken was answered", file=sys.stderr)
            raise
        if scheduler.alive:
            scheduler.stop(timeout=5)
        if pages is not None:
            pages.close()
    print("server stopped: every request taken was answered", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
