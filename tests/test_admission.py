"""Requests that join a running block (serving.scheduler, Engine.restart_row): a waiting
request takes a row whose answer has ended, feeds its prompt a token a step beside the other
rows' decoding, and answers, at temperature 0, exactly what it answers alone (the
independent reference: ``generate`` on its prompt by itself); the rows beside it answer as
they would without it, and keeping pages of a joined row keeps its own tokens."""
from __future__ import annotations

import pytest

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.engine.prefill_cache import model_key
from flexgen_infinigen.engine.prefix_pages import PrefixPages
from flexgen_infinigen.sampling import SamplingConfig
from flexgen_infinigen.serving.requests import ServeRequest
from flexgen_infinigen.serving.scheduler import Scheduler

TEXTS = ["The capital of France is", "Once upon a time there was a small dragon who",
         "Water boils at", "My favourite food is", "In 1969, the first"]
LENGTHS = [3, 14, 5, 6, 4]


class _Loop:
    """The event loop's side, run in the engine thread: events land in a list."""

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


class _Events(list):
    def put_nowait(self, event):
        self.append(event)


def _request(ids: list[int], max_tokens: int) -> ServeRequest:
    r = ServeRequest("completion", ids, max_tokens, SamplingConfig(), [], None, False, False,
                     "m")
    r.loop, r.events = _Loop(), _Events()
    return r


def _text(r: ServeRequest) -> str:
    assert r.events and r.events[-1][0] == "done", r.events
    return "".join(piece for kind, piece, _ in r.events if kind in ("token", "done"))


@pytest.fixture(scope="module", params=[dict(gpu_batch_size=2),
                                        dict(gpu_batch_size=1, num_gpu_batches=2,
                                             overlap=True)],
                ids=["one-batch", "two-batches-overlapped"])
def lm(smollm2_store, request):
    """Blocks of two rows: in one GPU batch, or in two with the overlapped schedule."""
    with OffloadedLM.load(path=smollm2_store, policy=Placement(**request.param),
                          progress=False) as lm:
        yield lm


def _serve(lm, prompts, lengths, **kw):
    scheduler = Scheduler(lm, 0.0, 16, **kw)
    requests = [_request(ids, n) for ids, n in zip(prompts, lengths)]
    for r in requests:  # all waiting before the first block: two start, the rest join
        scheduler.submit(r)
    scheduler.start()
    scheduler.stop(timeout=300)
    assert not scheduler.alive
    return requests, scheduler.metrics.snapshot()["counts"]


@pytest.mark.parametrize("pages", [False, True], ids=["plain", "with-pages"])
def test_joined_requests_answer_as_they_would_alone(lm, pages):
    prompts = [lm.tokenizer.encode(t) for t in TEXTS]
    kept = PrefixPages(model_key(lm), 4) if pages else None
    requests, counts = _serve(lm, prompts, LENGTHS, admit_prompt_tokens=64,
                              prefix_pages=kept)
    assert counts.get("requests_joined", 0) >= 2  # rows were taken over mid-block
    assert counts.get("blocks") < len(prompts)
    for r, ids, n in zip(requests, prompts, LENGTHS):
        ref = lm.generate([ids], n)
        assert r.generated == len(ref.token_ids[0])
        assert _text(r) == ref.texts[0]
    if pages:  # every row's own tokens: a joined row's prompt is found again
        for ids in prompts:
            assert kept.longest(ids + [0]) == len(ids) // 4 * 4


def test_without_admission_requests_wait_for_the_next_block(lm):
    prompts = [lm.tokenizer.encode(t) for t in TEXTS]
    requests, counts = _serve(lm, prompts, LENGTHS, admit_prompt_tokens=0)
    assert counts.get("requests_joined", 0) == 0 and counts.get("blocks") == 3
    for r, ids, n in zip(requests, prompts, LENGTHS):
        assert _text(r) == lm.generate([ids], n).texts[0]
