"""The Sampler: greedy is argmax, seeds reproduce, top-p keeps the nucleus, temperature scales."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement, SamplingConfig
from flexgen_infinigen.sampling import Sampler


def draw(sampler: Sampler, logits: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` independent samples from one row of logits, in one call of the sampler."""
    return sampler(logits.unsqueeze(0).expand(n, -1).contiguous())


# ---- greedy ----------------------------------------------------------------------------------
def test_greedy_equals_argmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 1000, generator=gen) * 3
    sampler = Sampler(SamplingConfig(temperature=0.0, top_p=0.5, seed=7))
    assert torch.equal(sampler(logits), logits.argmax(-1))
    # half precision logits too (the CUDA path hands over float16)
    assert torch.equal(sampler(logits.half()), logits.half().float().argmax(-1))


@pytest.fixture(scope="module")
def tiny_lm(tiny_opt):
    policy = Placement.from_percent([100, 0, 100, 0, 100, 0], gpu_batch_size=2, num_gpu_batches=2)
    with OffloadedLM.load(path=str(tiny_opt[1]), policy=policy, progress=False) as lm:
        yield lm


PROMPTS = [[2, 10, 20, 30, 40], [2, 7, 8], [2, 100, 200, 300], [2, 5, 6, 7, 8, 9]]


def test_greedy_generate_picks_argmax_of_its_logits(tiny_lm):
    out = tiny_lm.generate(PROMPTS, gen_len=6, stop_token_id=None, keep_logits=True)
    for tokens, logits in zip(out.token_ids, out.logits):
        assert tokens == logits.argmax(-1).tolist()


# ---- seeds through OffloadedLM.generate ------------------------------------------------------
def sampled(lm, seed: int) -> list[list[int]]:
    cfg = SamplingConfig(temperature=0.8, top_p=0.9, seed=seed)
    return lm.generate(PROMPTS, gen_len=12, sampling=cfg, stop_token_id=None).token_ids


def test_same_seed_same_sequence_different_seed_different(tiny_lm):
    a = sampled(tiny_lm, seed=123)
    assert [len(t) for t in a] == [12] * len(PROMPTS)
    assert sampled(tiny_lm, seed=123) == a
    # 4 prompts x 12 tokens from a near-uniform nucleus of hundreds of tokens: a collision
    # of all 48 tokens between two seeds is out of the question
    b = sampled(tiny_lm, seed=124)
    assert b != a
    # and sampling is not greedy in disguise
    greedy = tiny_lm.generate(PROMPTS, gen_len=12, stop_token_id=None).token_ids
    assert a != greedy


# ---- top-p -----------------------------------------------------------------------------------
def nucleus(probs: np.ndarray, p: float) -> set[int]:
    """The smallest set of tokens, most probable first, whose probability reaches ``p``."""
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    k = int(np.searchsorted(cum, p)) + 1  # first index where the sum reaches p
    return set(order[:k].tolist())


# probabilities 0.4 0.3 0.2 0.1, shuffled over ids so that order is not the id order
PROBS = {3: 0.4, 0: 0.3, 5: 0.2, 1: 0.1}


@pytest.mark.parametrize("top_p, expected", [
    (0.3, {3}),
    (0.4 - 1e-3, {3}),
    (0.4 + 1e-3, {3, 0}),
    (0.65, {3, 0}),
    (0.7 - 1e-3, {3, 0}),
    (0.7 + 1e-3, {3, 0, 5}),
    (0.85, {3, 0, 5}),
    (0.9 + 1e-3, {3, 0, 5, 1}),
    (1.0, {3, 0, 5, 1}),
])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, expected):
    vocab = 8
    logits = torch.full((vocab,), -float("inf"))
    for i, pr in PROBS.items():
        logits[i] = float(np.log(pr))
    sampler = Sampler(SamplingConfig(temperature=1.0, top_p=top_p, seed=0))
    seen = set(draw(sampler, logits, 4000).tolist())
    assert seen == expected


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("top_p", [0.3, 0.75, 0.95])
def test_top_p_support_on_random_logits(temperature, top_p):
    gen = torch.Generator().manual_seed(int(temperature * 10 + top_p * 100))
    logits = torch.randn(12, generator=gen) * 2
    probs = torch.softmax(logits.double() / temperature, -1).numpy()
    expected = nucleus(probs, top_p)
    # keep clear of ties at the boundary, where float rounding may legitimately decide
    cum = np.cumsum(np.sort(probs)[::-1])
    assert np.min(np.abs(cum - top_p)) > 1e-4
    sampler = Sampler(SamplingConfig(temperature=temperature, top_p=top_p, seed=3))
    samples = draw(sampler, logits, 20000)
    seen = set(samples.tolist())
    assert seen <= expected, f"sampled outside the nucleus: {sorted(seen - expected)}"
    # every kept token appears, unless its renormalized share is too small to show up
    kept = probs[sorted(expected)] / probs[sorted(expected)].sum()
    must_see = {t for t, q in zip(sorted(expected), kept) if q > 1e-3}
    assert must_see <= seen
    # within the nucleus the shares follow the renormalized probabilities
    counts = torch.bincount(samples, minlength=len(probs)).double() / len(samples)
    for t, q in zip(sorted(expected), kept):
        assert abs(counts[t].item() - q) < 0.02, (t, counts[t].item(), q)


def test_top_p_rows_are_independent():
    # one batch with a peaked row and a flat row: each keeps its own nucleus
    peaked = torch.tensor([5.0, 0.0, 0.0, 0.0])
    flat = torch.zeros(4)
    logits = torch.stack([peaked, flat]).repeat(2000, 1)
    sampler = Sampler(SamplingConfig(temperature=1.0, top_p=0.5, seed=0))
    out = sampler(logits).view(2000, 2)
    assert set(out[:, 0].tolist()) == {0}  # p(0) = 0.98 >= 0.5
    assert set(out[:, 1].tolist()) == {0, 1}  # flat: two of 0.25 reach 0.5 (ties by sort order)


# ---- temperature -----------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 2.5])
def test_temperature_matches_softmax(temperature):
    logits = torch.tensor([1.5, 0.2, -0.7, 0.9, -2.0, 0.0])
    expected = torch.softmax(logits.double() / temperature, -1)
    n = 100_000
    sampler = Sampler(SamplingConfig(temperature=temperature, top_p=1.0, seed=11))
    counts = torch.bincount(draw(sampler, logits, n), minlength=len(logits)).double() / n
    # the standard error of a share is at most 0.0016 here; allow about 4 of them
    assert torch.allclose(counts, expected, atol=0.0065), (counts, expected)


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 40_000
    top_share = {}
    for t in (0.25, 1.0, 4.0):
        sampler = Sampler(SamplingConfig(temperature=t, seed=5))
        top_share[t] = (draw(sampler, logits, n) == 0).double().mean().item()
    assert top_share[0.25] > top_share[1.0] > top_share[4.0]


def test_same_seed_same_draws_in_sampler():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    cfg = SamplingConfig(temperature=0.8, top_p=0.9, seed=42)
    a, b = Sampler(cfg), Sampler(cfg)
    assert all(torch.equal(a(logits), b(logits)) for _ in range(10))
