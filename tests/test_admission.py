"""Requests that join a running block (serving.scheduler, engine.join): a waiting request
takes a row whose answer has ended, its prompt prefilled alone into the row between two
decode steps, and answers, at temperature 0, exactly what it answers alone: the same tokens
and the same log-probability of every token, to the last bit (the independent reference:
``generate`` on its prompt by itself). This holds on the default model's 8-bit codes, with
InfiniGen choosing rows from a per-prompt skew, and with the overlapped schedule of two GPU
batches. Where the caches cannot take a row's columns (KIVI's groups), a joiner feeds its
prompt a token a step and the rows beside it answer as they would without it. Keeping pages
of a joined row keeps its own tokens.
"""
from __future__ import annotations

import time

import pytest
import torch

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
    r = ServeRequest("completion", ids, max_tokens, SamplingConfig(), [], 0, False, False,
                     "m")
    r.loop, r.events = _Loop(), _Events()
    return r


def _text(r: ServeRequest) -> str:
    assert r.events and r.events[-1][0] == "done", r.events
    return "".join(piece for kind, piece, _ in r.events if kind in ("token", "done"))


SETUPS = {  # store, placement, KV policy and its options
    "float-one-batch": ("float", dict(gpu_batch_size=2), "full", None),
    "float-two-batches-overlapped": ("float", dict(gpu_batch_size=1, num_gpu_batches=2,
                                                   overlap=True), "full", None),
    "codes": ("codes", dict(gpu_batch_size=2), "full", None),
    # every layer past the first chooses rows (none is small enough to read whole): the
    # calibrated skew, with prefix pages and free columns; then each prompt with its own
    "codes-infinigen": ("codes", dict(gpu_batch_size=2), "infinigen",
                        dict(select_from_mb=0.0)),
    "codes-infinigen-prompt-skew": ("codes", dict(gpu_batch_size=2), "infinigen",
                                    dict(select_from_mb=0.0, prompt_skew=True)),
}


@pytest.fixture(scope="module", params=list(SETUPS))
def lm(request):
    """Blocks of two rows: in one GPU batch, or in two with the overlapped schedule."""
    store, placement, kv, options = SETUPS[request.param]
    path = request.getfixturevalue("smollm2_store" if store == "float"
                                   else "smollm2_codes_store")
    with OffloadedLM.load(path=path, policy=Placement(**placement), kv_policy=kv,
                          kv_options=options, progress=False) as lm:
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


def _logprobs(r: ServeRequest) -> list[float]:
    return [lp["logprob"] for kind, _, lp in r.events if kind == "token"]


def _alone_logprobs(lm, ids: list[int], n: int) -> tuple[str, list[int], list[float]]:
    """The prompt's own run: its text, tokens and every token's log-probability, computed
    as the server computes them (float32 log-softmax of the step's logits)."""
    ref = lm.generate([ids], n, keep_logits=True)
    tokens = ref.token_ids[0]
    return ref.texts[0], tokens, [float(torch.log_softmax(ref.logits[0][s].float(), -1)[t])
                                  for s, t in enumerate(tokens)]


@pytest.mark.parametrize("pages", [False, True], ids=["plain", "with-pages"])
def test_joined_requests_answer_as_they_would_alone(lm, pages):
    prompts = [lm.tokenizer.encode(t) for t in TEXTS]
    kept = PrefixPages(model_key(lm), 4) if pages else None
    requests, counts = _serve(lm, prompts, LENGTHS, admit_prompt_tokens=64,
                              prefix_pages=kept)
    # rows were taken over mid-block, each by its own prefill
    assert counts.get("requests_joined_prefilled", 0) >= 2
    assert counts.get("requests_joined") == counts.get("requests_joined_prefilled")
    assert counts.get("blocks") < len(prompts)
    for r, ids, n in zip(requests, prompts, LENGTHS):
        text, tokens, logprobs = _alone_logprobs(lm, ids, n)
        assert r.generated == len(tokens)
        assert _text(r) == text
        got = _logprobs(r)  # a token that ended the answer sends none
        if not lm.weight_layouts:  # float32 products: torch's sums may take another
            # order for another number of rows (a block's first rows too, joined or not)
            assert got == pytest.approx(logprobs[:len(got)], abs=1e-5)
        else:  # the runtime's kernels: exact in any block
            assert got and got == logprobs[:len(got)], (text, got, logprobs)
    if pages and not lm.engine.kv_policy.needs_prompt_queries:
        # every row's own tokens: a joined row's prompt is found again
        for ids in prompts:
            assert kept.longest(ids + [0]) == len(ids) // 4 * 4


@pytest.mark.parametrize("free", [None, 0], ids=["free-columns", "no-free-columns"])
def test_a_prompt_longer_than_the_block_so_far(lm, free):
    """A joiner's columns end at the block's last one. With the block's free columns (padding
    before its prompts, which its prefill skips) a prompt longer than the block so far joins
    at once; without them it waits for the next block. Either way it answers as alone."""
    short, long_ = lm.tokenizer.encode("Hi"), lm.tokenizer.encode(TEXTS[1] + " and a cat")
    prompts, lengths = [short, short, long_], [1, 3, 4]
    requests, counts = _serve(lm, prompts, lengths, admit_prompt_tokens=64, free_columns=free)
    joins = free is None and not lm.engine.kv_policy.needs_prompt_queries  # (no own skew)
    assert counts.get("requests_joined_prefilled", 0) == int(joins)
    assert counts.get("blocks") == (1 if joins else 2)
    for r, ids, n in zip(requests, prompts, lengths):
        text, tokens, _ = _alone_logprobs(lm, ids, n)
        assert _text(r) == text


def test_a_new_blocks_long_prompts_are_prefilled_alone(lm):
    """A block's prompts at least ``alone_prompt_tokens`` long skip its padded prefill: each
    is prefilled alone into its row at the first step (no padding computed), and answers as
    alone."""
    prompts = [lm.tokenizer.encode(t) for t in TEXTS[:2]]
    requests, counts = _serve(lm, prompts, [4, 4], alone_prompt_tokens=8)
    skew = lm.engine.kv_policy.needs_prompt_queries  # a per-prompt skew: no free columns
    assert counts.get("requests_prefilled_alone", 0) == (0 if skew else 1)  # (the long one)
    assert counts.get("blocks") == 1 and counts.get("requests_joined", 0) == 0
    for r, ids in zip(requests, prompts):
        text, _, logprobs = _alone_logprobs(lm, ids, 4)
        assert _text(r) == text
        if lm.weight_layouts:  # the runtime's kernels: exact
            assert _logprobs(r) == logprobs[:len(_logprobs(r))]


def test_a_lone_requests_block_prefills_it_alone(lm):
    """A lone request's block has a spare row: padded beside it, the prefill would be half
    padding, so the prompt is prefilled alone into its row (its own tokens computed only),
    and answers as alone."""
    ids = lm.tokenizer.encode(TEXTS[1])
    requests, counts = _serve(lm, [ids], [4], alone_prompt_tokens=1000, spare_rows=1)
    skew = lm.engine.kv_policy.needs_prompt_queries  # a per-prompt skew: no free columns
    assert counts.get("requests_prefilled_alone", 0) == (0 if skew else 1)
    text, _, logprobs = _alone_logprobs(lm, ids, 4)
    assert _text(requests[0]) == text
    if lm.weight_layouts:  # the runtime's kernels: exact
        assert _logprobs(requests[0]) == logprobs[:len(_logprobs(requests[0]))]


@pytest.mark.parametrize("spare", [1, 0])
def test_a_request_that_comes_while_one_runs_takes_a_spare_row(lm, spare):
    """A block of one request starts with a spare row (``spare_rows``): a request sent
    while its answer streams starts at once in that row, and both answer as alone. Without
    it the latecomer waits for the lead's row to end."""
    first, late_ids = (lm.tokenizer.encode(t) for t in TEXTS[1:3])
    scheduler = Scheduler(lm, 0.0, 16, admit_prompt_tokens=64, spare_rows=spare)
    late = _request(late_ids, 4)
    seen = {}

    class _Ends(_Events):
        def put_nowait(self, event):
            super().put_nowait(event)
            if event[0] == "done":  # (in the engine thread: no race)
                seen["lead running"] = not lead.finished

    late.events = _Ends()

    class _SendsLate(_Events):
        def put_nowait(self, event):
            super().put_nowait(event)
            if len(self) == 2:  # its second token: the latecomer arrives
                scheduler.submit(late)

    lead = _request(first, 12)
    lead.events = _SendsLate()
    scheduler.submit(lead)
    scheduler.start()
    deadline = time.monotonic() + 300
    while not late.events or late.events[-1][0] != "done":
        assert time.monotonic() < deadline and scheduler.alive
        time.sleep(0.01)
    scheduler.stop(timeout=300)
    counts = scheduler.metrics.snapshot()["counts"]
    assert counts.get("requests_joined", 0) == 1 and counts.get("blocks") == 1
    assert seen["lead running"] == bool(spare)  # when the latecomer's answer ended
    for r, ids, n in ((lead, first, 12), (late, late_ids, 4)):
        assert _text(r) == _alone_logprobs(lm, ids, n)[0]


def test_caches_that_cannot_take_a_row_feed_the_prompt(smollm2_store):
    """KIVI keeps keys in groups of tokens: a joiner feeds its prompt a token a step, and
    the row beside it answers as it would without it."""
    with OffloadedLM.load(path=smollm2_store, policy=Placement(gpu_batch_size=2),
                          kv_policy="kivi", progress=False) as lm:
        prompts = [lm.tokenizer.encode(t) for t in TEXTS[:3]]
        lengths = [3, 24, 5]
        requests, counts = _serve(lm, prompts, lengths, admit_prompt_tokens=64)
        assert counts.get("requests_joined") == 1
        assert counts.get("requests_joined_prefilled", 0) == 0
        assert requests[2].generated == 5
        for r, ids, n in zip(requests[:2], prompts, lengths):
            assert _text(r) == lm.generate([ids], n).texts[0]


def test_without_admission_requests_wait_for_the_next_block(lm):
    prompts = [lm.tokenizer.encode(t) for t in TEXTS]
    requests, counts = _serve(lm, prompts, LENGTHS, admit_prompt_tokens=0)
    assert counts.get("requests_joined", 0) == 0 and counts.get("blocks") == 3
    for r, ids, n in zip(requests, prompts, LENGTHS):
        assert _text(r) == lm.generate([ids], n).texts[0]
