"""The server's counters, and ``/metrics`` in the Prometheus text format (version 0.0.4).

The engine thread and the event loop both count; each update is one dictionary operation
under the interpreter lock, and a scrape reads a copy. The latency histograms (time to
first token, time between tokens, end to end, queue time) and the running and waiting
gauges are ``prometheus_client``'s, named as vLLM's dashboards read them, under this
project's prefix; ``bytes_moved`` is ours alone.
"""
from __future__ import annotations

import threading
from collections import Counter

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

PREFIX = "flexgen_infinigen"

HELP = {
    "requests_total": ("counter", "HTTP requests answered, by endpoint and status code"),
    "requests_admitted_total": ("counter", "generations queued for a block"),
    "requests_finished_total": ("counter", "generations that ran to their end"),
    "requests_cancelled_total": ("counter",
                                 "generations dropped because their client disconnected"),
    "requests_joined_total": ("counter", "generations that took a row of a running block"),
    "requests_joined_prefilled_total": ("counter",
                                        "joiners whose prompt was prefilled alone into their "
                                        "row (the rest fed it a token a step)"),
    "requests_prefilled_alone_total": ("counter",
                                       "requests whose prompt was prefilled alone into a row "
                                       "(joiners, and a new block's long prompts)"),
    "prompt_tokens_total": ("counter", "prompt tokens admitted"),
    "generation_tokens_total": ("counter", "tokens generated for clients"),
    "engine_errors_total": ("counter", "blocks the engine failed on"),
    "row_errors_total": ("counter", "requests failed alone inside a block (the other rows "
                                    "went on)"),
    "queue_depth": ("gauge", "requests waiting for a block"),
    "running_rows": ("gauge", "requests in the block being decoded"),
    "blocks_total": ("counter", "blocks run"),
    "block_rows_total": ("counter", "requests in the blocks run (fill = this / "
                                    "blocks_total / block_capacity)"),
    "block_capacity": ("gauge", "rows of a full block: gpu_batch_size x num_gpu_batches"),
    "block_fill": ("gauge", "the last block's requests over its capacity"),
    "bytes_moved_total": ("counter", "bytes moved between memory tiers, by link and kind"),
    "prefix_cache_queries_total": ("counter", "prompt tokens looked up in the prefix pages"),
    "prefix_cache_hits_total": ("counter", "prompt tokens whose keys and values came from "
                                           "the prefix pages (not prefilled)"),
    "prefix_cache_bytes": ("gauge", "bytes of prefix pages held, by tier"),
}


# seconds; vLLM's buckets for the same histograms, trimmed to a CPU's range
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1,
                 2.5, 5, 10, 20)
REQUEST_BUCKETS = (0.1, 0.3, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 240, 480, 960, 1920, 3840)

# attribute -> (name, help, buckets): the latency histograms, named as vLLM's
HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds",
             "seconds from a request's arrival to its first token", TTFT_BUCKETS),
    "between": ("inter_token_latency_seconds",
                "seconds between a request's successive tokens", TOKEN_BUCKETS),
    "e2e": ("e2e_request_latency_seconds",
            "seconds from a request's arrival to its end", REQUEST_BUCKETS),
    "queued": ("request_queue_time_seconds",
               "seconds a request waited before its block started", REQUEST_BUCKETS),
}


class Metrics:
    def __init__(self):
        self._counts: Counter = Counter()
        self._requests: Counter = Counter()  # (endpoint, status) -> answers
        self._lock = threading.Lock()
        self.running_rows = 0
        self.block_capacity = 0
        self.last_fill = 0.0
        self.registry = CollectorRegistry()  # one per server (tests run several)
        for attr, (name, text, buckets) in HISTOGRAMS.items():
            setattr(self, attr, Histogram(f"{PREFIX}_{name}", text, buckets=buckets,
                                          registry=self.registry))
        self.running = Gauge(f"{PREFIX}_num_requests_running",
                             "requests in the block being decoded", registry=self.registry)
        self.waiting = Gauge(f"{PREFIX}_num_requests_waiting",
                             "requests waiting for a block", registry=self.registry)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def answered(self, endpoint: str, status: int) -> None:
        with self._lock:
            self._requests[(endpoint, status)] += 1

    def block_started(self, rows: int, capacity: int) -> None:
        self.count("blocks")
        self.count("block_rows", rows)
        self.running_rows, self.block_capacity = rows, capacity
        self.last_fill = rows / capacity

    def block_ended(self) -> None:
        self.running_rows = 0

    def snapshot(self) -> dict:
        with self._lock:
            return {"counts": dict(self._counts), "requests": dict(self._requests)}

    def render(self, queue_depth: int, capacity: int, bytes_moved: dict,
               prefix_bytes: dict[str, int] | None = None) -> str:
        """The Prometheus text: every metric with its HELP and TYPE lines
        (``prefix_bytes``: the prefix pages' bytes by tier)."""
        snap = self.snapshot()
        counts = snap["counts"]
        values = {
            "requests_total": [({"endpoint": e, "status": str(s)}, n)
                               for (e, s), n in sorted(snap["requests"].items())],
            "queue_depth": [({}, queue_depth)],
            "running_rows": [({}, self.running_rows)],
            "block_capacity": [({}, capacity)],
            "block_fill": [({}, self.last_fill)],
            "bytes_moved_total": [({"link": link, "kind": kind}, n)
                                  for link, kinds in sorted(bytes_moved.items())
                                  for kind, n in sorted(kinds.items())],
            "prefix_cache_bytes": [({"tier": t}, n)
                                   for t, n in sorted((prefix_bytes or {}).items())],
        }
        for name in ("requests_admitted", "requests_finished", "requests_cancelled",
                     "requests_joined", "requests_joined_prefilled",
                     "requests_prefilled_alone", "prompt_tokens",
                     "generation_tokens", "engine_errors", "row_errors", "blocks", "block_rows",
                     "prefix_cache_queries", "prefix_cache_hits"):
            values[f"{name}_total"] = [({}, counts.get(name, 0))]
        self.running.set(self.running_rows)
        self.waiting.set(queue_depth)
        lines = []
        for name, (kind, text) in HELP.items():
            full = f"{PREFIX}_{name}"
            lines += [f"# HELP {full} {text}", f"# TYPE {full} {kind}"]
            for labels, value in values[name]:
                tag = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(f"{full}{{{tag}}} {value}" if tag else f"{full} {value}")
        return "\n".join(lines) + "\n" + generate_latest(self.registry).decode()
