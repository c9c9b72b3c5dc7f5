"""The same schedules on CUDA (streams, events, pinned memory); skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Policy
from conftest import hf_greedy

pytestmark = pytest.mark.cuda

PROMPT = [2, 5, 17, 99, 45, 8, 200, 31, 7, 300]
STEPS = 12

POLICIES = {
    "all-on-gpu": Policy(),
    "weights-cpu-cache-cpu-overlap": Policy.from_percent([0, 100, 0, 100, 100, 0]),
    "mixed-disk-three-batches": Policy.from_percent([30, 30, 20, 50, 50, 30], num_gpu_batches=3),
    "cpu-cache-compute": Policy.from_percent([100, 0, 0, 100, 100, 0], cpu_cache_compute=True),
    "no-overlap": Policy.from_percent([0, 100, 0, 100, 100, 0], overlap=False),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_cuda_matches_transformers_fp32(tiny_opt, name):
    model, store = tiny_opt
    ref_tokens, ref_logits = hf_greedy(model, PROMPT, STEPS)
    with OffloadedLM.load(path=store, device="cuda", dtype="float32", policy=POLICIES[name],
                          progress=False) as lm:
        out = lm.generate([PROMPT], STEPS, stop_token_id=None, keep_logits=True)
    assert out.token_ids[0] == ref_tokens
    assert (out.logits[0] - ref_logits).abs().max().item() < 1e-3  # TF32 may be on


def test_cuda_fp16_overlap_equals_no_overlap(tiny_opt):
    _, store = tiny_opt
    outs = []
    for overlap in (True, False):
        policy = Policy.from_percent([0, 100, 0, 100, 100, 0], overlap=overlap, num_gpu_batches=2)
        with OffloadedLM.load(path=store, device="cuda", policy=policy, progress=False) as lm:
            outs.append(lm.generate([PROMPT, PROMPT[:5]], STEPS, stop_token_id=None,
                                    keep_logits=True))
            assert lm.tiers.pin_host
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logits, outs[1].logits):
        assert torch.equal(a, b)
