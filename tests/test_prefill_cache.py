"""A kept prefill (flexgen_infinigen.prefill_cache): starting a block from it gives exactly
what running the prefill gives, for every KV policy and cache format; it is found by
everything it depends on; on disk it is written whole or not at all."""
from __future__ import annotations

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.kv import make_kv_policy
from flexgen_infinigen.engine.prefill_cache import PrefillCache

PROMPTS = [[1, 5, 17, 99, 45, 8, 200, 31, 7, 300, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 3, 9],
           [1, 40, 41, 42, 43, 44, 45, 46, 400, 2, 77],
           [1, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74],
           [1, 90, 91, 92]]
STEPS = 6
POLICIES = [("full", {}, False), ("full", {}, True),
            ("infinigen", {"max_kv_fraction": 0.3, "min_num_kv": 4}, False),
            ("infinigen", {"max_kv_fraction": 0.3, "min_num_kv": 4,
                           "speculation_keys": "pages8"}, False),
            ("oracle", {"max_kv_fraction": 0.3, "min_num_kv": 4}, False),
            ("h2o", {"hh_ratio": 0.2, "recent_ratio": 0.2}, False)]


def _load(store, compress=False, batch=2):
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=batch,
                                 num_gpu_batches=2, compress_cache=compress)
    return OffloadedLM.load(path=store, policy=policy, progress=False)


def _generate(lm, kv, kw, cache=None):
    lm.use_kv_policy(make_kv_policy(kv, **kw))
    return lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True,
                       prefill_cache=cache)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_opt"])
def test_a_kept_prefill_decodes_as_a_fresh_one(family, request, tmp_path):
    """One prefill, kept by a full-cache run, then every policy decoded from it (from memory
    and, in a second cache, from disk): the same tokens and logits as its own prefill."""
    _, store = request.getfixturevalue(family)
    in_memory, disk = PrefillCache(), PrefillCache(tmp_path)
    with _load(store) as lm:
        for cache in (in_memory, disk):
            first = _generate(lm, "full", {}, cache)
            assert first.prefills_reused == 0 and len(cache.memory) == 1  # one block of 2 x 2
    assert disk.memory[next(iter(disk.memory))].kv == {}  # on disk only, read when used
    on_disk = PrefillCache(tmp_path)
    for kv, kw, compress in POLICIES:
        with _load(store, compress) as lm:
            fresh = _generate(lm, kv, kw)
            for kept in (in_memory, disk, on_disk):
                reused = _generate(lm, kv, kw, kept)
                assert reused.token_ids == fresh.token_ids, (kv, compress)
                for a, b in zip(reused.logits, fresh.logits):
                    assert torch.equal(a, b), (kv, compress)
                # H2O scores heavy hitters with the prompt's queries: it prefills itself
                assert reused.prefills_reused == (0 if kv == "h2o" else 1)
    assert on_disk.hits > 0


def test_the_key_is_everything_the_prefill_depends_on(tiny_llama, tiny_opt, tmp_path):
    _, store = tiny_llama
    with _load(store) as lm:
        batches = lm._pad_batches(PROMPTS[:2])
        key = PrefillCache.key(lm, batches)
        assert key == PrefillCache.key(lm, lm._pad_batches(PROMPTS[:2]))
        assert key != PrefillCache.key(lm, lm._pad_batches([PROMPTS[0], PROMPTS[1][:-1]]))
        assert key != PrefillCache.key(lm, lm._pad_batches(PROMPTS[1::-1]))
    with _load(store, batch=1) as lm:  # another GPU batch shape
        assert key != PrefillCache.key(lm, lm._pad_batches(PROMPTS[:2]))
    with _load(tiny_opt[1]) as lm:  # another model
        assert key != PrefillCache.key(lm, lm._pad_batches(PROMPTS[:2]))


def test_an_interrupted_write_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    """A prefill is written layer by layer to a temporary name: stopped half way (Ctrl-C while
    the third tensor is read back), nothing is left that a later run could find."""
    from flexgen_infinigen.engine.prefill_cache import Prefilled

    _, store = tiny_llama
    cache = PrefillCache(tmp_path)
    real_take, calls = Prefilled.take, []

    def take(self, *a):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_take(self, *a)

    monkeypatch.setattr(Prefilled, "take", take)
    with _load(store) as lm, pytest.raises(KeyboardInterrupt):
        _generate(lm, "full", {}, cache)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(Prefilled, "take", real_take)
    with _load(store) as lm:
        assert _generate(lm, "full", {}, PrefillCache(tmp_path)).prefills_reused == 0


def test_a_kept_prefill_copies_nothing_while_the_block_runs(smollm2_store):
    """Kept from exact caches, a prefill holds functions that read each layer back when it
    is written (no copy of the whole prompt's keys and values beside the cache); a 4-bit
    cache is not exact, so its prompt's own keys and values are kept."""
    from flexgen_infinigen.engine.prefill_cache import Prefilled

    seen = []
    real_put = PrefillCache.put

    def put(self, key, prefilled):
        seen.append((len(prefilled.sources), len(prefilled.kv)))
        real_put(self, key, prefilled)

    PrefillCache.put = put
    try:
        for compress in (False, True):  # head dim 64: a 4-bit cache really is 4-bit
            with _load(smollm2_store, compress) as lm:
                lm.generate(PROMPTS, 2, stop_token_id=None, prefill_cache=PrefillCache())
    finally:
        PrefillCache.put = real_put
    layers = 30 * 2  # SmolLM2's layers x GPU batches
    assert seen == [(layers, 0), (0, layers)]
    assert Prefilled  # the class the sources live in


def test_a_pipeline_rank_refuses_it():
    from flexgen_infinigen.pipeline.engine import PipelineEngine

    assert PipelineEngine.reuses_prefill is False
    lm = OffloadedLM.__new__(OffloadedLM)
    lm.engine = PipelineEngine.__new__(PipelineEngine)
    lm.cfg = None
    with pytest.raises(ConfigError, match="prefill"):
        OffloadedLM.generate(lm, [[1, 2]], 2, prefill_cache=PrefillCache())
