"""H2O: exact at budget 1.0, keeps exactly its budget, runs in every schedule."""
from __future__ import annotations

import math

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError

PROMPTS = [[2, 5, 17, 99, 45, 8, 200, 31, 7, 300, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
           [2, 40, 41, 42, 43, 44, 45, 46]]
STEPS = 8


def _run(store, policy, kv="full", **kw):
    with OffloadedLM.load(path=store, policy=policy, kv_policy=kv, kv_options=kw or None,
                          progress=False) as lm:
        out = lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)
        caches = [c for c in lm.engine.caches.values()]
        return out, lm.engine.kv_policy.report(), caches


@pytest.mark.parametrize("policy", [Placement(gpu_batch_size=2),
                                    Placement.from_percent([50, 50, 0, 100, 100, 0],
                                                        num_gpu_batches=2, overlap=True),
                                    Placement.from_percent([100, 0, 0, 0, 100, 0], sep_layer=False,
                                                        num_gpu_batches=2)])
def test_budget_one_equals_full(tiny_opt, policy):
    full = _run(tiny_opt[1], policy)[0]
    out, report, _ = _run(tiny_opt[1], policy, "h2o", hh_ratio=0.5, recent_ratio=0.5)
    assert out.token_ids == full.token_ids
    for a, b in zip(out.logits, full.logits):
        assert (a - b).abs().max().item() < 1e-4


def test_keeps_exactly_the_budget_after_the_prompt(tiny_opt, monkeypatch):
    from flexgen_infinigen.kv import h2o

    kept = []
    original = h2o.H2OCache.store_prompt

    def spy(self, q, k, v, valid):
        original(self, q, k, v, valid)
        kept.append((self.alive[:, :k.shape[1]].sum(-1).tolist(), valid.sum(-1).tolist()))

    monkeypatch.setattr(h2o.H2OCache, "store_prompt", spy)
    _run(tiny_opt[1], Placement(gpu_batch_size=2), "h2o", hh_ratio=0.25, recent_ratio=0.25)
    heads = 4
    for per_column, n_valid in kept:
        expected = [math.ceil(n * 0.5) for n in n_valid for _ in range(heads)]
        assert per_column == expected


def test_small_budget_moves_less_and_changes_output(tiny_opt):
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=2)
    full = _run(tiny_opt[1], policy)[0]
    out, report, _ = _run(tiny_opt[1], policy, "h2o", hh_ratio=0.1, recent_ratio=0.1)
    assert report["kv_fetch_fraction"] < 0.35
    assert report["kv_bytes_fetched"] < 0.4 * report["kv_bytes_full_fetch"]
    assert not torch.equal(out.logits[0], full.logits[0])


@pytest.mark.parametrize("kw", [{"hh_ratio": -0.1}, {"recent_ratio": 1.5},
                                {"hh_ratio": 0.0, "recent_ratio": 0.0}])
def test_bad_ratios(kw):
    from flexgen_infinigen.kv import H2OPolicy
    with pytest.raises(ConfigError, match="ratio"):
        H2OPolicy(**kw)
