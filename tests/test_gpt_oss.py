"""gpt-oss: a tiny random model built by transformers (sinks, biases and experts drawn so that
each counts), saved, converted by us (the fused experts split per expert) and run under
several placements, equals transformers' greedy tokens and logits: attention sinks in the
prompt's and the decode step's attention, 8-token windows on every other layer, YaRN RoPE,
the biased router and the experts' clamped SwiGLU with biases. InfiniGen keeping everything
equals the full cache; the CPU kernels' sinks equal torch's; a policy whose attention takes no
sinks is refused before any weight is read."""
from __future__ import annotations

import contextlib
import json
import math

import numpy as np
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
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}  # the Hub's own folder: its experts as MXFP4 blocks
    assert config_from_hf({**hub, "quantization_config": mxfp4}, "gpt-oss-20b") == cfg
    with pytest.raises(ConfigError, match="quantization_config"):  # any other: refused
        config_from_hf({**hub, "quantization_config": {"quant_method": "bitsandbytes"}}, "x")


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


def _write_gguf(model, path, experts: str = "MXFP4") -> None:
    """``model`` as llama.cpp's converter writes a gpt-oss: float32 tensors, experts cut
    into gate, up and down (each ``[experts, out, in]``, biases ``[experts, out]``) and
    quantized to ``experts``; the model's expert weights replaced by what the file encodes,
    so that the reference runs on exactly those values."""
    from gguf_header import add_model_metadata

    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    c = model.config
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    add_model_metadata(w, c, "gpt-oss", "llama")
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_sliding_window(c.sliding_window)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.intermediate_size)
    rope = c.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    qtype = gguf.GGMLQuantizationType[experts]

    def add(name, t):
        w.add_tensor(name, np.ascontiguousarray(t.detach().float().numpy()))

    add("token_embd.weight", model.model.embed_tokens.weight)
    add("output_norm.weight", model.model.norm.weight)
    add("output.weight", model.lm_head.weight)
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        add(f"blk.{i}.post_attention_norm.weight", layer.post_attention_layernorm.weight)
        for ours, proj in (("attn_q", a.q_proj), ("attn_k", a.k_proj), ("attn_v", a.v_proj),
                           ("attn_output", a.o_proj)):
            add(f"blk.{i}.{ours}.weight", proj.weight)
            add(f"blk.{i}.{ours}.bias", proj.bias)
        add(f"blk.{i}.attn_sinks.weight", a.sinks)
        add(f"blk.{i}.ffn_gate_inp.weight", m.router.weight)
        add(f"blk.{i}.ffn_gate_inp.bias", m.router.bias)
        e = m.experts
        gate_up = e.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], gate and up interleaved
        mats = {"ffn_gate_exps": gate_up[:, 0::2], "ffn_up_exps": gate_up[:, 1::2],
                "ffn_down_exps": e.down_proj.detach().transpose(1, 2)}  # [E, H, I]
        coded = {}
        for ours, t in mats.items():
            t = np.ascontiguousarray(t.float().numpy())
            raw = quantize(t, qtype)
            w.add_tensor(f"blk.{i}.{ours}.weight", raw, raw_dtype=qtype)
            coded[ours] = torch.from_numpy(dequantize(raw, qtype).reshape(t.shape))
        add(f"blk.{i}.ffn_gate_exps.bias", e.gate_up_proj_bias[:, 0::2])
        add(f"blk.{i}.ffn_up_exps.bias", e.gate_up_proj_bias[:, 1::2])
        add(f"blk.{i}.ffn_down_exps.bias", e.down_proj_bias)
        with torch.no_grad():  # the reference runs on the file's values
            both = torch.empty_like(gate_up)
            both[:, 0::2], both[:, 1::2] = coded["ffn_gate_exps"], coded["ffn_up_exps"]
            e.gate_up_proj.copy_(both.transpose(1, 2))
            e.down_proj.copy_(coded["ffn_down_exps"].transpose(1, 2))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_with_large_experts(seed: int):
    """A tiny gpt-oss whose experts' widths are whole blocks of 32, with random sinks and
    biases and experts scaled up (so that their codes matter to the output)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **{**CONFIG, "intermediate_size": 64}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sinks" in name or "bias" in name:
                p.copy_(torch.randn_like(p))
            elif "experts" in name:
                p.mul_(20)
    return model


@pytest.mark.parametrize("experts", ["MXFP4", "Q8_0"])
@pytest.mark.parametrize("placement", ["all-on-device", "experts-multiplied-in-cpu-memory"])
def test_a_gguf_runs_from_its_codes(tmp_path, experts, placement):
    """The same tiny model written as llama.cpp writes a gpt-oss GGUF, its experts MXFP4
    blocks (or Q8_0), read in place: the tokens and logits of transformers run on the
    values the file encodes (the experts multiplied as stored, against 8-bit activations)."""
    model = _tiny_with_large_experts(seed=1)
    path = tmp_path / "tiny-gpt-oss.gguf"
    _write_gguf(model, path, experts)
    model.eval()
    with OffloadedLM.load(model=str(path), policy=PLACEMENTS[placement],
                          progress=False) as lm:
        assert lm.cfg.family == "gpt_oss" and lm.cfg.layer_windows == (8, 0, 8, 0)
        assert lm.weight_formats.get("layers.0.experts.0.gate_proj.weight") == experts
        out = lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)
    _equals_transformers_on_rounded_inputs(model, out)


def _equals_transformers_on_rounded_inputs(model, out) -> None:
    """``out``'s tokens and logits are transformers' with the experts' inputs rounded as the
    block kernels round them."""
    with experts_inputs_rounded(model):
        for row, prompt in enumerate(PROMPTS):
            tokens, logits = hf_greedy(model, prompt, STEPS)
            assert out.token_ids[row] == tokens
            assert (out.logits[row] - logits).abs().max().item() < 1e-4


@contextlib.contextmanager
def experts_inputs_rounded(model):
    """transformers' gpt-oss with both expert products' inputs (the hidden state, the gated
    activation) rounded as the GGUF block kernels round them: 8-bit codes per block of 32
    values (``conftest.inputs_rounded`` does it for ``nn.Linear`` layers; the experts are
    not)."""
    def rounded(x):
        b = x.float().reshape(-1, 32)
        amax = b.abs().amax(1, keepdim=True)
        q = torch.round(b * torch.where(amax > 0, 127 / amax, 0))
        return (q * (amax / 127)).reshape(x.shape).to(x.dtype)

    experts = [layer.mlp.experts for layer in model.model.layers]
    gates = [e._apply_gate for e in experts]
    handles = [e.register_forward_pre_hook(lambda m, args: (rounded(args[0]), *args[1:]))
               for e in experts]
    for e, gate in zip(experts, gates):
        e._apply_gate = lambda gate_up, gate=gate: rounded(gate(gate_up))
    try:
        yield model
    finally:
        for e, h in zip(experts, handles):
            h.remove()
            del e._apply_gate


def _hf_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix [E, rows, columns] as the Hub's gpt-oss folders keep it: (blocks [E, rows,
    columns / 32, 16], scales [E, rows, columns / 32]), codes from gguf's MXFP4 quantizer,
    two a byte (the low nibble the even value)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(np.ascontiguousarray(w.float().numpy()), GGMLQuantizationType.MXFP4)
    raw = raw.reshape(*w.shape[:2], w.shape[2] // 32, 17)
    qs = raw[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # gguf: low nibbles first
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(raw[..., 0].copy())


@pytest.mark.parametrize("placement", ["all-on-device", "experts-multiplied-in-cpu-memory"])
def test_a_hub_mxfp4_folder_runs_from_its_codes(tmp_path, placement):
    """A folder as the Hub publishes gpt-oss (experts as MXFP4 ``*_blocks`` and ``*_scales``,
    ``quantization_config`` mxfp4) converts with its experts kept as 4-bit blocks, and gives
    the tokens and logits of transformers run on the values transformers' own MXFP4 reader
    makes of the same tensors."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from flexgen_infinigen.weights.hf_convert import convert_hf

    model = _tiny_with_large_experts(seed=2)
    folder = tmp_path / "gpt-oss-mxfp4"
    model.save_pretrained(folder)
    state = {}
    for f in folder.glob("*.safetensors"):
        state.update(load_file(f))
        f.unlink()
    for i, layer in enumerate(model.model.layers):
        e = layer.mlp.experts
        for which in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{which}"
            blocks, scales = _hf_mxfp4(state.pop(name).transpose(1, 2))  # rows: outputs
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
            with torch.no_grad():  # the reference runs on what transformers reads of them
                getattr(e, which).copy_(convert_moe_packed_tensors(blocks, scales,
                                                                   dtype=torch.float32))
    save_file(state, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    store = convert_hf(folder, tmp_path / "store", "gpt-oss-mxfp4", progress=False)
    model.eval()
    with OffloadedLM.load(path=store, policy=PLACEMENTS[placement], progress=False) as lm:
        assert lm.weight_formats.get("layers.1.experts.3.up_proj.weight") == "MXFP4"
        out = lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)
    _equals_transformers_on_rounded_inputs(model, out)
