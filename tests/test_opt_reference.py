"""OPT logits and greedy tokens equal transformers' under every placement and schedule."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import hf_greedy

from flexgen_infinigen import OffloadedLM, Placement

PROMPTS = [[2, 5, 17, 99, 45, 8, 200, 31, 7, 300],
           [2, 40, 41, 42],
           [2, 9, 8, 7, 6, 5, 4, 3]]
STEPS = 12

POLICIES = {
    "all-on-device": Placement(),
    "weights-on-cpu": Placement.from_percent([0, 100, 100, 0, 100, 0]),
    "weights-on-disk": Placement.from_percent([0, 0, 100, 0, 100, 0]),
    "cache-on-cpu": Placement.from_percent([100, 0, 0, 100, 100, 0]),
    "cache-on-disk": Placement.from_percent([100, 0, 0, 0, 100, 0]),
    "mixed-split": Placement.from_percent([30, 30, 20, 50, 50, 30]),
    "mixed-no-overlap": Placement.from_percent([30, 30, 20, 50, 50, 30], overlap=False),
    "no-sep-layer": Placement.from_percent([20, 40, 0, 100, 100, 0], sep_layer=False),
    "cpu-cache-compute": Placement.from_percent([100, 0, 0, 100, 100, 0], cpu_cache_compute=True),
    "cpu-compute-disk-cache": Placement.from_percent([0, 100, 0, 60, 100, 0],
                                                  cpu_cache_compute=True, overlap=False),
    "activations-offloaded": Placement.from_percent([100, 0, 100, 0, 0, 50]),
    "three-gpu-batches": Placement.from_percent([0, 100, 0, 100, 100, 0], num_gpu_batches=3),
    "three-gpu-batches-no-overlap": Placement.from_percent([50, 50, 50, 50, 100, 0],
                                                        num_gpu_batches=3, overlap=False),
}
# the overlapped loop is off by default on a CPU-only machine: ask for it where not said
POLICIES = {k: p if p.overlap is not None else dataclasses.replace(p, overlap=True)
            for k, p in POLICIES.items()}


@pytest.fixture(scope="module")
def references(tiny_opt):
    model, _ = tiny_opt
    return [hf_greedy(model, p, STEPS) for p in PROMPTS]


@pytest.mark.parametrize("name", list(POLICIES))
def test_matches_transformers(tiny_opt, references, name):
    _, store = tiny_opt
    with OffloadedLM.load(path=store, policy=POLICIES[name], progress=False) as lm:
        for prompt, (ref_tokens, ref_logits) in zip(PROMPTS, references):
            # one prompt per block row; with 3 GPU batches the block is padded with dummy rows
            out = lm.generate([prompt], STEPS, stop_token_id=None, keep_logits=True)
            assert out.token_ids[0] == ref_tokens
            assert (out.logits[0] - ref_logits).abs().max().item() < 1e-4


def test_batch_of_different_lengths_equals_each_alone(tiny_opt, references):
    """Left padding and masks: every row of a mixed batch equals the prompt run alone."""
    _, store = tiny_opt
    policy = Placement.from_percent([50, 50, 0, 100, 100, 0], gpu_batch_size=2, num_gpu_batches=2)
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        # 3 prompts in a block of 4: the last block is padded, not refused
        out = lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)
    for row, (ref_tokens, ref_logits) in enumerate(references):
        assert out.token_ids[row] == ref_tokens
        assert (out.logits[row] - ref_logits).abs().max().item() < 1e-4


def test_more_prompts_than_one_block(tiny_opt, references):
    _, store = tiny_opt
    policy = Placement(gpu_batch_size=2)
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        out = lm.generate(PROMPTS * 2, STEPS, stop_token_id=None)
    assert out.token_ids == [r[0] for r in references] * 2


def test_stop_token_ends_a_row(tiny_opt, references):
    _, store = tiny_opt
    ref_tokens = references[0][0]
    stop = ref_tokens[4]
    with OffloadedLM.load(path=store, progress=False) as lm:
        out = lm.generate(PROMPTS[:2], STEPS, stop_token_id=stop)
    first = ref_tokens.index(stop)
    assert out.token_ids[0] == ref_tokens[:first + 1]
    other = references[1][0]
    expected = other[:other.index(stop) + 1] if stop in other else other
    assert out.token_ids[1] == expected


def test_fp16_close_to_fp32(tiny_opt, references):
    _, store = tiny_opt
    with OffloadedLM.load(path=store, dtype="bfloat16", progress=False,
                          policy=Placement.from_percent([50, 50, 0, 100, 100, 0])) as lm:
        out = lm.generate([PROMPTS[0]], STEPS, stop_token_id=None, keep_logits=True)
    ref_logits = references[0][1]
    err = (out.logits[0] - ref_logits).abs().max().item()
    assert err < 0.1 * ref_logits.abs().max().item()
    assert torch.equal(out.logits[0][0].argmax(), ref_logits[0].argmax())


def test_prefill_attention_in_query_chunks_matches_transformers(tiny_opt, references,
                                                                 monkeypatch):
    """Long prompts score attention a few query rows at a time; the output must not change."""
    from flexgen_infinigen.kernels import attention

    _, store = tiny_opt
    # 3 query rows per chunk for these shapes (4 heads, 10 keys): every prompt is chunked
    monkeypatch.setattr(attention, "SCORE_CHUNK_BYTES", 4 * 4 * 10 * 3)
    with OffloadedLM.load(path=store, progress=False) as lm:
        for prompt, (ref_tokens, ref_logits) in zip(PROMPTS, references):
            out = lm.generate([prompt], STEPS, stop_token_id=None, keep_logits=True)
            assert out.token_ids[0] == ref_tokens
            assert (out.logits[0] - ref_logits).abs().max().item() < 1e-4
