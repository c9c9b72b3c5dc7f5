"""config.json reading: what changes the math is computed or refused by name, before any tensor
is converted; the command line converts a sharded checkpoint and runs it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.weights.hf_config import config_from_hf

LLAMA31 = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "mlp_bias": False,
    "attention_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "transformers_version": "4.43.0", "initializer_range": 0.02,
}
QWEN25 = {
    "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28,
    "bos_token_id": 151643, "eos_token_id": 151643, "rope_scaling": None,
}


QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
MISTRAL = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 32000,
}


def test_real_configs_match_the_registry():
    """Llama-3.1-8B, Qwen2.5-7B, Qwen3-8B and Mistral-7B config.json files (as published)
    give the registry's shapes and math."""
    from flexgen_infinigen.config import get_config

    for hf, known in [(LLAMA31, "llama-3.1-8b"), (QWEN25, "qwen2.5-7b"), (QWEN3, "qwen3-8b"),
                      (MISTRAL, "mistral-7b")]:
        ours = config_from_hf(hf, known)
        assert ours == get_config(known)


@pytest.mark.parametrize("change, field", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "longrope"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_scaling": {**LLAMA31["rope_scaling"], "attention_factor": 1.2}}, "attention_factor"),
    ({"num_experts": 8}, "num_experts"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"logit_softcapping": 30.0}, "logit_softcapping"),  # an unknown field that changes math
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
])
def test_math_we_do_not_compute_is_refused_by_name(change, field):
    with pytest.raises(ConfigError, match=field):
        config_from_hf({**LLAMA31, **change}, "x")


@pytest.mark.parametrize("change, field", [
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention"] * 28}, "layer_types"),
])
def test_qwen_sliding_window_is_refused(change, field):
    with pytest.raises(ConfigError, match=field):
        config_from_hf({**QWEN25, **change}, "x")


def test_allow_field_accepts_a_named_field():
    with pytest.raises(ConfigError, match="--allow-field my_note"):
        config_from_hf({**LLAMA31, "my_note": "hello"}, "x")
    assert config_from_hf({**LLAMA31, "my_note": "hello"}, "x", ("my_note",)).name == "x"


def test_unknown_model_type_is_refused():
    with pytest.raises(ConfigError, match="gemma2"):
        config_from_hf({**LLAMA31, "model_type": "gemma2"}, "x")


def test_refused_before_any_tensor_is_read(tmp_path):
    """A refused config leaves no store, and the weights are never opened."""
    from flexgen_infinigen.weights.hf_convert import convert_hf

    (tmp_path / "config.json").write_text(json.dumps({**QWEN25, "use_sliding_window": True}))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="use_sliding_window"):
        convert_hf(tmp_path, tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_missing_shard_is_named(tmp_path):
    from flexgen_infinigen.weights.hf_convert import convert_hf

    cfg = {**QWEN25, "num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 8,
           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 16}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match="model-00001-of-00002.safetensors"):
        convert_hf(tmp_path, tmp_path / "store")


def test_command_line_converts_and_runs(tmp_path):
    """`convert --checkpoint DIR` (default output folder) then `run --path`, as a user would."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                      max_position_embeddings=128)
    ckpt = tmp_path / "tiny-qwen3"
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(ckpt, max_shard_size="100KB")
    conv = subprocess.run([sys.executable, "-m", "flexgen_infinigen.convert", "--checkpoint",
                           str(ckpt)], cwd=tmp_path, capture_output=True, text=True)
    assert conv.returncode == 0, conv.stderr
    store = tmp_path / "stores" / "tiny-qwen3"
    assert (store / "manifest.json").is_file()
    run = subprocess.run([sys.executable, "-m", "flexgen_infinigen.run", "--path", str(store),
                          "--prompt-len", "8", "--gen-len", "4", "--json", "out.json"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["model"]["name"] == "tiny-qwen3" and report["gen_len"] == 4
