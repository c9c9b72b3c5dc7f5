"""The same schedules on CUDA (streams, events, pinned memory); skipped without a GPU."""
from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

from flexgen_infinigen import OffloadedLM, Placement

pytestmark = pytest.mark.cuda

PROMPT = [2, 5, 17, 99, 45, 8, 200, 31, 7, 300]
STEPS = 12

POLICIES = {
    "all-on-gpu": Placement(),
    "weights-cpu-cache-cpu-overlap": Placement.from_percent([0, 100, 0, 100, 100, 0]),
    "mixed-disk-three-batches": Placement.from_percent([30, 30, 20, 50, 50, 30], num_gpu_batches=3),
    "cpu-cache-compute": Placement.from_percent([100, 0, 0, 100, 100, 0], cpu_cache_compute=True),
    "no-overlap": Placement.from_percent([0, 100, 0, 100, 100, 0], overlap=False),
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
        policy = Placement.from_percent([0, 100, 0, 100, 100, 0], overlap=overlap,
                                        num_gpu_batches=2)
        with OffloadedLM.load(path=store, device="cuda", policy=policy, progress=False) as lm:
            outs.append(lm.generate([PROMPT, PROMPT[:5]], STEPS, stop_token_id=None,
                                    keep_logits=True))
            assert lm.tiers.pin_host
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logits, outs[1].logits):
        assert torch.equal(a, b)


# ---- the matrix: policies x cache placement x compression x family x dtype ------------------
CACHE_PLACES = {"gpu": [100, 0, 100, 0, 100, 0], "cpu": [100, 0, 0, 100, 100, 0],
                "mixed-disk": [100, 0, 40, 30, 100, 0]}
KV = {"full": None, "infinigen": None, "h2o": {"hh_ratio": 0.2, "recent_ratio": 0.2}}


class _Delayed:
    """A model family whose MLP first stalls the compute stream, so that a lane reading or
    writing without waiting for compute shows up as a wrong result."""

    def __init__(self, family):
        self._family = family

    def mlp(self, cfg, w, h):
        torch.cuda._sleep(2_000_000)  # about a millisecond of GPU cycles
        return self._family.mlp(cfg, w, h)

    def __getattr__(self, name):
        return getattr(self._family, name)


def _run(store, percent, kv, dtype, compress, overlap, delay=False, batches=2):
    policy = Placement.from_percent(percent, overlap=overlap, compress_cache=compress,
                                 gpu_batch_size=2, num_gpu_batches=batches)
    with OffloadedLM.load(path=store, device="cuda", dtype=dtype, policy=policy, kv_policy=kv,
                          kv_options=KV[kv], progress=False) as lm:
        if delay:
            lm.engine.family = _Delayed(lm.engine.family)
        prompts = [PROMPT * 4, PROMPT[:5] * 3] * batches
        return lm.generate(prompts, STEPS, stop_token_id=None, keep_logits=True)


@pytest.mark.parametrize("family", ["tiny_opt", "tiny_llama"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("place", list(CACHE_PLACES))
@pytest.mark.parametrize("kv", list(KV))
def test_overlapped_equals_inline_with_a_slow_compute_stream(request, family, dtype, compress,
                                                             place, kv):
    _, store = request.getfixturevalue(family)
    args = (store, CACHE_PLACES[place], kv, dtype, compress)
    inline = _run(*args, overlap=False)
    overlapped = _run(*args, overlap=True, delay=True)
    assert overlapped.token_ids == inline.token_ids
    for a, b in zip(overlapped.logits, inline.logits):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kv", list(KV))
def test_decode_step_syncs_are_the_counted_ones(tiny_llama, kv):
    """Under torch's sync debug mode, a decode step's implicit synchronizations are no more
    than the engine counts (sampling, one index read per selecting layer)."""
    import warnings
    _, store = tiny_llama
    policy = Placement.from_percent(CACHE_PLACES["cpu"], gpu_batch_size=2)
    with OffloadedLM.load(path=store, device="cuda", dtype="float16", policy=policy,
                          kv_policy=kv, kv_options=KV[kv], progress=False) as lm:
        lm.generate([PROMPT * 3, PROMPT * 3], 3, stop_token_id=None)  # warm-up
        counted, warned = [], []
        for steps in (1, 2):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    lm.generate([PROMPT * 3, PROMPT * 3], steps, stop_token_id=None)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            warned.append(sum("synchroniz" in str(w.message) for w in caught))
            counted.append(sum(lm.engine.debug["host_syncs_per_step"]))
    assert warned[1] - warned[0] <= counted[1] - counted[0]


def test_host_tier_is_pinned_at_its_exact_size(tiny_opt):
    from flexgen_infinigen.memory.tiers import EXACT_PIN_BYTES
    _, store = tiny_opt
    policy = Placement.from_percent([0, 100, 0, 100, 100, 0], gpu_batch_size=64)
    with OffloadedLM.load(path=store, device="cuda", policy=policy, progress=False) as lm:
        big = lm.tiers.empty("host", (EXACT_PIN_BYTES * 3 + 5,), torch.uint8)
        assert lm.tiers.register_error is None, \
            f"cudaHostRegister returned CUDA error {lm.tiers.register_error}"
        assert big.is_pinned()
        assert lm.tiers.pinned_bytes >= big.numel()
        before = lm.tiers.pinned_bytes
        del big
        assert lm.tiers.pinned_bytes < before  # unregistered when freed
