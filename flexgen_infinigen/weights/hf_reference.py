"""Hugging Face transformers models holding exactly a weight store's tensors.

The independent reference for tests and benchmarks (transformers is a test-only
dependency): the same numbers through someone else's implementation.
"""
from __future__ import annotations

import numpy as np

from .store import WeightStore

_LLAMA_PARTS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
                "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
                "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                "down_proj": "mlp.down_proj"}


def dequantized(store: WeightStore, name: str):
    """A stored tensor as float32: a quantized GGUF tensor's blocks expanded by ``gguf``'s own
    dequantizer (independent of the runtime's codes), floats widened."""
    import torch

    kind = store.tensors[name].get("gguf_type")
    if kind is None:
        return store.tensor(name).float().clone()
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(store.tensors[name]["shape"])
    values = dequantize(np.asarray(store.load(name)), GGMLQuantizationType[kind])
    return torch.from_numpy(values.reshape(shape).astype(np.float32))


def float_store(src_path, dest):
    """A float32 copy of a store (each quantized tensor expanded by :func:`dequantized`) at
    ``dest``, built once: the same weights as floats, the reference a quantized store is
    measured against (and a float source for ``--compress-weight``)."""
    from pathlib import Path

    from .store import MANIFEST, StoreWriter

    dest = Path(dest)
    if (dest / MANIFEST).is_file():
        return dest
    src = WeightStore(src_path)
    extra = {k: v for k, v in src.manifest.items()
             if k not in ("format", "config", "tensors", "tokenizer", "source")}
    with StoreWriter(dest, src.config, source=src.manifest.get("source", ""),
                     extra=extra) as w:
        for name in src.tensors:
            w.add(name, dequantized(src, name).numpy())
        if src.tokenizer_path is not None:
            w.add_tokenizer_json(src.tokenizer_path.read_text(encoding="utf-8"))
        for extra_file in src.path.iterdir():  # the chat template and such
            if extra_file.is_file() and extra_file.suffix not in (".npy", ".json"):
                w.add_text(extra_file.name, extra_file.read_text(encoding="utf-8"))
    return dest


def hf_llama_from_store(store_path, attn_implementation: str = "eager"):
    """transformers' LlamaForCausalLM with the store's (dequantized) weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    store = WeightStore(store_path)
    c = store.config
    hf_cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                         intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                         num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                         max_position_embeddings=c.max_positions, rms_norm_eps=c.norm_eps,
                         rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
                         bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
                         pad_token_id=c.pad_token_id, attn_implementation=attn_implementation)
    model = LlamaForCausalLM(hf_cfg).eval()
    state = {}
    for name in store.tensors:
        t = dequantized(store, name)
        if name == "embed.weight":
            state["model.embed_tokens.weight"] = t
        elif name == "final_norm.weight":
            state["model.norm.weight"] = t
        elif name == "lm_head.weight":
            state["lm_head.weight"] = t
        else:
            _, i, part, kind = name.split(".")
            state[f"model.layers.{i}.{_LLAMA_PARTS[part]}.{kind}"] = t
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or not all("lm_head" in m for m in missing):
        raise RuntimeError(f"weight mapping is off: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model
