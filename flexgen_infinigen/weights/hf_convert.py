"""Convert a local Hugging Face checkpoint folder (OPT or Llama) into a weight store.

Reads ``config.json`` and the weights (``*.safetensors``; ``*.bin`` only through
``torch.load(weights_only=True)``, which never runs pickled code), renames the
tensors to the store's names, and copies the tokenizer files along.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import ConfigError, ModelConfig
from ..models import family_of
from .store import StoreWriter

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                   "special_tokens_map.json")

_OPT_LAYER = {"self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj",
              "self_attn.v_proj": "v_proj", "self_attn.out_proj": "o_proj",
              "self_attn_layer_norm": "attn_norm", "final_layer_norm": "mlp_norm",
              "fc1": "fc1", "fc2": "fc2"}
_OPT_TOP = {"decoder.embed_tokens.weight": "embed.weight",
            "decoder.embed_positions.weight": "pos_embed.weight",
            "decoder.project_in.weight": "project_in.weight",
            "decoder.project_out.weight": "project_out.weight",
            "decoder.final_layer_norm.weight": "final_norm.weight",
            "decoder.final_layer_norm.bias": "final_norm.bias"}
_LLAMA_LAYER = {"self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj",
                "self_attn.v_proj": "v_proj", "self_attn.o_proj": "o_proj",
                "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
                "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj",
                "mlp.down_proj": "down_proj"}
_LLAMA_TOP = {"embed_tokens.weight": "embed.weight", "norm.weight": "final_norm.weight",
              "lm_head.weight": "lm_head.weight"}


def config_from_hf(hf: dict, name: str) -> ModelConfig:
    kind = hf.get("model_type")
    if kind == "opt":
        return ModelConfig(
            name=name, family="opt", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["ffn_dim"], num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_attention_heads"],
            max_positions=hf["max_position_embeddings"], tie_word_embeddings=True,
            bos_token_id=hf.get("bos_token_id", 2), eos_token_id=hf.get("eos_token_id", 2),
            pad_token_id=hf.get("pad_token_id", 1),
            word_embed_proj_dim=hf.get("word_embed_proj_dim", hf["hidden_size"])
            if hf.get("word_embed_proj_dim", hf["hidden_size"]) != hf["hidden_size"] else 0,
            do_layer_norm_before=hf.get("do_layer_norm_before", True))
    if kind in ("llama", "mistral"):
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id", 2)
        eos = eos[0] if isinstance(eos, list) else eos
        return ModelConfig(
            name=name, family="llama", vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"], num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            max_positions=hf["max_position_embeddings"], norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=hf.get("rope_theta", 10000.0),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id", 1), eos_token_id=eos,
            pad_token_id=hf.get("pad_token_id") or 0)
    raise ConfigError(f"model_type {kind!r} is not supported; this runtime converts opt and llama")


def store_name(cfg: ModelConfig, hf_name: str) -> str | None:
    """The store's name for a Hugging Face tensor name (None for tensors we do not keep)."""
    name = re.sub(r"^(model\.)", "", hf_name)
    if cfg.family == "opt":
        if name == "lm_head.weight":
            return None  # tied to the token embedding
        m = re.match(r"decoder\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
        if m and m.group(2) in _OPT_LAYER:
            return f"layers.{m.group(1)}.{_OPT_LAYER[m.group(2)]}.{m.group(3)}"
        return _OPT_TOP.get(name)
    m = re.match(r"layers\.(\d+)\.(.+)\.weight$", name)
    if m and m.group(2) in _LLAMA_LAYER:
        return f"layers.{m.group(1)}.{_LLAMA_LAYER[m.group(2)]}.weight"
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    return _LLAMA_TOP.get(name)


def read_checkpoint(folder: Path):
    """Yield (hf_name, torch tensor) from safetensors files, or weights-only ``.bin`` files."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors import safe_open
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    yield key, st.get_tensor(key)
        return
    files = sorted(folder.glob("pytorch_model*.bin")) or sorted(folder.glob("*.bin"))
    if not files:
        raise ConfigError(f"{folder} holds no *.safetensors or *.bin weights; "
                          "point --checkpoint at a Hugging Face model folder")
    for f in files:
        for key, t in torch.load(str(f), map_location="cpu", weights_only=True).items():
            yield key, t


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.contiguous().numpy()


def convert_hf(folder: str | Path, dest: str | Path, name: str | None = None) -> Path:
    folder, dest = Path(folder), Path(dest)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{folder} has no config.json; point --checkpoint at a Hugging Face "
                          "model folder")
    cfg = config_from_hf(json.loads(cfg_file.read_text()), name or folder.name)
    expected = family_of(cfg).weight_shapes(cfg)
    seen = set()
    with StoreWriter(dest, cfg, source=str(folder)) as w:
        for hf_name, tensor in tqdm(read_checkpoint(folder), desc="converting", unit="tensor"):
            ours = store_name(cfg, hf_name)
            if ours is None or ours not in expected:
                continue
            if tuple(tensor.shape) != expected[ours]:
                raise ConfigError(f"{hf_name} has shape {tuple(tensor.shape)}, config.json "
                                  f"implies {expected[ours]}; the checkpoint is inconsistent")
            w.add(ours, to_numpy(tensor))
            seen.add(ours)
        missing = sorted(set(expected) - seen)
        if missing:
            raise ConfigError(f"{folder} lacks {len(missing)} tensors (first: {missing[0]}); "
                              "the checkpoint is partial, download it again")
        for fname in TOKENIZER_FILES:
            if (folder / fname).is_file():
                shutil.copy(folder / fname, w.tmp / fname)
        if (folder / "tokenizer.json").is_file():
            w.tokenizer_file = "tokenizer.json"
    return dest
