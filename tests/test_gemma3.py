"""Gemma 3 (text): a tiny random model built by transformers, saved sharded in bf16, converted
by us (norm scales stored as 1 + w in float32) and run under several placements, equals
transformers' greedy tokens and logits: windowed layers with their own RoPE base beside a
global layer with linear RoPE scaling, the query scale of ``query_pre_attn_scalar``, GeGLU,
the four norms a layer, the scaled embedding and the logits' soft cap. InfiniGen keeping
everything equals the full cache (its rehearsal takes each layer's own RoPE and window)."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import hf_greedy

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.kv import InfiniGenOptions
from flexgen_infinigen.weights.hf_config import config_from_hf

STEPS = 16
# longer than the window (12): the windowed layers see less than the global one
PROMPTS = [[2] + [(7 * i + 3) % 500 + 3 for i in range(44)],
           [2] + [(11 * i + 5) % 500 + 3 for i in range(37)]]
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
CONFIG = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, intermediate_size=256,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=256, sliding_window=12, layer_types=LAYER_TYPES,
              query_pre_attn_scalar=24, final_logit_softcapping=3.0,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                  "rope_theta": 1000.0}})
PLACEMENTS = {
    "all-on-device": Placement(),
    "weights-and-cache-in-cpu-memory": Placement.from_percent([0, 100, 0, 100, 100, 0],
                                                           overlap=True),
    "mixed-with-disk-two-batches": Placement.from_percent([30, 40, 30, 40, 100, 0],
                                                       num_gpu_batches=2, overlap=True),
}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(transformers model in fp32 from the bf16 checkpoint, our converted store)."""
    import transformers

    from flexgen_infinigen.weights.hf_convert import convert_hf

    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**CONFIG))
    with torch.no_grad():  # norm scales start at 0 (Gemma adds the 1): make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    folder = tmp_path_factory.mktemp("gemma3")
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="300KB")
    ref = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ref, convert_hf(folder, folder / "store", "gemma3-tiny", progress=False)


def _run(store, policy, kv="full", kv_options=None):
    with OffloadedLM.load(path=store, policy=policy, kv_policy=kv, kv_options=kv_options,
                          progress=False) as lm:
        return lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_matches_transformers(gemma, placement):
    ref, store = gemma
    out = _run(store, PLACEMENTS[placement])
    for row, prompt in enumerate(PROMPTS):
        tokens, logits = hf_greedy(ref, prompt, STEPS)
        assert out.token_ids[row] == tokens
        assert (out.logits[row] - logits).abs().max().item() < 1e-4


def test_infinigen_keeping_everything_equals_full(gemma):
    _, store = gemma
    full = _run(store, Placement())
    ours = _run(store, PLACEMENTS["weights-and-cache-in-cpu-memory"], "infinigen",
                {"options": InfiniGenOptions(alpha=math.inf, max_kv_fraction=1.0,
                                             first_layer=1)})
    assert ours.token_ids == full.token_ids
    for a, b in zip(ours.logits, full.logits):
        assert (a - b).abs().max().item() < 1e-4


def test_the_config_reads_each_layers_window_and_rope():
    """transformers 5's per-layer-type RoPE parameters, and the older fields of the Hub's
    configs (rope_local_base_freq, sliding_window_pattern, a multimodal text_config)."""
    import transformers

    cfg = config_from_hf(transformers.Gemma3TextConfig(**CONFIG).to_dict(), "g")
    assert cfg.family == "gemma3" and cfg.layer_windows == (12, 0, 12, 12)
    assert cfg.rope_local_theta == 50.0 and cfg.rope_theta == 1000.0
    assert cfg.rope == {"rope_type": "linear", "factor": 2.0}
    assert cfg.query_scale == pytest.approx(24 ** -0.5) and cfg.final_logit_softcap == 3.0
    old = {"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": {
        "model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 128,
        "num_hidden_layers": 7, "intermediate_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 32,
        "sliding_window": 512, "sliding_window_pattern": 6, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        "vision_config": {"model_type": "siglip_vision_model"}, "mm_tokens_per_image": 256}
    cfg = config_from_hf(old, "g")
    assert cfg.layer_windows == (512,) * 5 + (0, 512) and cfg.rope_local_theta == 1e4
    assert cfg.query_scale == 0.0 and cfg.eos_token_id == 1 and cfg.tie_word_embeddings
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        config_from_hf({**transformers.Gemma3TextConfig(**CONFIG).to_dict(),
                        "attn_logit_softcapping": 50.0}, "g")


# transformers' names of a Gemma 3 layer's tensors -> GGUF's (gguf.constants, MODEL_ARCH.GEMMA3)
_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _write_gguf(model, path) -> None:
    """The model as llama.cpp's converter writes a Gemma 3: float32 tensors, every norm scale
    shifted by 1, the window pattern a flag a layer and the windowed layers' RoPE base."""
    import numpy as np
    from gguf_header import add_model_metadata

    gguf = pytest.importorskip("gguf")
    c = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    add_model_metadata(w, c, "gemma3", "llama")
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(c.rope_parameters["full_attention"]["factor"])
    w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    w.add_final_logit_softcapping(c.final_logit_softcapping)
    for name, t in model.state_dict().items():
        t = t.float() + (1.0 if name.endswith("norm.weight") else 0.0)
        name = name.removeprefix("model.")
        if name == "embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            continue  # tied
        else:
            _, i, rest = name.split(".", 2)
            part, kind = rest.rsplit(".", 1)
            out = f"blk.{i}.{_GGUF_LAYER[part]}.{kind}"
        w.add_tensor(out, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("how", ["read-in-place", "converted"])
def test_a_gguf_of_the_model_gives_transformers_tokens(gemma, tmp_path, monkeypatch, how):
    """The same model written as a GGUF (the query scale is not in a GGUF: llama.cpp takes the
    head width, so the reference here has query_pre_attn_scalar = head_dim)."""
    import transformers

    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    monkeypatch.setenv("FLEXGEN_INFINIGEN_CACHE", str(tmp_path / "cache"))
    ref, _ = gemma
    config = transformers.Gemma3TextConfig(**{**CONFIG, "query_pre_attn_scalar": 32})
    model = transformers.Gemma3ForCausalLM(config).eval()
    model.load_state_dict(ref.state_dict())
    path = tmp_path / "tiny-gemma3.gguf"
    _write_gguf(model, path)
    load = dict(model=str(path)) if how == "read-in-place" else \
        dict(path=convert_gguf(path, tmp_path / "store", progress=False))
    with OffloadedLM.load(policy=Placement(), progress=False, **load) as lm:
        assert lm.cfg.architecture == "gemma3" and lm.cfg.layer_windows == (12, 0, 12, 12)
        out = lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)
    for row, prompt in enumerate(PROMPTS):
        tokens, logits = hf_greedy(model, prompt, STEPS)
        assert out.token_ids[row] == tokens
        assert (out.logits[row] - logits).abs().max().item() < 1e-4
