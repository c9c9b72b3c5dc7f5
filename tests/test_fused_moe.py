"""A decode step's MoE MLP stage in one compiled call (``engine/fused_moe.py``,
``kernels/moe_layer.c``): against the per-operation path it
replaces (``models/llama.py``'s ``mlp``: torch's softmax and top-k, the experts call) on
the same weights, with the top-k renormalised and not, on router ties, for one token and
the most the call takes; what it refuses; and in the engine, a GGUF's decode with the call
against the same decode on the per-operation MoE path."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_half_scales import _weights

from flexgen_infinigen.config import get_config
from flexgen_infinigen.models import llama, moe
from flexgen_infinigen.kernels import cpu_kernels
from flexgen_infinigen.engine import fused_moe, stage_plan

H, FF, E = 256, 256, 12  # hidden, expert width (whole K-quant blocks), experts


@pytest.fixture(autouse=True)
def _kernels():
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler: the per-operation path runs instead")


def _stage(top_k: int, renorm: bool, seed: int, router_scale: float = 1.0, kind="Q4_0"):
    """A MoE stage's weights (float16-factor experts, float32 router and norm) and its
    config."""
    cfg = dataclasses.replace(get_config("qwen3-30b-a3b"), hidden_size=H,
                              expert_intermediate_size=FF, num_experts=E,
                              experts_per_token=top_k, norm_topk_prob=renorm)
    gen = torch.Generator().manual_seed(seed)
    w = {moe.ROUTER: torch.randn(E, H, generator=gen) * router_scale,
         "mlp_norm.weight": torch.rand(H, generator=gen) + 0.5}
    for e in range(E):
        for i, (m, shape) in enumerate(zip(moe.EXPERT_MATRICES, ((FF, H), (FF, H), (H, FF)))):
            w[f"experts.{e}.{m}.weight"] = _weights(kind, shape, seed=seed + 3 * e + i)[0]
    return cfg, w


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K"])
@pytest.mark.parametrize("tokens,top_k,renorm", [(1, 4, True), (1, 4, False), (3, 2, True),
                                                 (16, 8, False), (16, 12, True)])
def test_matches_the_per_operation_path(kind, tokens, top_k, renorm):
    """The outputs agree with the per-operation path's to float32 rounding (the router's
    weights may differ from torch's softmax in the last bit; an expert chosen differently
    would move them by far more)."""
    cfg, w = _stage(top_k, renorm, seed=tokens + top_k, kind=kind)
    plan = fused_moe.moe_plan(cfg, w)
    assert plan is not None
    h = torch.randn(tokens, 1, H, generator=torch.Generator().manual_seed(tokens)) * 3
    ours = plan(h)
    theirs = llama.mlp(cfg, w, h)
    assert ours is not None and ours.shape == h.shape
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_a_tie_at_the_last_expert_is_left_to_torch():
    """Where an expert left out ties with the K-th chosen (a router of zeros: every expert
    equally likely) the call declines, for torch.topk's own choice among equal values
    (which follows no index order) to decide, as in transformers; ties among the chosen
    only are the call's."""
    cfg, w = _stage(3, False, seed=5, router_scale=0.0)
    h = torch.randn(2, 1, H, generator=torch.Generator().manual_seed(1))
    assert fused_moe.moe_plan(cfg, w)(h) is None
    cfg, w = _stage(E, True, seed=5, router_scale=0.0)  # every expert chosen: no tie left out
    ours = fused_moe.moe_plan(cfg, w)(h)
    theirs = llama.mlp(cfg, w, h)
    assert ours is not None and (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_refuses_what_it_does_not_compute():
    """No plan for a float expert, a shared expert, a float16 router, or the fused calls
    turned off; no call for more tokens than it takes (the per-operation path runs them)."""
    cfg, w = _stage(2, True, seed=0)
    assert fused_moe.moe_plan(cfg, w) is not None
    floats = dict(w, **{"experts.3.up_proj.weight": torch.randn(FF, H)})
    assert fused_moe.moe_plan(cfg, floats) is None
    assert fused_moe.moe_plan(dataclasses.replace(cfg, shared_expert_size=64), w) is None
    half_router = dict(w, **{moe.ROUTER: w[moe.ROUTER].half()})
    assert fused_moe.moe_plan(cfg, half_router) is None
    assert fused_moe.moe_plan(cfg, w)(torch.randn(fused_moe.MAX_TOKENS + 1, 1, H)) is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEXGEN_INFINIGEN_FUSED", "0")
        assert fused_moe.moe_plan(cfg, w) is None


@pytest.mark.parametrize("family,extra", [
    ("qwen3moe", dict(norm_topk_prob=True, mlp_only_layers=[1])),
    ("olmoe", dict(norm_topk_prob=False))])
def test_decode_with_and_without_the_call(tmp_path, monkeypatch, family, extra):
    """A GGUF with Q4_0 experts decoding two sequences: the same tokens with every MoE
    stage of every decode step in one call as on the per-operation path, and logits
    within float32 rounding of the router's weights (measured: the largest change over the
    largest logit)."""
    import test_moe_gguf as moe_files

    from flexgen_infinigen import OffloadedLM, Placement
    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    base = moe_files.FAMILIES[family]
    name = f"{family}-64"
    width = "moe_intermediate_size" if family == "qwen3moe" else "intermediate_size"
    monkeypatch.setitem(moe_files.FAMILIES, name, (
        base[0], base[1], dict(base[2], **{width: 64}, **extra), base[3]))
    model = moe_files._tiny(name)
    path = tmp_path / "q4_0.gguf"
    moe_files.write_moe_gguf(model, name, path, "Q4_0")
    store = convert_gguf(path, tmp_path / "store", progress=False)
    policy = Placement.from_percent([100, 0, 100, 0, 100, 0])

    def run():
        with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
            out = lm.generate(moe_files.PROMPTS[:2], moe_files.STEPS, stop_token_id=None,
                              keep_logits=True)
            return out, sum(p.moe is not None for p in lm.engine.plans.moe.values())
    fused, planned = run()
    monkeypatch.setattr(stage_plan, "moe_plan", lambda cfg, w: None)
    apart, none = run()
    assert planned == model.config.num_hidden_layers - len(extra.get("mlp_only_layers", []))
    assert none == 0
    assert fused.token_ids == apart.token_ids
    for a, b in zip(fused.logits, apart.logits):
        assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()
