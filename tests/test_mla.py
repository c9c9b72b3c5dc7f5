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
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIG, **extra))
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
    cache are a (kv_rank + rope)-wide row per token, layer, key and value, not the per-head
    keys and values (heads x (nope + rope + v))."""
    model, store = _store(tmp_path, q_lora_rank=24)
    prompts = [[1] + list(range(3, 3 + PROMPT_LEN - 1))] * 2
    with OffloadedLM.load(path=store, policy=Placement.from_percent([100, 0, 0, 100, 100, 0]),
                          progress=False) as lm:
        assert (lm.cfg.num_kv_heads, lm.cfg.head_dim) == (1, 32 + 8)
        lm.generate(prompts, STEPS, stop_token_id=None)
        stored = lm.tiers.bytes_moved["device->host"]["kv_cache"]
    rows = len(prompts) * (PROMPT_LEN + STEPS - 1)  # the last token is never stored
    row = (32 + 8) * 4  # float32
    assert stored == rows * 3 * 2 * row
    per_head = 4 * (16 + 8 + 16) * 4  # what per-head keys and values would take
    assert 2 * row < per_head


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
