"""The fused CPU decode step (``kernels/decode_layer.c`` through ``engine/stage_plan.py``)
against the per-operation path it replaces: the same tokens and the same logits to float
rounding, for the full cache and InfiniGen (attention over its chosen rows and the next
layer's speculation inside the call: ``tests/test_fused_select.py`` tests its fallbacks), and
the cases that must fall back to the per-operation path."""
from __future__ import annotations

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.kernels import cpu_kernels
from flexgen_infinigen.engine import stage_plan as fused_decode
from flexgen_infinigen.kernels.layer_call import ATTEND, LayerCall
from flexgen_infinigen.kv.infinigen import fused_select
from flexgen_infinigen.kernels.cpu_kernels import library

needs_kernels = pytest.mark.skipif(library() is None, reason="no C compiler for the kernels")


def _calls(monkeypatch) -> list:
    """Record the mode of every fused call (the test then knows which path ran)."""
    modes = []
    real = LayerCall.run

    def recorded(self, mode):  # whole: the full cache's attention in the call (no InfiniGen)
        modes.append((self.kind, bool(mode & ATTEND) and not self.args.sel, mode))
        return real(self, mode)
    monkeypatch.setattr(LayerCall, "run", recorded)
    return modes


def _generate(path, prompts, kv, monkeypatch, fused: bool, steps: int = 8, **policy_kw):
    """Tokens and logits of a generation; the per-operation path (``fused`` False) attends
    through the same attention kernel at every length (it hands short caches to torch, whose
    sums round differently)."""
    monkeypatch.setenv(fused_decode.ENV, "1" if fused else "0")
    monkeypatch.setattr(cpu_kernels, "MIN_ATTEND_ROWS", 0 if not fused else
                        cpu_kernels.MIN_ATTEND_ROWS)
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=len(prompts),
                                 **policy_kw)
    # the paper's rehearsal (the next layer's speculation in the call; own: test_speculation_query)
    options = ({"max_kv_fraction": 0.3, "min_num_kv": 4, "speculation_query": "input"}
               if kv == "infinigen" else None)
    with OffloadedLM.load(path=path, policy=policy, kv_policy=kv, kv_options=options,
                          progress=False) as lm:
        assert (lm.engine.fused is not None) == fused
        out = lm.generate(prompts, steps, stop_token_id=None, keep_logits=True)
        return out, lm.engine.kv_policy.report()


def _assert_same(a, b, tol: float = 1e-4) -> None:
    (out_a, rep_a), (out_b, rep_b) = a, b
    assert out_a.token_ids == out_b.token_ids
    assert rep_a.get("kv_fetch_fraction_per_layer") == rep_b.get("kv_fetch_fraction_per_layer")
    for x, y in zip(out_a.logits, out_b.logits):
        assert (x - y).abs().max().item() < tol * max(1.0, y.abs().max().item())


PROMPTS = [[1] + list(range(7, 60)), [1] + list(range(100, 140)), [1] + list(range(300, 370))]


@needs_kernels
@pytest.mark.parametrize("kv", ["full", "infinigen"])
@pytest.mark.parametrize("batch,compress,sep", [(1, False, True), (2, True, True),
                                                (3, False, False), (2, True, False)])
def test_fused_step_equals_the_per_operation_path(tiny_llama, kv, batch, compress, sep,
                                                  monkeypatch):
    prompts = PROMPTS[:batch]
    modes = _calls(monkeypatch)
    kw = {"compress_weight": compress, "sep_layer": sep}
    fused = _generate(tiny_llama[1], prompts, kv, monkeypatch, True, **kw)
    assert modes, "the fused step never ran"
    whole = {m for kind, w, m in modes if w}
    if kv == "full":  # attention over the cache inside the one call, every layer
        assert whole and all(w for kind, w, m in modes if kind != "mlp")
        layers = 4 * 7  # 4 layers, 7 decode steps
        assert len(modes) == layers * (2 if sep else 1)
    else:  # InfiniGen's layers in one call too: the chosen rows (or every row, in the
        # layers before the first that selects) and the next layer's speculation
        attending = ATTEND | fused_select.CHOSEN
        assert all(m & attending for kind, w, m in modes if kind != "mlp")
        assert any(m & fused_select.CHOSEN for _, _, m in modes)
        assert any(m & fused_select.SPECULATE for _, _, m in modes)
    # 4-bit weights round their inputs to 16 bits a group: a last-bit difference can move
    # one by a step (see the default model's test below)
    _assert_same(fused, _generate(tiny_llama[1], prompts, kv, monkeypatch, False, **kw),
                 tol=1e-3 if compress else 1e-4)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    """A small Qwen2 (q/k/v biases, grouped-query attention, tied embeddings)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from flexgen_infinigen.weights.hf_convert import convert_hf

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, num_hidden_layers=3,
                      intermediate_size=192, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    Qwen2ForCausalLM(cfg).eval().save_pretrained(folder)
    return convert_hf(folder, folder / "store", "tiny-qwen2")


@needs_kernels
@pytest.mark.parametrize("kv", ["full", "infinigen"])
def test_fused_step_with_qkv_biases(tiny_qwen2, kv, monkeypatch):
    modes = _calls(monkeypatch)
    fused = _generate(tiny_qwen2, PROMPTS[:2], kv, monkeypatch, True)
    assert modes
    _assert_same(fused, _generate(tiny_qwen2, PROMPTS[:2], kv, monkeypatch, False))


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """Small models with q/k RMSNorm before the rotary embedding: Qwen3 dense and
    mixture-of-experts (per head; eight experts, two a token), and OLMoE (over all heads)."""
    import transformers

    from flexgen_infinigen.weights.hf_convert import convert_hf

    common = dict(vocab_size=512, hidden_size=128, num_hidden_layers=3, intermediate_size=192,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=256, tie_word_embeddings=False)
    stores = {}
    moe = dict(num_experts=8, num_experts_per_tok=2)
    for name, cls, extra in (("dense", "Qwen3", {}),
                             ("moe", "Qwen3Moe", dict(moe, moe_intermediate_size=64)),
                             ("olmoe", "Olmoe", dict(moe, intermediate_size=64,
                                                     norm_topk_prob=False))):
        torch.manual_seed(2)
        config = {**common, **extra}
        if cls == "Olmoe":
            config.pop("head_dim")
        model = getattr(transformers, f"{cls}ForCausalLM")(
            getattr(transformers, f"{cls}Config")(**config)).eval()
        with torch.no_grad():  # norms away from 1, so that a norm left out shows
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(torch.rand_like(p) + 0.5)
        folder = tmp_path_factory.mktemp(f"tiny-qwen3-{name}")
        model.save_pretrained(folder)
        stores[name] = convert_hf(folder, folder / "store", f"tiny-qwen3-{name}")
    return stores


@needs_kernels
@pytest.mark.parametrize("kv", ["full", "infinigen"])
@pytest.mark.parametrize("variant", ["dense", "moe", "olmoe"])
def test_fused_step_with_qk_norms(tiny_qwen3, variant, kv, monkeypatch):
    """q/k norms inside the call (Qwen3's per head, OLMoE's over all heads): the same
    tokens and logits as the per-operation path. A MoE model fuses its attention stages
    only (its MLPs run their experts on the per-operation path); InfiniGen runs around the
    call (its speculation in Python, which applies the q norm)."""
    modes = _calls(monkeypatch)
    fused = _generate(tiny_qwen3[variant], PROMPTS[:1], kv, monkeypatch, True)
    kinds = {kind for kind, _, _ in modes}
    # a dense model on a CPU runs one stage a layer (attention and MLP in one call); a MoE
    # model keeps them apart, its MLPs on the experts path (sep_layer=None resolved so)
    assert kinds == ({"layer"} if variant == "dense" else {"attn"})
    assert any(whole for _, whole, _ in modes) == (kv == "full")
    _assert_same(fused, _generate(tiny_qwen3[variant], PROMPTS[:1], kv, monkeypatch, False))


@needs_kernels
@pytest.mark.parametrize("kv,batch", [("full", 1), ("infinigen", 2)])
def test_default_model_codes_fused_equal_per_operation(smollm2_codes_store, kv, batch,
                                                       monkeypatch):
    """The embedded default model as the runtime stores it: Q4_1 codes in groups of 32 with
    float16 scales and minima (the _h16 kernels inside the call), and
    an 8-bit head. Its bound is looser: the 4-bit kernel rounds its input to 16 bits per
    group, so a last-bit difference (the MLP's SiLU is computed in C, not by torch) can move
    an input by a step of 1/32639 of its group's largest entry, and this model's activations
    reach several hundred in a few channels. InfiniGen selects here as it does outside the
    tests (whole layers at this short context; the tiny models test the chosen rows): on
    this model such a difference can swap a chosen row that ties with another."""
    monkeypatch.delenv("FLEXGEN_INFINIGEN_SELECT_FROM_MB", raising=False)
    # the codes, as a GPU takes them: the file's blocks round each input to 8 bits, where one
    # last-bit difference moves a code by 1/127 of its block's largest entry (the blocks
    # inside the call are checked on the tiny models, tests/test_gguf_codes.py)
    monkeypatch.setenv("FLEXGEN_INFINIGEN_GGUF_BLOCKS", "0")
    from flexgen_infinigen.text.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_codes_store)
    text = ("The tower is 324 metres tall, about the same height as an 81-storey building, "
            "and the tallest structure in Paris. Its base is square, measuring 125 metres "
            "on each side. During its construction, the Eiffel Tower surpassed the ")
    prompts = [tok.encode(text), tok.encode(text[40:])][:batch]
    modes = _calls(monkeypatch)
    fused = _generate(smollm2_codes_store, prompts, kv, monkeypatch, True, steps=6)
    assert modes
    _assert_same(fused, _generate(smollm2_codes_store, prompts, kv, monkeypatch, False, steps=6),
                 tol=1e-3)


def test_models_the_call_does_not_compute_take_the_per_operation_path(monkeypatch):
    from flexgen_infinigen.config import get_config

    llama = get_config("smollm2-135m")
    assert fused_decode.supports(llama, torch.float32, False) == fused_decode.enabled()
    assert not fused_decode.supports(llama, torch.float16, False)  # another dtype
    assert not fused_decode.supports(llama, torch.float32, True)  # a GPU
    assert not fused_decode.supports(get_config("opt-125m"), torch.float32, False)
    assert fused_decode.supports(get_config("qwen3-8b"), torch.float32, False)  # per-head norms
    # q/k norms over all heads at once, and experts (their MLPs stay per-operation)
    assert fused_decode.supports(get_config("olmoe-1b-7b"), torch.float32, False)
    monkeypatch.setenv(fused_decode.ENV, "0")
    assert fused_decode.StagePlans(llama, torch.float32, False).fused is None
    monkeypatch.setenv(fused_decode.ENV, "1")
    monkeypatch.setattr(fused_decode, "library", lambda: None)  # no compiler
    assert fused_decode.StagePlans(llama, torch.float32, False).fused is None


@needs_kernels
def test_weights_in_a_form_the_call_does_not_read_fall_back(tiny_llama, monkeypatch):
    """A packed weight in a form ``kernel_ready`` refuses gives no
    plan for its stage, and that stage runs the per-operation path with the same result."""
    from flexgen_infinigen.memory.codes import PackedWeight

    real = PackedWeight.__post_init__

    def half_scales(self):  # as if the codes came with scales the kernels do not take
        real(self)
        self.kernel_ready = False
    monkeypatch.setattr(PackedWeight, "__post_init__", half_scales)
    modes = _calls(monkeypatch)
    kw = {"compress_weight": True}
    fused = _generate(tiny_llama[1], PROMPTS[:2], "full", monkeypatch, True, **kw)
    assert not modes  # every layer fell back
    _assert_same(fused, _generate(tiny_llama[1], PROMPTS[:2], "full", monkeypatch, False, **kw))


def test_sep_layer_resolves_to_one_stage_a_layer_only_where_nothing_loads(tiny_llama,
                                                                          tiny_qwen3):
    """``sep_layer=None``: one stage a layer on a CPU whose dense weights are all read in
    place (floats or 4-bit codes), attention and MLP apart where weights load (a share off
    the compute device) or a MoE layer's experts run once a block; an explicit value
    stays. Both schedules give the same tokens."""
    _, store = tiny_llama

    def kinds(path, percent=(100, 0, 0, 100, 100, 0), **kw):
        with OffloadedLM.load(path=path, policy=Placement.from_percent(list(percent), **kw),
                              progress=False) as lm:
            out = lm.generate([[1] + list(range(7, 40))], 4, stop_token_id=None)
            return {s.kind for s in lm.engine.stages}, lm.engine.policy.sep_layer, out.token_ids

    one, sep, tokens = kinds(store)
    assert (one, sep) == ({"embed", "layer", "head"}, False)
    split, sep, split_tokens = kinds(store, sep_layer=True)
    assert (split, sep) == ({"embed", "attn", "mlp", "head"}, True)
    assert tokens == split_tokens
    assert kinds(store, compress_weight=True)[1] is False  # codes multiplied in place
    assert kinds(store, percent=(50, 50, 0, 100, 100, 0))[1] is True  # half the weights load
    assert kinds(tiny_qwen3["moe"])[1] is True  # experts once a block, on the MLP stage
