"""``--speculation-query renorm``: the rehearsal takes layer i's residual through layer i+1's
own input norm, computed from layer i's attention input without reading the residual again;
exact when InfiniGen keeps everything; refused where there is no such norm."""
from __future__ import annotations

import math

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.kv import InfiniGenOptions

PROMPTS = [[2, 5, 17, 99, 45, 8, 200, 31, 7, 300, 12, 13, 14, 15, 16, 17],
           [2, 40, 41, 42, 43, 44, 45, 46]]
CPU_CACHE = Placement.from_percent([100, 0, 0, 100, 100, 0])


def _uneven_norms(model, bias: bool) -> None:
    """Every layer's attention norm a different elementwise weight (and bias): random
    models start with ones, where the two queries would be the same."""
    gen = torch.Generator().manual_seed(3)
    for name, p in model.named_parameters():
        if "layernorm" in name.lower() or "layer_norm" in name.lower() or "norm" in name:
            with torch.no_grad():
                if name.endswith("weight"):
                    p.copy_(0.5 + torch.rand(p.shape, generator=gen))
                elif bias:
                    p.copy_(0.2 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Converted stores of a small Llama (RMSNorm), a small pre-norm OPT (LayerNorm with
    bias) and a small Qwen3 (q/k norms), their norms uneven."""
    from transformers import (LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    from flexgen_infinigen.weights.hf_convert import convert_hf

    torch.manual_seed(0)
    out = {}
    for name, model, bias in [
        ("llama", LlamaForCausalLM(LlamaConfig(
            vocab_size=512, hidden_size=128, num_hidden_layers=4, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False)).eval(), False),
        ("opt", OPTForCausalLM(OPTConfig(
            vocab_size=512, hidden_size=128, num_hidden_layers=3, ffn_dim=256,
            num_attention_heads=4, max_position_embeddings=256,
            word_embed_proj_dim=128)).eval(), True),
        ("opt-post", OPTForCausalLM(OPTConfig(  # norms after attention, as OPT-350m
            vocab_size=512, hidden_size=128, num_hidden_layers=3, ffn_dim=256,
            num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=128,
            do_layer_norm_before=False)).eval(), True),
        ("qwen3", Qwen3ForCausalLM(Qwen3Config(
            vocab_size=512, hidden_size=128, num_hidden_layers=3, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=256, tie_word_embeddings=False)).eval(), False)]:
        _uneven_norms(model, bias)
        folder = tmp_path_factory.mktemp(f"renorm-{name}")
        model.save_pretrained(folder)
        out[name] = convert_hf(folder, folder / "store", f"renorm-{name}")
    return out


def _norm_weights(lm, layer: int) -> dict:
    names = [n for n in ("attn_norm.weight", "attn_norm.bias")
             if f"layers.{layer}.{n}" in lm.engine.weights]
    return {n: lm.engine.weights[f"layers.{layer}.{n}"].read() for n in names}


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_renorm_query_is_the_next_layers_norm_of_the_residual(stores, family):
    """The renorm query from layer i's attention input equals the input query computed from
    layer i+1's own norm of the same residual (an independent route: the family's norm on
    h), and differs from the input query (the norms differ)."""
    opts = {"speculation_query": "renorm", "max_kv_fraction": 0.5, "min_num_kv": 4,
            "first_layer": 1}
    with OffloadedLM.load(path=stores[family], policy=CPU_CACHE, kv_policy="infinigen",
                          kv_options=opts, progress=False) as lm:
        lm.generate([PROMPTS[0]], 2, stop_token_id=None)
        rehearsal, fam, cfg = lm.engine.kv_policy.rehearsal, lm.engine.family, lm.cfg
        layer = 2
        h = 3 * torch.randn(2, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        x_before = fam.attn_input(cfg, _norm_weights(lm, layer - 1), h)
        x_own = fam.attn_input(cfg, _norm_weights(lm, layer), h)
        pos = fam.encode_positions(cfg, torch.tensor([[5], [9]]))
        proj = rehearsal.query_projection(rehearsal.projections[layer].expand(
            2, *rehearsal.projections[layer].shape))
        kv = cfg.num_kv_heads
        renormed = rehearsal.projected_query(layer, x_before, pos, kv, proj)
        kept, rehearsal.renorm[layer] = rehearsal.renorm[layer], None
        own = rehearsal.projected_query(layer, x_own, pos, kv, proj)
        plain = rehearsal.projected_query(layer, x_before, pos, kv, proj)
        rehearsal.renorm[layer] = kept
    assert (renormed - own).abs().max() <= 1e-4 * own.abs().max()
    assert (plain - own).abs().max() > 1e-2 * own.abs().max()


@pytest.mark.parametrize("query", ["renorm", "own"])
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_keeping_everything_equals_full(stores, family, query):
    """With every row kept, InfiniGen with either query (``own``: each layer chooses with its
    own query as it attends) gives the full cache's tokens and logits."""
    keep_all = InfiniGenOptions(alpha=math.inf, max_kv_fraction=1.0, first_layer=1,
                                speculation_query=query)
    outs = []
    for kv, kw in (("full", None), ("infinigen", {"options": keep_all})):
        with OffloadedLM.load(path=stores[family], policy=CPU_CACHE, kv_policy=kv,
                              kv_options=kw, progress=False) as lm:
            outs.append(lm.generate(PROMPTS, 8, stop_token_id=None, keep_logits=True))
            if kv == "infinigen":
                assert lm.engine.kv_policy.settings()["speculation_query"] == query
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logits, outs[1].logits):
        assert (a - b).abs().max().item() < 1e-4


DISK_CACHE = Placement.from_percent([100, 0, 0, 0, 100, 0])


@pytest.mark.parametrize("family,policy,want", [
    ("llama", CPU_CACHE, "own"), ("llama", DISK_CACHE, "renorm"),
    ("opt-post", DISK_CACHE, "input"), ("opt-post", CPU_CACHE, "own")])
def test_auto_query_takes_the_best_that_runs(stores, family, policy, want):
    """``auto`` never refuses: ``own`` where the caches are read in place by a CPU, else
    ``renorm`` where every layer has a norm before attention, else the paper's ``input``
    (post-norm OPT, cache on disk); and it decodes as asking for that query by name."""
    outs = []
    for query in ("auto", want):
        with OffloadedLM.load(path=stores[family], policy=policy, kv_policy="infinigen",
                              kv_options={"speculation_query": query, "first_layer": 1,
                                          "max_kv_fraction": 0.5, "min_num_kv": 4},
                              progress=False) as lm:
            outs.append(lm.generate(PROMPTS, 4, stop_token_id=None, keep_logits=True))
            assert lm.engine.kv_policy.settings()["speculation_query"] == want
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logits, outs[1].logits):
        assert torch.equal(a, b)


def test_bad_speculation_query():
    with pytest.raises(ConfigError, match="--speculation-query"):
        InfiniGenOptions(speculation_query="exact").validate()


def test_renorm_refused_where_a_norm_zeroes_a_channel(stores, monkeypatch):
    """A zero in layer i's norm weight loses that channel of its attention input: refused
    with one line naming the option, not a division by zero."""
    from flexgen_infinigen.kv.infinigen import rehearsal as module

    real = module.Rehearsal._renorm

    def zeroed(self, engine, layer):
        name = f"layers.{layer - 1}.attn_norm.weight"
        if name in engine.weights:
            engine.weights[name].read()[0] = 0.0
        return real(self, engine, layer)
    monkeypatch.setattr(module.Rehearsal, "_renorm", zeroed)
    with pytest.raises(ConfigError, match="--speculation-query renorm"):
        with OffloadedLM.load(path=stores["llama"], policy=CPU_CACHE, kv_policy="infinigen",
                              kv_options={"speculation_query": "renorm", "first_layer": 1},
                              progress=False) as lm:
            lm.generate([PROMPTS[0]], 2, stop_token_id=None)


def test_renorm_in_the_fused_call_equals_per_operation(stores, monkeypatch):
    """The fused decode call renorms the rehearsal's input itself (``decode_select.c``):
    the same tokens, rows and logits as the per-operation path, with the next layer's
    speculation inside the call."""
    from flexgen_infinigen.kernels import cpu_kernels
    from flexgen_infinigen.kv.infinigen import fused_select
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler for the kernels")
    import test_fused_select as fs

    calls = fs._assert_same(stores["llama"], monkeypatch, {"speculation_query": "renorm",
                                                           "first_layer": 1})
    assert any(m & fused_select.SPECULATE for _, m in calls)


def test_own_query_with_float_keys_chooses_what_the_oracle_chooses(stores):
    """With float speculation keys of every skewed column (an orthogonal skew: the same
    scores), the layer's own query gives the exact scores, so ``own`` reads the rows the
    exact oracle reads at the same budget: the same tokens and the same share of the KV."""
    opts = dict(max_kv_fraction=0.3, min_num_kv=4, first_layer=1)
    got = []
    for kv, extra in (("oracle", {}), ("infinigen", dict(
            speculation_query="own", speculation_keys="partial", partial_weight_ratio=1.0,
            select_from_mb=0.0))):
        with OffloadedLM.load(path=stores["llama"], policy=CPU_CACHE, kv_policy=kv,
                              kv_options={**opts, **extra}, progress=False) as lm:
            out = lm.generate(PROMPTS, 8, stop_token_id=None, keep_logits=True)
            got.append((out, lm.engine.kv_policy.report()))
    (a, rep_a), (b, rep_b) = got
    assert rep_b["kv_fetch_fraction"] < 0.9  # it chose
    assert a.token_ids == b.token_ids
    assert rep_a["kv_selected_fraction"] == pytest.approx(rep_b["kv_selected_fraction"])
    for x, y in zip(a.logits, b.logits):
        assert (x - y).abs().max().item() < 1e-3


def test_own_query_refused_off_the_cpu_cache(stores):
    """A cache on disk is not read in place: ``own`` (which fetches nothing ahead) is
    refused by name when the caches are made, before any decode step."""
    with pytest.raises(ConfigError, match="--speculation-query own"):
        with OffloadedLM.load(path=stores["llama"], policy=Placement.from_percent(
                [100, 0, 0, 0, 100, 0]), kv_policy="infinigen",
                kv_options={"speculation_query": "own", "first_layer": 1},
                progress=False) as lm:
            lm.generate([PROMPTS[0]], 2, stop_token_id=None)


@pytest.mark.parametrize("family,keys", [("llama", None), ("llama", "int8"), ("qwen3", None)])
def test_own_query_in_the_fused_call_equals_per_operation(stores, monkeypatch, family, keys):
    """The fused decode call chooses a layer's rows from its own query (``decode_select.c``,
    DL_OWN) before it attends: the same tokens, rows and logits as the per-operation path's
    choice in ``InfiniGenCache.attend``; with q/k norms too (Qwen3), which the rehearsal's
    query in the call does not take."""
    from flexgen_infinigen.kernels import cpu_kernels
    from flexgen_infinigen.kv.infinigen import fused_select
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler for the kernels")
    import test_fused_select as fs

    opts = {"speculation_query": "own", "first_layer": 1}
    if keys:
        opts["speculation_keys"] = keys
    calls = fs._assert_same(stores[family], monkeypatch, opts)
    assert any(m & fused_select.OWN_QUERY for _, m in calls)
    assert not any(m & fused_select.SPECULATE for _, m in calls)
