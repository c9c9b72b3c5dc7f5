"""GGUF files of the llama and qwen2 architectures, written here from tiny transformers models
the way llama.cpp lays them out, convert to stores that give transformers' logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_greedy
from gguf_header import add_model_metadata

from flexgen_infinigen import OffloadedLM, Placement

gguf = pytest.importorskip("gguf")

STEPS = 8
PROMPT = [1, 17, 230, 5, 99, 410, 3, 77, 8, 21]
COMMON = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, intermediate_size=256,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=False, rms_norm_eps=1e-6)
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _write_gguf(model, arch: str, path, vocab_model: str = "gpt2") -> None:
    """Metadata and float32 tensors as llama.cpp's converter writes them for ``arch``."""
    from flexgen_infinigen.weights.gguf_convert import permute_rotary

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    add_model_metadata(w, c, arch, vocab_model)
    for name, t in model.state_dict().items():
        t = t.float().numpy()
        name = name.removeprefix("model.")
        if name == "embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, i, rest = name.split(".", 2)
            part, kind = rest.rsplit(".", 1)
            out = f"blk.{i}.{_LAYER[part]}.{kind}"
            if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if "q_proj" in part else c.num_key_value_heads
                t = permute_rotary(t, heads)
        w.add_tensor(out, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_matches_transformers(arch, tmp_path):
    import transformers

    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    torch.manual_seed(0)
    name = {"llama": "Llama", "qwen2": "Qwen2"}[arch]
    model = getattr(transformers, f"{name}ForCausalLM")(
        getattr(transformers, f"{name}Config")(**COMMON)).eval()
    with torch.no_grad():  # non-trivial biases and norm scales
        for pname, p in model.named_parameters():
            if "bias" in pname or "norm" in pname:
                p.copy_(torch.randn_like(p) * 0.5 + ("norm" in pname))
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(model, arch, path, vocab_model="llama")
    store = convert_gguf(path, tmp_path / "store", progress=False)
    with OffloadedLM.load(path=store, policy=Placement(), progress=False) as lm:
        assert lm.tokenizer is not None and lm.cfg.architecture == arch
        assert lm.cfg.qkv_bias == (arch == "qwen2")
        out = lm.generate([PROMPT], STEPS, stop_token_id=None, keep_logits=True)
    tokens, logits = hf_greedy(model, PROMPT, STEPS)
    assert out.token_ids[0] == tokens
    assert (out.logits[0] - logits).abs().max().item() < 1e-4
