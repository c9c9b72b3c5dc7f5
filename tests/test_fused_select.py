"""InfiniGen inside the fused decode call (``kv/infinigen/fused_select.py``,
``kernels/decode_select.c``) against the per-operation path (``FLEXGEN_INFINIGEN_FUSED=0``):
the same tokens, the same rows read, logits to float rounding, for each way a step can go:
the chosen rows and the next layer's speculation in the call; steps that read a layer whole
(its new keys waiting, then packed when it starts selecting); speculation the call does not
take (another rule: the engine speculates from the call's attention input); a per-prompt
skew (a projection per sequence); and speculation keys the call does not write (partial
keys: the two calls around the policy's attention)."""
from __future__ import annotations

import pytest

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.kernels import cpu_kernels
from flexgen_infinigen.engine import stage_plan as fused_decode
from flexgen_infinigen.kernels.layer_call import ATTEND, IN, LayerCall
from flexgen_infinigen.kv.infinigen import fused_select
from flexgen_infinigen.kernels.cpu_kernels import library

pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler for the kernels")

PROMPTS = [[1] + list(range(7, 60)), [1] + list(range(100, 140))]
ATTENDING = ATTEND | fused_select.CHOSEN


def _calls(monkeypatch) -> list:
    """(whether the layer selects, mode) of every fused call of a stage with a KV cache."""
    calls, selecting = [], {}  # selecting: id of a call -> whether its InfiniGen layer selects
    real, real_layer = LayerCall.run, fused_select.SelectPlan.layer

    def layer(self, h, state, loaded):
        selecting[id(self.call)] = self.cache.selecting
        return real_layer(self, h, state, loaded)

    def recorded(self, mode):
        if self.kind != "mlp":
            calls.append((selecting.get(id(self)), mode))
        return real(self, mode)
    monkeypatch.setattr(fused_select.SelectPlan, "layer", layer)
    monkeypatch.setattr(LayerCall, "run", recorded)
    return calls


def _generate(path, monkeypatch, fused: bool, options: dict, steps: int = 10):
    monkeypatch.setenv(fused_decode.ENV, "1" if fused else "0")
    # the per-operation path through the attention kernel at every length, as the call
    monkeypatch.setattr(cpu_kernels, "MIN_ATTEND_ROWS", 0 if not fused else
                        cpu_kernels.MIN_ATTEND_ROWS)
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=len(PROMPTS))
    with OffloadedLM.load(path=path, policy=policy, kv_policy="infinigen",
                          kv_options={"max_kv_fraction": 0.3, "min_num_kv": 4,
                                      # the rehearsal's speculation unless said
                                      "speculation_query": "input", **options},
                          progress=False) as lm:
        assert (lm.engine.fused is not None) == fused
        out = lm.generate(PROMPTS, steps, stop_token_id=None, keep_logits=True)
        return out, lm.engine.kv_policy.report()


def _assert_same(path, monkeypatch, options: dict, tol: float = 1e-4) -> list:
    calls = _calls(monkeypatch)
    (out_a, rep_a) = _generate(path, monkeypatch, True, options)
    seen = list(calls)
    (out_b, rep_b) = _generate(path, monkeypatch, False, options)
    assert out_a.token_ids == out_b.token_ids
    assert rep_a["kv_fetch_fraction_per_layer"] == rep_b["kv_fetch_fraction_per_layer"]
    for x, y in zip(out_a.logits, out_b.logits):
        assert (x - y).abs().max().item() < tol * max(1.0, y.abs().max().item())
    return seen


def test_chosen_rows_and_speculation_in_one_call(tiny_llama, monkeypatch):
    calls = _assert_same(tiny_llama[1], monkeypatch, {})
    assert calls and all(m & ATTENDING for _, m in calls)  # one call a layer
    assert all(m & fused_select.CHOSEN for selecting, m in calls if selecting)
    assert any(m & fused_select.SPECULATE for _, m in calls)


def test_steps_read_whole_then_selecting(tiny_llama, monkeypatch):
    """``--select-from-mb`` between the first and the last step's KV (2 sequences x 2 KV
    heads x 256 bytes a token): the first steps read the selecting layers whole, in the call,
    their keys deferred; later steps pack them, then score and choose."""
    calls = _assert_same(tiny_llama[1], monkeypatch, {"select_from_mb": 59 * 1024 / 1e6})
    chosen = [bool(m & fused_select.CHOSEN) for selecting, m in calls if selecting]
    assert not chosen[0] and chosen[-1], "expected whole steps, then chosen rows"
    assert all(m & ATTENDING for _, m in calls)


def test_speculation_the_call_does_not_take(tiny_llama, monkeypatch):
    """Another selection rule: the engine speculates from the call's attention input; the
    chosen rows are still attended in the call."""
    calls = _assert_same(tiny_llama[1], monkeypatch, {"selection": "cap"})
    assert not any(m & fused_select.SPECULATE for _, m in calls)
    assert any(m & fused_select.CHOSEN for _, m in calls)


def test_per_prompt_skew(tiny_llama, monkeypatch):
    """A projection per sequence (``--prompt-skew``: batch stride not 0)."""
    calls = _assert_same(tiny_llama[1], monkeypatch, {"prompt_skew": True})
    assert any(m & fused_select.SPECULATE for _, m in calls)


def test_partial_keys_keep_two_calls(tiny_llama, monkeypatch):
    """Speculation keys the call does not write (the paper's partial columns): the
    selecting layers run the input call, the policy's attention, the output call."""
    calls = _assert_same(tiny_llama[1], monkeypatch, {"speculation_keys": "partial"})
    assert any(m == IN for _, m in calls)
    assert not any(m & fused_select.CHOSEN for _, m in calls)


def test_no_kernels_runs_the_torch_path(tiny_llama, monkeypatch):
    """Without the compiled kernels (no compiler) InfiniGen decodes through torch."""
    monkeypatch.setattr(cpu_kernels, "_lib", None)  # as library() leaves it without one
    monkeypatch.setattr(cpu_kernels, "_tried", True)
    monkeypatch.setenv(fused_decode.ENV, "1")
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=2)
    with OffloadedLM.load(path=tiny_llama[1], policy=policy, kv_policy="infinigen",
                          progress=False) as lm:
        assert lm.engine.fused is None
        out = lm.generate(PROMPTS, 4, stop_token_id=None)
        assert all(len(t) == 4 for t in out.token_ids)
