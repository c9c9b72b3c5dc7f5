"""gpt-oss: a tiny random model built by transformers (sinks, biases and experts drawn so that
each counts), saved, converted by us (the fused experts split per expert) and run under
several placements, equals transformers' greedy tokens and logits: attention sinks in the
prompt's and the decode step's attention, 8-token windows on every other layer, YaRN RoPE,
the biased router and the experts' clamped SwiGLU with biases. InfiniGen keeping everything
equals the full cache; the CPU kernels' sinks equal torch's; a policy whose attention takes no
sinks is refused before any weight is read."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import hf_greedy

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.kv import InfiniGenOptions
from flexgen_infinigen.weights.hf_config import config_from_hf

STEPS = 12
# longer than the window (8): the windowed layers see less than the global ones
PROMPTS = [[2] + [(7 * i + 3) % 290 + 3 for i in range(23)],
           [2] + [(11 * i + 5) % 290 + 3 for i in range(14)]]
CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
              bos_token_id=2, eos_token_id=1, pad_token_id=0,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "original_max_position_embeddings": 128,
                               "truncate": False, "rope_theta": 150000.0})
PLACEMENTS = {
    "all-on-device": Placement(),
    "weights-and-cache-in-cpu-memory": Placement.from_percent([0, 100, 0, 100, 100, 0],
                                                           overlap=True),
    "mixed-with-disk-two-batches": Placement.from_percent([30, 40, 30, 40, 100, 0],
                                                       num_gpu_batches=2, overlap=True),
    "experts-multiplied-in-cpu-memory": Placement.from_percent(
        [100, 0, 100, 0, 100, 0], num_gpu_batches=2, expert_gpu_percent=0,
        expert_cpu_percent=100, host_in_place=False, cpu_expert_compute=True),
}


def _build(folder, **changes):
    """(transformers model in fp32, our converted store) of ``CONFIG`` with ``changes``."""
    import transformers

    from flexgen_infinigen.weights.hf_convert import convert_hf

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**CONFIG, **changes}))
    with torch.no_grad():  # sinks and biases start near 0, experts small: make them count
        for name, p in model.named_parameters():
            if "sinks" in name or "bias" in name:
                p.copy_(torch.randn_like(p))
            elif "experts" in name:
                p.mul_(20)  # past the SwiGLU's clamp at 7
    model.save_pretrained(folder)
    ref = transformers.GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ref, convert_hf(folder, folder / "store", "gpt-oss-tiny", progress=False)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("gpt_oss"))


def _run(store, policy, kv="full", kv_options=None):
    with OffloadedLM.load(path=store, policy=policy, kv_policy=kv, kv_options=kv_options,
                          progress=False) as lm:
        return lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_matches_transformers(gpt_oss, placement):
    ref, store = gpt_oss
    out = _run(store, PLACEMENTS[placement])
    for row, prompt in enumerate(PROMPTS):
        tokens, logits = hf_greedy(ref, prompt, STEPS)
        assert out.token_ids[row] == tokens
        assert (out.logits[row] - logits).abs().max().item() < 1e-4


def test_the_sinks_and_the_clamp_count(gpt_oss):
    """The checks above would pass on a model whose sinks or clamp changed nothing: both
    move the reference's logits here."""
    ref, _ = gpt_oss
    _, logits = hf_greedy(ref, PROMPTS[0], 2)
    with torch.no_grad():
        saved = [layer.self_attn.sinks.clone() for layer in ref.model.layers]
        for layer in ref.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        _, no_sinks = hf_greedy(ref, PROMPTS[0], 2)
        for layer, s in zip(ref.model.layers, saved):
            layer.self_attn.sinks.copy_(s)
        limit = ref.model.layers[0].mlp.experts.limit
        for layer in ref.model.layers:
            layer.mlp.experts.limit = 1e9
        _, no_clamp = hf_greedy(ref, PROMPTS[0], 2)
        for layer in ref.model.layers:
            layer.mlp.experts.limit = limit
    assert (no_sinks - logits).abs().max().item() > 1e-2
    assert (no_clamp - logits).abs().max().item() > 1e-2


def test_infinigen_keeping_everything_equals_full(gpt_oss):
    _, store = gpt_oss
    full = _run(store, Placement())
    ours = _run(store, PLACEMENTS["weights-and-cache-in-cpu-memory"], "infinigen",
                {"options": InfiniGenOptions(alpha=math.inf, max_kv_fraction=1.0,
                                             first_layer=1)})
    assert ours.token_ids == full.token_ids
    for a, b in zip(ours.logits, full.logits):
        assert (a - b).abs().max().item() < 1e-4


def test_a_policy_without_sinks_is_refused_before_loading(gpt_oss):
    _, store = gpt_oss
    for kv in ("h2o", "kivi"):
        with pytest.raises(ConfigError, match="does not compute attention sinks"):
            OffloadedLM.load(path=store, kv_policy=kv, progress=False)


def test_the_hubs_config_reads_as_published():
    """gpt-oss-20b's config.json fields (transformers 4.55's writer): its experts' count and
    top-k names, YaRN in rope_scaling, alternating windows."""
    hub = {"architectures": ["GptOssForCausalLM"], "attention_bias": True,
           "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
           "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
           "initial_context_length": 4096, "initializer_range": 0.02,
           "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * 12,
           "max_position_embeddings": 131072, "model_type": "gpt_oss",
           "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
           "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
           "pad_token_id": 199999, "rms_norm_eps": 1e-05,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                            "truncate": False},
           "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
           "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
           "vocab_size": 201088}
    from flexgen_infinigen.config import get_config
    cfg = config_from_hf(hub, "gpt-oss-20b")
    assert cfg == get_config("gpt-oss-20b")
    assert cfg.layer_windows[:4] == (128, 0, 128, 0) and cfg.rope["factor"] == 32.0
    with pytest.raises(ConfigError, match="swiglu_limit"):
        config_from_hf({**hub, "swiglu_limit": -1.0}, "x")
    with pytest.raises(ConfigError, match="MXFP4 blocks.*bf16 copy"):  # the Hub's own folder
        config_from_hf({**hub, "quantization_config": {"quant_method": "mxfp4"}}, "x")


@pytest.mark.parametrize("b,kv,group,length,d", [(1, 2, 4, 2500, 64), (2, 8, 8, 2049, 64)])
def test_kernel_sinks_equal_torch(b, kv, group, length, d):
    """The decode kernels (every row, and chosen rows read in place) with sinks against the
    torch softmax that holds the sink as one more column."""
    from flexgen_infinigen.kernels import cpu_kernels as kernels
    from flexgen_infinigen.kernels.attention import attend_rows, column_sinks

    if kernels.library() is None:
        pytest.skip("no C compiler here: the kernels fall back to torch")
    torch.manual_seed(length)
    k, v = torch.randn(length, b * kv, d), torch.randn(length, b * kv, d)
    q = torch.randn(b, 1, kv * group, d)
    sinks = torch.randn(kv * group) * 3
    bias = torch.zeros(b, 1, 1, length)
    bias[0, ..., :700] = torch.finfo(torch.float32).min  # a padded row
    ref = attend_rows(q, k, v, bias, return_key_mass=True, sinks=sinks)[0]  # torch's path
    flat = bias.expand(b, kv, 1, length).reshape(b * kv, length)
    qc = q.reshape(b * kv, group, d) * d ** -0.5
    ours = kernels.attend_rows(qc, k, v, flat, sinks=column_sinks(sinks, b))
    assert (ours.reshape(ref.shape) - ref).abs().max().item() < 1e-5
    assert (ours.reshape(ref.shape) - attend_rows(q, k, v, bias)).abs().max().item() > 1e-3
    # chosen rows: column c reads rows index[c, :counts[c]], then its new token
    n = 300
    index = torch.stack([torch.randperm(length)[:n].sort().values for _ in range(b * kv)])
    counts = torch.randint(1, n, (b * kv,))
    k_new, v_new = torch.randn(b * kv, d), torch.randn(b * kv, d)
    got = kernels.attend_indexed(qc, k, v, index, counts, k_new, v_new,
                                 sinks=column_sinks(sinks, b))
    for c in range(b * kv):
        rows = index[c, :counts[c]]
        kc = torch.cat([k[rows, c], k_new[c:c + 1]])
        vc = torch.cat([v[rows, c], v_new[c:c + 1]])
        heads = sinks[(c % kv) * group:(c % kv + 1) * group]
        scores = torch.cat([qc[c] @ kc.T, heads[:, None]], -1)
        want = torch.softmax(scores, -1)[:, :-1] @ vc
        assert (got[c] - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("kv", ["full", "infinigen"])
def test_a_4bit_cache_with_sinks_read_in_place_equals_expanding_it(tmp_path, kv, monkeypatch):
    """The 4-bit KV cache's kernel (``attend_rows_q4``: every row, or InfiniGen's chosen rows
    by index) takes the sinks: the same tokens and logits as expanding the cache into floats
    and attending in torch (64-dim heads, the kernel's width)."""
    from flexgen_infinigen.kernels import cpu_kernels as ck

    if ck.library() is None:
        pytest.skip("no C compiler here: the kernels fall back to torch")
    _, store = _build(tmp_path, head_dim=64, hidden_size=128)
    real, calls, runs = ck.attend_rows_q4, [], []

    def counted(*a, **kw):
        out = real(*a, **kw)
        calls.append(out is not None and kw.get("sinks") is not None)
        return out

    options = {"options": InfiniGenOptions(alpha=2.0, max_kv_fraction=0.5, first_layer=1)} \
        if kv == "infinigen" else None
    for in_place in (True, False):
        monkeypatch.setattr(ck, "attend_rows_q4", counted if in_place else (lambda *a, **kw: None))
        policy = Placement.from_percent([100, 0, 0, 100, 100, 0], compress_cache=True)
        runs.append(_run(store, policy, kv, options))
        if in_place:
            assert calls and all(calls), "the kernel was not used with the sinks"
    a, b = runs
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logits, b.logits):
        assert (x - y).abs().max().item() < 1e-3


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("padded", [False, True])
def test_prompt_attention_with_sinks_equals_the_extra_column(window, padded):
    """The prompt's attention with sinks (torch's fused kernel and its log normalizer for a
    causal prompt alone; query chunks otherwise) against the softmax that holds each head's
    sink as one more column, as transformers computes it."""
    from flexgen_infinigen.kernels.attention import attend_prompt

    torch.manual_seed(window + padded)
    b, s, heads, kv, d = 2, 21, 4, 2, 16
    q, k, v = torch.randn(b, s, heads, d), torch.randn(b, s, kv, d), torch.randn(b, s, kv, d)
    sinks = torch.randn(heads) * 2
    valid = torch.ones(b, s, dtype=torch.bool)
    if padded:
        valid[1, :6] = False
    got = attend_prompt(q, k, v, valid, window, rows=8, sinks=sinks)
    scores = torch.einsum("bshd,bthd->bhst", q, k.repeat_interleave(heads // kv, 2)) / d ** 0.5
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    seen = (j <= i) & ((i - j < window) if window else True) & valid[:, None, None, :]
    scores = scores.masked_fill(~seen, float("-inf"))
    column = sinks.view(1, heads, 1, 1).expand(b, heads, s, 1)
    probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    want = torch.einsum("bhst,bthd->bshd", probs, v.repeat_interleave(heads // kv, 2))
    want = torch.where(valid[:, :, None, None], want, 0.0).reshape(b, s, heads * d)
    assert (got - want).abs().max().item() < 1e-5
