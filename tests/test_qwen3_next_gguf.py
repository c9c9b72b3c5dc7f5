"""The Qwen3.5 / Qwen3-Next hybrids from GGUF files written as llama.cpp's converter writes
them (written here from transformers' tiny random models, independently of the reader):
``qwen35`` (value heads reordered "tiled"), ``qwen35moe`` and ``qwen3next`` (its fused
q|k|v|z projection split into q|k|v and z, b and a fused), the decay rate stored as
``-exp(A_log)``, norms as ``1 + w``, the attention's doubled ``q_proj`` as one tensor, the
large matrices as Q8_0 blocks. Read in place (and converted), they give transformers'
greedy tokens and logits in several placements."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_greedy, inputs_rounded

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError

gguf = pytest.importorskip("gguf")

STEPS = 8
PROMPTS = [[2] + [(7 * i + 3) % 290 + 3 for i in range(70)],
           [2] + [(11 * i + 5) % 290 + 3 for i in range(9)]]
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=512,
            bos_token_id=2, eos_token_id=1, pad_token_id=0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)
PLACEMENTS = {
    "all-on-device": Placement(),
    "mixed-with-disk-two-batches": Placement.from_percent([30, 40, 30, 40, 100, 0],
                                                       num_gpu_batches=2, overlap=True),
}
# the matrices written as Q8_0 blocks (their inputs 64 wide: two blocks a row)
QUANTIZED = ("self_attn.q_proj", "linear_attn.in_proj_qkv", "linear_attn.in_proj_z",
             "linear_attn.in_proj_b", "linear_attn.in_proj_a", "linear_attn.in_proj_qkvz",
             "linear_attn.in_proj_ba")


def _model(arch: str):
    """transformers' tiny hybrid in fp32, its norms, decays and step sizes drawn so that
    each counts, and the matrices of :data:`QUANTIZED` made of values Q8_0 holds exactly
    (in each block of 32, integers up to 127 times one power of two)."""
    import transformers
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    cls, config = {
        "qwen35": (Qwen3_5ForCausalLM, lambda: Qwen3_5TextConfig(**BASE)),
        "qwen35moe": (Qwen3_5MoeForCausalLM, lambda: Qwen3_5MoeTextConfig(**BASE, **MOE)),
        "qwen3next": (transformers.Qwen3NextForCausalLM,
                      lambda: transformers.Qwen3NextConfig(**BASE, **MOE))}[arch]
    model = cls(config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            elif any(f"{q}.weight" in name for q in QUANTIZED):
                codes = torch.randint(-127, 128, p.shape).reshape(-1, 32)
                codes[:, 0] = 127  # each block's largest: its scale exactly 2^-9
                p.copy_((codes * 2.0 ** -9).reshape(p.shape))
    return model


def _tiled(t: torch.Tensor, dim: int, key_heads: int, per: int) -> torch.Tensor:
    """Value heads (or their rows/columns) along ``dim`` from grouped by key head to tiled."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], key_heads, per, -1, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _file_tensors(model, arch: str):
    """(GGUF name, tensor) as llama.cpp's converter writes the model."""
    c = model.config
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    per, kd = hv // hk, hk * c.linear_key_head_dim
    yield "token_embd.weight", model.model.embed_tokens.weight
    yield "output_norm.weight", model.model.norm.weight + 1
    yield "output.weight", model.lm_head.weight
    for i, layer in enumerate(model.model.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", layer.input_layernorm.weight + 1
        yield b + "post_attention_norm.weight", layer.post_attention_layernorm.weight + 1
        if hasattr(layer, "self_attn"):
            a = layer.self_attn
            for ours, proj in (("attn_q", a.q_proj), ("attn_k", a.k_proj),
                               ("attn_v", a.v_proj), ("attn_output", a.o_proj)):
                yield f"{b}{ours}.weight", proj.weight
            yield b + "attn_q_norm.weight", a.q_norm.weight + 1
            yield b + "attn_k_norm.weight", a.k_norm.weight + 1
        else:
            d = layer.linear_attn
            conv = d.conv1d.weight.squeeze(1)
            a_rate, dt = -d.A_log.exp(), d.dt_bias
            if arch == "qwen3next":
                grouped = d.in_proj_qkvz.weight.reshape(hk, -1, c.hidden_size)
                q, k, v, z = grouped.split([c.linear_key_head_dim] * 2 + [
                    per * c.linear_value_head_dim] * 2, 1)
                yield b + "attn_qkv.weight", torch.cat(
                    [t.reshape(-1, c.hidden_size) for t in (q, k, v)])
                yield b + "attn_gate.weight", z.reshape(-1, c.hidden_size)
                yield b + "ssm_ba.weight", d.in_proj_ba.weight
                out = d.out_proj.weight
            else:
                qkv = d.in_proj_qkv.weight
                yield b + "attn_qkv.weight", torch.cat(
                    [qkv[:2 * kd], _tiled(qkv[2 * kd:], 0, hk, per)])
                yield b + "attn_gate.weight", _tiled(d.in_proj_z.weight, 0, hk, per)
                yield b + "ssm_beta.weight", _tiled(d.in_proj_b.weight, 0, hk, per)
                yield b + "ssm_alpha.weight", _tiled(d.in_proj_a.weight, 0, hk, per)
                a_rate, dt = _tiled(a_rate, 0, hk, per), _tiled(dt, 0, hk, per)
                conv = torch.cat([conv[:2 * kd], _tiled(conv[2 * kd:], 0, hk, per)])
                out = _tiled(d.out_proj.weight, 1, hk, per)
            yield b + "ssm_a", a_rate
            yield b + "ssm_dt.bias", dt
            yield b + "ssm_conv1d.weight", conv
            yield b + "ssm_norm.weight", d.norm.weight
            yield b + "ssm_out.weight", out
        m = layer.mlp
        if arch == "qwen35":
            for ours, proj in (("ffn_gate", m.gate_proj), ("ffn_up", m.up_proj),
                               ("ffn_down", m.down_proj)):
                yield f"{b}{ours}.weight", proj.weight
            continue
        width = c.moe_intermediate_size
        yield b + "ffn_gate_inp.weight", m.gate.weight
        yield b + "ffn_gate_exps.weight", m.experts.gate_up_proj[:, :width]
        yield b + "ffn_up_exps.weight", m.experts.gate_up_proj[:, width:]
        yield b + "ffn_down_exps.weight", m.experts.down_proj
        yield b + "ffn_gate_inp_shexp.weight", m.shared_expert_gate.weight
        for ours, proj in (("ffn_gate_shexp", m.shared_expert.gate_proj),
                           ("ffn_up_shexp", m.shared_expert.up_proj),
                           ("ffn_down_shexp", m.shared_expert.down_proj)):
            yield f"{b}{ours}.weight", proj.weight


def write_hybrid_gguf(model, arch: str, path) -> None:
    from gguf.quants import quantize
    from gguf_header import add_model_metadata

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    add_model_metadata(w, c, arch, "llama")
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim // 4)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    w.add_full_attention_interval(4)
    if arch != "qwen35":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    coded = ("attn_q.", "attn_qkv.", "attn_gate.", "ssm_beta.", "ssm_alpha.", "ssm_ba.")
    for name, t in _file_tensors(model, arch):
        t = np.ascontiguousarray(t.detach().float().numpy())
        if any(part in name for part in coded):
            w.add_tensor(name, quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe", "qwen3next"])
def hybrid_gguf(request, tmp_path_factory):
    arch = request.param
    model = _model(arch)
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    write_hybrid_gguf(model, arch, path)
    with inputs_rounded(model, lambda part: 32 if part in QUANTIZED else None):
        want = [hf_greedy(model, prompt, STEPS) for prompt in PROMPTS]
    return arch, path, want


def _check(out, want):
    for row, (tokens, logits) in enumerate(want):
        assert out.token_ids[row] == tokens
        assert (out.logits[row] - logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_read_in_place_matches_transformers(hybrid_gguf, placement):
    """The file read in place: its Q8_0 blocks multiplied as stored (the attention's query
    and gate rows picked from one tensor), the value heads in the file's order."""
    arch, path, want = hybrid_gguf
    with OffloadedLM.load(model=str(path), policy=PLACEMENTS[placement], progress=False) as lm:
        assert lm.cfg.family == "qwen3_next" and lm.cfg.linear_layers == (0, 1, 2)
        assert lm.cfg.linear_value_tiled == (arch != "qwen3next")
        assert lm.cfg.num_experts == (0 if arch == "qwen35" else 4)
        for name in ("layers.3.q_proj.weight", "layers.3.q_gate.weight",
                     "layers.0.linear.qkv_proj.weight", "layers.0.linear.b_proj.weight"):
            assert lm.weight_formats.get(name) == "Q8_0", name
        out = lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)
    _check(out, want)


def test_converted_equals_read_in_place(hybrid_gguf, tmp_path):
    """A converted store holds, tensor for tensor, the bytes the index reads in place (the
    split tensors' picked rows included), and runs to the same tokens."""
    from flexgen_infinigen.weights.gguf_convert import convert_gguf
    from flexgen_infinigen.weights.gguf_index import index_gguf
    from flexgen_infinigen.weights.store import WeightStore

    arch, path, want = hybrid_gguf
    copied = WeightStore(convert_gguf(path, tmp_path / "copy", progress=False))
    indexed = WeightStore(index_gguf(path, tmp_path / "index"))
    assert set(copied.tensors) == set(indexed.tensors)
    for name in copied.tensors:
        assert np.array_equal(copied.load(name), indexed.load(name)), name
    assert indexed.tensors["layers.3.q_gate.weight"]["rows"][0] == [16, 16]
    with OffloadedLM.load(path=copied.path, policy=Placement(), progress=False) as lm:
        _check(lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True), want)


def test_a_file_without_its_deltanet_fields_is_refused(tmp_path):
    from flexgen_infinigen.weights.gguf_config import config_from_gguf

    model = _model("qwen35")
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35")
    from gguf_header import add_model_metadata
    add_model_metadata(w, model.config, "qwen35", "llama")
    w.add_tensor("token_embd.weight", np.zeros((300, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"qwen35\.ssm"):
        config_from_gguf(gguf.GGUFReader(str(path)), source=str(path))
