"""DeepSeek-V3's multi-head latent attention (models/mla.py): the KV cache holds the latent
and the rotary key, one row a token, and what crosses the tier link for it is counted by
the byte ledger at that row's size (twice: the row is kept as key and as value); a model
without a low-rank query (``q_lora_rank`` None, as V2-Lite) equals transformers too. (The
full model, with its low-rank query, in every placement and with InfiniGen, is in
tests/test_moe.py.)"""
from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.planner.workload import Sizes, Workload
from flexgen_infinigen.weights.hf_config import config_from_hf

CONFIG = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, intermediate_size=96,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
              tie_word_embeddings=False, num_experts_per_tok=2, n_routed_experts=8,
              moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
              routed_scaling_factor=2.5, first_k_dense_replace=1, kv_lora_rank=32,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
PROMPT_LEN, STEPS = 10, 5


def _store(tmp_path, **extra):
    import transformers

    from flexgen_infinigen.weights.hf_convert import convert_hf

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**CONFIG, **extra}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5 + 1)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return model.eval(), convert_hf(tmp_path, tmp_path / "store", "mla", progress=False)


def test_the_cache_holds_the_latent_row(tmp_path):
    """Weights on the device, the cache in CPU memory: the bytes the ledger counts into the
    cache are one (kv_rank + rope)-wide row per token and layer (the value is that row, kept
    once), not the per-head keys and values (heads x (nope + rope + v)); the caches hold, and
    the plan counts, one such row per token."""
    model, store = _store(tmp_path, q_lora_rank=24)
    prompts = [[1] + list(range(3, 3 + PROMPT_LEN - 1))] * 2
    with OffloadedLM.load(path=store, policy=Placement.from_percent([100, 0, 0, 100, 100, 0]),
                          progress=False) as lm:
        assert (lm.cfg.num_kv_heads, lm.cfg.head_dim) == (1, 32 + 8)
        caches, make = [], lm.engine.kv_policy.make_cache
        lm.engine.kv_policy.make_cache = lambda spec: caches.append(make(spec)) or caches[-1]
        lm.generate(prompts, STEPS, stop_token_id=None)
        stored = lm.tiers.bytes_moved["device->host"]["kv_cache"]
        held = sum(sum(c.bytes_by_tier().values()) for c in caches)
        cached = sum(c.spec.batch_size * c.spec.max_len for c in caches)
        planned = Sizes.compute(Workload(lm.cfg, PROMPT_LEN, STEPS, 4), lm.policy).kv_token
    rows = len(prompts) * (PROMPT_LEN + STEPS - 1)  # the last token is never stored
    row = (32 + 8) * 4  # float32
    assert stored == rows * 3 * row
    assert held == cached * row
    assert planned == row


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.7, "mscale_all_dim": 1.0,
        "rope_theta": 10000.0}


@pytest.mark.parametrize("rope", ["plain", "yarn"])
def test_a_full_query_projection_equals_transformers(tmp_path, rope):
    """No low-rank query (V2-Lite's shape); with DeepSeek's YaRN (its tables' factor and the
    scores' mscale_all_dim correction) past the original context."""
    extra = dict(rope_parameters=YARN) if rope == "yarn" else {}
    model, store = _store(tmp_path, q_lora_rank=None, **extra)
    prompts = [[1] + [(7 * i + 3) % 200 + 2 for i in range(13)]]
    with OffloadedLM.load(path=store, policy=Placement(), progress=False) as lm:
        assert "layers.0.q_proj.weight" in lm.weight_formats
        out = lm.generate(prompts, STEPS, stop_token_id=None, keep_logits=True)
    tokens, logits = hf_greedy(model, prompts[0], STEPS)
    assert out.token_ids[0] == tokens
    assert (out.logits[0] - logits).abs().max().item() < 1e-4


def test_routers_and_versions_it_does_not_compute_are_refused():
    import transformers

    hf = transformers.DeepseekV3Config(**CONFIG).to_dict()
    with pytest.raises(ConfigError, match="topk_method"):
        config_from_hf({**hf, "topk_method": "greedy"}, "m")
    with pytest.raises(ConfigError, match="softmax group-limited router"):
        config_from_hf({**hf, "model_type": "deepseek_v2"}, "m")


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
               "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
               "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
               "mlp.shared_experts.up_proj": "ffn_up_shexp",
               "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def _write_deepseek2(model, path) -> None:
    """The model as llama.cpp's converter writes a DeepSeek-V3 (``deepseek2``): one KV head
    of kv_lora_rank + rope dims, the per-head widths in *_length_mla, kv_b_proj split into
    k_b (each head's W_UK transposed) and v_b, the experts fused, float32."""
    import numpy as np

    gguf = pytest.importorskip("gguf")
    c = model.config
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":  # llama.cpp's: its log multiplier is 0.1 x mscale_all_dim
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_value_length(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_expert_weights_norm(True)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_token_scores([-float(i) for i in range(c.vocab_size)])
    heads, nope, v = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    for name, t in model.state_dict().items():
        t = t.float()
        name = name.removeprefix("model.")
        top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
        if name in top:
            tensors = {top[name]: t}
        else:
            _, i, rest = name.split(".", 2)
            b = f"blk.{i}."
            if rest == "self_attn.kv_b_proj.weight":
                kv_b = t.view(heads, nope + v, -1)
                tensors = {b + "attn_k_b.weight": kv_b[:, :nope].transpose(1, 2),
                           b + "attn_v_b.weight": kv_b[:, nope:]}
            elif rest == "mlp.gate.e_score_correction_bias":
                tensors = {b + "exp_probs_b.bias": t}
            elif rest == "mlp.experts.gate_up_proj":
                half = t.shape[1] // 2
                tensors = {b + "ffn_gate_exps.weight": t[:, :half],
                           b + "ffn_up_exps.weight": t[:, half:]}
            elif rest == "mlp.experts.down_proj":
                tensors = {b + "ffn_down_exps.weight": t}
            else:
                part, kind = rest.rsplit(".", 1)
                tensors = {f"{b}{_GGUF_NAMES[part]}.{kind}": t}
        for out, value in tensors.items():
            w.add_tensor(out, np.ascontiguousarray(value.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("rope", ["plain", "yarn"])
def test_a_deepseek2_gguf_gives_transformers_tokens(tmp_path, monkeypatch, rope):
    """The same model as a deepseek2 GGUF, read in place: the split k_b/v_b, the one-head
    latent cache and the sigmoid router as llama.cpp's metadata says; its YaRN as
    DeepSeek's (mscale = mscale_all_dim, which is all a GGUF says)."""
    monkeypatch.setenv("FLEXGEN_INFINIGEN_CACHE", str(tmp_path / "cache"))
    extra = dict(rope_parameters={**YARN, "mscale": 1.0}) if rope == "yarn" else {}
    model, _ = _store(tmp_path, q_lora_rank=24, **extra)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    path = tmp_path / "tiny-deepseek2.gguf"
    _write_deepseek2(model, path)
    prompts = [[1] + [(7 * i + 3) % 200 + 2 for i in range(13)]]
    with OffloadedLM.load(model=str(path), policy=Placement(), progress=False) as lm:
        cfg = lm.cfg
        assert (cfg.family, cfg.num_kv_heads, cfg.head_dim, cfg.mla_kv_b_split) == \
            ("mla", 1, 40, True)
        assert (cfg.router_groups, cfg.router_topk_groups, cfg.routed_scaling) == (4, 2, 2.5)
        out = lm.generate(prompts, STEPS, stop_token_id=None, keep_logits=True)
    tokens, logits = hf_greedy(model, prompts[0], STEPS)
    assert out.token_ids[0] == tokens
    assert (out.logits[0] - logits).abs().max().item() < 1e-4
