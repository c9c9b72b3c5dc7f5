"""A row fails alone (issue 71): requests handed to the engine thread directly, bypassing the
parser, whose prompt ids are outside the vocabulary, whose sampler cannot be made, or whose
sampling raises mid-block, get their own error, and the rows beside them in the block get
exactly their answers alone (``serving/scheduler.py``). Below the parser, too: the sampler
cannot fail on tiny values, and ``SamplingConfig.validate`` refuses NaN and Infinity.
"""
from __future__ import annotations

import math
import queue
import threading

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.cli import request_checks as checks
from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.sampling import Sampler, SamplingConfig
from flexgen_infinigen.serving import block_run as scheduler_module
from flexgen_infinigen.serving.requests import ServeRequest
from flexgen_infinigen.serving.scheduler import Scheduler

MODEL = "smollm2-135m"
PROMPTS = ["Water boils at", "In 1969, the first", "The three primary colours are",
           "A good night's sleep"]


def _in_thread(fn, *args):
    """``fn``'s result from a worker thread (as the server's engine runs: see test_serve)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    assert out, "the call failed (its error is printed above)"
    return out[0]


@pytest.mark.parametrize("value, param, words", [
    (2**64 - 1, None, None), (-2**63, None, None), (2**64, "seed", "from"),
    (7.0, "seed", "integer"),
])
def test_seed_range_is_the_generators(value, param, words):
    if param is None:
        assert checks.seed(value) == value
        return
    with pytest.raises(checks.Refused) as caught:
        checks.seed(value)
    assert caught.value.param == param and words in str(caught.value)


def test_sampling_config_refuses_nan_and_infinity():
    for config in (SamplingConfig(math.nan), SamplingConfig(math.inf),
                   SamplingConfig(1.0, math.nan), SamplingConfig(1.0, 1e-60),
                   SamplingConfig(1.0, 1.0, 2**64), SamplingConfig(1.0, 1.0, 0, math.nan),
                   SamplingConfig(1.0, 1.0, 0, math.inf)):
        with pytest.raises(ConfigError):
            config.validate()
    SamplingConfig(1e-30, checks.TOP_P_FLOOR, 2**64 - 1).validate()


def test_the_sampler_cannot_fail_on_tiny_values():
    """Below validation, too: a temperature so small that the scaled logits overflow takes
    its limit, the greedy token; a top-p that rounds to 0 keeps the most likely token."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 30
    for config in (SamplingConfig(1e-45, 1.0, 1), SamplingConfig(1e-300, 0.5, 2),
                   SamplingConfig(1.0, 1e-60, 3)):
        assert torch.equal(Sampler(config)(logits), logits.argmax(-1))
    # ordinary values draw as nucleus sampling does (written out here as the reference)
    sampler, generator = Sampler(SamplingConfig(2.0, 0.9, 5)), torch.Generator().manual_seed(5)
    for _ in range(5):
        probs = torch.softmax(logits / 2.0, -1)
        sorted_p, order = probs.sort(-1, descending=True)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= 0.9, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        expected = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        assert torch.equal(sampler(logits), expected)


# ---- the engine: a row fails alone --------------------------------------------------------

class _Loop:
    """Stands in for the event loop: the engine thread's events go straight to a queue."""

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


@pytest.fixture(scope="module")
def engine_lm(smollm2_store):
    policy = Placement(gpu_batch_size=2, num_gpu_batches=2)
    with OffloadedLM.load(path=smollm2_store, policy=policy, progress=False) as lm:
        yield lm


def _request(lm, prompt, sampling=None, ids=None, max_tokens=4) -> ServeRequest:
    sampling = sampling or SamplingConfig()
    r = ServeRequest("completion", ids if ids is not None else lm.tokenizer.encode(prompt),
                     max_tokens, sampling, [], None, False, False, MODEL)
    r.loop, r.events = _Loop(), queue.Queue()
    return r


def _outcome(r: ServeRequest) -> tuple:
    """(text, finish reason) of a finished request, or ("error", status, param)."""
    pieces = []
    while True:
        kind, piece, extra = r.events.get(timeout=300)
        if kind == "error":
            return ("error", piece.status, piece.param)
        pieces.append(piece)
        if kind == "done":
            return ("".join(pieces), extra)


def _serve(lm, requests: list[ServeRequest]) -> list[tuple]:
    """The requests' outcomes, all queued before the engine thread starts (one block)."""
    scheduler = Scheduler(lm, 0.5, 16)
    for r in requests:
        scheduler.submit(r)
    scheduler.start()
    try:
        return [_outcome(r) for r in requests]
    finally:
        scheduler.stop(timeout=300)
        assert scheduler.metrics.snapshot()["counts"].get("engine_errors", 0) == 0


class _RaisingSampler:
    """A sampler that fails at its second step (after its row has taken one token)."""

    def __init__(self, config):
        self.calls = 0

    def __call__(self, logits, step=0, batch=0):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("this sampler fails")
        return logits.argmax(-1)


@pytest.fixture(scope="module")
def solo(engine_lm) -> list[tuple]:
    """Three valid requests' outcomes, each run alone."""
    return [_in_thread(_serve, engine_lm, [r])[0] for r in _good(engine_lm)]


def _good(lm) -> list[ServeRequest]:
    return [_request(lm, PROMPTS[0]), _request(lm, PROMPTS[1], SamplingConfig(0.9, 0.95, 11)),
            _request(lm, PROMPTS[2])]


@pytest.mark.parametrize("poison, expected", [
    ("id-vocab-size", ("error", 400, "prompt")),
    ("negative-id", ("error", 400, "prompt")),
    ("empty-ids", ("error", 400, "prompt")),
    ("seed-2^64", ("error", 500, None)),
    ("raises-mid-block", ("error", 500, None)),
])
def test_a_failing_row_fails_alone(engine_lm, solo, monkeypatch, poison, expected):
    """Requests handed to the engine directly (no parsing): a row whose ids are outside the
    vocabulary, whose sampler cannot be made, or whose sampling raises after its first
    token gets its error; the three rows beside it in the block get their
    answers alone."""
    lm = engine_lm
    vocab = lm.cfg.vocab_size
    bad = {"id-vocab-size": lambda: _request(lm, "", ids=[1, vocab]),
           "negative-id": lambda: _request(lm, "", ids=[-1, 2]),
           "seed-2^64": lambda: _request(lm, PROMPTS[3], SamplingConfig(0.9, 1.0, 2**64)),
           "empty-ids": lambda: _request(lm, "", ids=[]),
           "raises-mid-block": lambda: _request(lm, PROMPTS[3], SamplingConfig(0.5, 1.0, 3)),
           }[poison]()
    if poison == "raises-mid-block":
        real = scheduler_module.row_chooser  # how the engine makes each row's chooser
        monkeypatch.setattr(scheduler_module, "row_chooser", lambda c, ids: _RaisingSampler(c)
                            if c.seed == 3 else real(c, ids))
    good = _good(lm)
    out = _in_thread(_serve, lm, [good[0], good[1], bad, good[2]])
    assert out[2] == expected
    assert [out[0], out[1], out[3]] == solo
    if poison == "raises-mid-block":
        assert bad.generated == 1  # it had a token before its sampler failed
