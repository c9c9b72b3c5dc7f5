"""Convert a local Hugging Face checkpoint folder (OPT, Llama 1-3.x, Mistral, Qwen2/2.5,
Qwen3, Gemma 3's text model, and the mixture-of-experts Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE,
GLM-4.5 and DeepSeek-V3 with one tensor per expert matrix, as the Hub writes them, and
gpt-oss, whose fused experts are split per expert: :mod:`.hf_gpt_oss`) into a weight store.

Reads ``config.json`` (:mod:`.hf_config` refuses what we do not compute, before any tensor
is read) and the weights: ``*.safetensors``, sharded with ``model.safetensors.index.json``
or not, streamed one tensor at a time (peak memory about one tensor); ``*.bin`` only through
``torch.load(weights_only=True)``, which never runs pickled code. Tensors keep their source
dtype (bf16 stays bf16); the runtime dtype is chosen when the store is loaded (``--dtype``).
The tokenizer files are copied along.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import ConfigError, ModelConfig
from ..models import family_of
from ..guards import raise_if_interrupted
from ..text.chat import CHAT_FILE, template_from_hf_folder
from .hf_config import config_from_hf
from .hf_gpt_oss import Packed, gpt_oss_tensors
from .hf_qwen3_next import hybrid_tensors
from .hub_files import safe_file_name
from .store import StoreWriter

INDEX_FILE = "model.safetensors.index.json"

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                   "special_tokens_map.json")
# copied into the store beside the tokenizer: the model's sampling defaults, which serve and
# batch read (sampling.generation_defaults)
KEPT_FILES = TOKENIZER_FILES + ("generation_config.json",)

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
                "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm",
                "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
                "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj",
                "mlp.down_proj": "down_proj",
                # DeepSeek-V3's multi-head latent attention (models/mla.py)
                "self_attn.q_a_proj": "q_a_proj", "self_attn.q_a_layernorm": "q_a_norm",
                "self_attn.q_b_proj": "q_b_proj", "self_attn.kv_a_proj_with_mqa": "kv_a_proj",
                "self_attn.kv_a_layernorm": "kv_a_norm", "self_attn.kv_b_proj": "kv_b_proj"}
# mixture-of-experts MLPs: the router, the routed experts (Mixtral's w1/w3/w2 are gate/up/
# down) and Qwen2-MoE's shared expert with its gate
_MOE_LAYER = {"mlp.gate": "router", "block_sparse_moe.gate": "router",
              "mlp.shared_expert_gate": "shared_expert_gate",
              **{f"mlp.{shared}.{m}": f"shared_expert.{m}"
                 for m in ("gate_proj", "up_proj", "down_proj")
                 for shared in ("shared_expert", "shared_experts")}}  # GLM: plural
# GLM-4.5's router bias for choosing experts
_CHOICE_BIAS = re.compile(r"layers\.(\d+)\.mlp\.gate\.e_score_correction_bias$")
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w2|w3)$")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_LLAMA_TOP = {"embed_tokens.weight": "embed.weight", "norm.weight": "final_norm.weight",
              "lm_head.weight": "lm_head.weight"}
# Gemma 3: a norm after the attention and around the MLP (Llama's post_attention_layernorm
# is its MLP's input norm; Gemma's is the attention output's)
_GEMMA3_LAYER = {**_LLAMA_LAYER, "post_attention_layernorm": "post_attn_norm",
                 "pre_feedforward_layernorm": "mlp_norm",
                 "post_feedforward_layernorm": "post_mlp_norm"}
# where a multimodal Gemma 3 folder keeps its text model (transformers 4 and 5 writers)
_GEMMA3_PREFIX = re.compile(r"^(model\.language_model\.|language_model\.model\.|"
                            r"language_model\.|model\.)")


def store_name(cfg: ModelConfig, hf_name: str) -> str | None:
    """The store's name for a Hugging Face tensor name (None for tensors we do not keep)."""
    if cfg.family == "gemma3":
        name = _GEMMA3_PREFIX.sub("", hf_name)
        m = re.match(r"layers\.(\d+)\.(.+)\.(weight|bias)$", name)
        if m and m.group(2) in _GEMMA3_LAYER:
            return f"layers.{m.group(1)}.{_GEMMA3_LAYER[m.group(2)]}.{m.group(3)}"
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None
        return _LLAMA_TOP.get(name)
    name = re.sub(r"^(model\.language_model\.|model\.)", "", hf_name) \
        if cfg.family == "qwen3_next" else re.sub(r"^(model\.)", "", hf_name)
    if cfg.family == "opt":
        if name == "lm_head.weight":
            return None  # tied to the token embedding
        m = re.match(r"decoder\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
        if m and m.group(2) in _OPT_LAYER:
            return f"layers.{m.group(1)}.{_OPT_LAYER[m.group(2)]}.{m.group(3)}"
        return _OPT_TOP.get(name)
    bias = _CHOICE_BIAS.match(name)
    if bias:
        return f"layers.{bias.group(1)}.router.choice_bias"
    m = re.match(r"layers\.(\d+)\.(.+)\.(weight|bias)$", name)
    if m and m.group(2) in _LLAMA_LAYER:
        return f"layers.{m.group(1)}.{_LLAMA_LAYER[m.group(2)]}.{m.group(3)}"
    if m and m.group(2) in _MOE_LAYER:
        return f"layers.{m.group(1)}.{_MOE_LAYER[m.group(2)]}.{m.group(3)}"
    expert = _EXPERT.match(m.group(2)) if m else None
    if expert:
        matrix = _MIXTRAL_EXPERT.get(expert.group(2), expert.group(2))
        return f"layers.{m.group(1)}.experts.{expert.group(1)}.{matrix}.{m.group(3)}"
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None
    return _LLAMA_TOP.get(name)


def stored_tensors(cfg: ModelConfig, hf_name: str, tensor: torch.Tensor,
                   pending: dict | None = None):
    """The store's (name or None, tensor) pairs of one checkpoint tensor: itself under
    :func:`store_name`, except a gpt-oss folder's sinks, router and fused experts (one
    tensor for every expert, split here; MXFP4 experts as :class:`.hf_gpt_oss.Packed`
    blocks once ``pending`` holds both halves of their pair)."""
    if cfg.family == "gpt_oss":
        got = gpt_oss_tensors(hf_name, tensor, pending)
        if got is not None:
            return got
    if cfg.family == "qwen3_next":
        got = hybrid_tensors(cfg, hf_name, tensor)
        if got is not None:
            return got
    return iter([(store_name(cfg, hf_name), tensor)])


def stored_value(cfg: ModelConfig, ours: str, tensor: torch.Tensor) -> torch.Tensor:
    """What the store keeps of a checkpoint tensor: itself, except Gemma's norm scales,
    which the model multiplies as 1 + w; the store keeps 1 + w in float32 (as a GGUF of
    Gemma does, and before any rounding to 16 bits), so that the runtime's norms are
    plain. A hybrid's DeltaNet keeps its decay rate ``-exp(A_log)`` (float32), not
    ``A_log``."""
    if cfg.family == "gemma3" and ours.endswith("norm.weight"):
        return tensor.float() + 1.0
    # the hybrids' norms multiply by 1 + w too, except the DeltaNet's output norm
    if cfg.family == "qwen3_next" and ours.endswith("norm.weight") and ".linear." not in ours:
        return tensor.float() + 1.0
    if cfg.family == "qwen3_next" and ours.endswith(".linear.A"):  # the DeltaNet's decay rate
        return -tensor.float().exp()
    return tensor


def safetensors_files(folder: Path) -> list[Path]:
    """The shards a ``model.safetensors.index.json`` names (each checked to exist), else every
    ``*.safetensors`` file of the folder."""
    index = folder / INDEX_FILE
    if not index.is_file():
        return sorted(folder.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = set(weight_map.values())
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(f"{index} is not a safetensors index (no weight_map); "
                          "download the checkpoint again") from None
    if not all(isinstance(f, str) and safe_file_name(f) for f in names):
        raise ConfigError(f"{index} names a shard outside {folder}; download the checkpoint "
                          "again")
    files = sorted(folder / f for f in names)
    for f in files:
        if not f.is_file():
            raise ConfigError(f"{index} names the shard {f.name}, which is missing; the "
                              "download is incomplete")
    return files


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


# the safetensors library's own limit on a header; real headers are a few hundred KB
MAX_HEADER_BYTES = 100 << 20


def safetensors_header(path: Path) -> tuple[dict, int]:
    """(tensor table, offset of the data) of a safetensors file, without reading the data.
    The header's length is checked against the file's size before it is read: a damaged or
    hostile length asks for no memory."""
    broken = f"{path} is not a safetensors file ({{}}); download it again"
    with open(path, "rb") as f:
        first = f.read(8)
        size = int.from_bytes(first, "little")
        total = os.fstat(f.fileno()).st_size
        if len(first) < 8 or size > min(MAX_HEADER_BYTES, total - 8):
            raise ConfigError(broken.format(
                f"its header claims {size} bytes of a {total}-byte file" if len(first) == 8
                else "shorter than a header"))
        try:
            header = json.loads(f.read(size))
        except (ValueError, RecursionError):
            raise ConfigError(broken.format("bad header")) from None
    if not isinstance(header, dict):
        raise ConfigError(broken.format("its header is not a table of tensors"))
    header.pop("__metadata__", None)
    for name, info in header.items():
        fault = _entry_fault(info, total - 8 - size)
        if fault:
            raise ConfigError(broken.format(f"tensor {name!r}: {fault}"))
    return header, 8 + size


def _entry_fault(info, data_bytes: int) -> str | None:
    """What is wrong with one header entry (None: nothing): the shape and offsets must
    describe bytes inside the file, as many as the shape and dtype need."""
    if not isinstance(info, dict):
        return "not an entry"
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        return f"shape {shape!r} is not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and
            all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]
            <= data_bytes):
        return f"data_offsets {offsets!r} are not inside the file's {data_bytes} data bytes"
    dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
    if dtype is not None and math.prod(shape) * dtype.itemsize != offsets[1] - offsets[0]:
        return f"shape {shape} of {info['dtype']} does not fill data_offsets {offsets}"
    return None


def read_safetensors(path: Path):
    """Yield (name, tensor) from one safetensors file, each read straight from the file into
    its own buffer: no memory map, so the process holds one tensor at a time."""
    header, base = safetensors_header(path)
    with open(path, "rb") as f:
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ConfigError(f"{path}: tensor {name} has dtype {info['dtype']}, which "
                                  "this converter does not read")
            start, end = info["data_offsets"]
            out = torch.empty(info["shape"], dtype=dtype)
            f.seek(base + start)
            if f.readinto(memoryview(out.view(-1).view(torch.uint8).numpy())) != end - start:
                raise ConfigError(f"{path} is truncated (tensor {name}); download it again")
            yield name, out
            del out  # before the next tensor is allocated: one in memory at a time


def _chain(files):
    for f in files:  # ``yield from`` keeps no reference to the tensor it passed on
        yield from read_safetensors(f)


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files a conversion reads: the safetensors, else the ``pytorch_model*.bin``
    shards, else any ``*.bin`` (empty when there are none)."""
    return (safetensors_files(folder) or sorted(folder.glob("pytorch_model*.bin"))
            or sorted(folder.glob("*.bin")))


def read_checkpoint(folder: Path):
    """(number of tensors, iterator of (hf_name, torch tensor)), one tensor in memory at a
    time for safetensors; weights-only ``.bin`` files otherwise."""
    files = safetensors_files(folder)
    if files:
        total = sum(len(safetensors_header(f)[0]) for f in files)
        return total, _chain(files)
    files = checkpoint_files(folder)
    if not files:
        raise ConfigError(f"{folder} holds no *.safetensors or *.bin weights; "
                          "point --checkpoint at a Hugging Face model folder")

    def pickled_free():
        for f in files:
            yield from _weights_only(f).items()
    return None, pickled_free()


def _weights_only(path: Path) -> dict:
    """A ``.bin`` checkpoint's tensors, through ``torch.load(weights_only=True)``, which runs
    no pickled code: a file that holds anything but tensors is refused in one line."""
    import pickle
    import warnings

    try:
        with warnings.catch_warnings():  # torch warns of pickle protocols it may not read
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError,
            TypeError, ImportError, IndexError, KeyError) as e:
        noise = ("Weights only load failed", "Please file an issue", "Check the documentation")
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        why = next((x for x in lines if not x.startswith(noise)), type(e).__name__)
        raise ConfigError(f"{path} holds more than plain tensors ({why[:160]}); it was refused "
                          "without running it: use the model's .safetensors weights, or "
                          "convert the .bin with a tool you trust") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor)
                                              for t in state.values()):
        raise ConfigError(f"{path} holds no plain table of tensors; use the model's "
                          ".safetensors weights")
    return state


def to_numpy(t: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """(array, dtype name for the manifest when numpy has none): bf16 keeps its 16 bits."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy(), "bfloat16"
    return t.numpy(), None


def convert_hf(folder: str | Path, dest: str | Path, name: str | None = None,
               allow_fields: tuple[str, ...] = (), progress: bool = True,
               extra: dict | None = None) -> Path:
    folder, dest = Path(folder), Path(dest)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{folder} has no config.json; point --checkpoint at a Hugging Face "
                          "model folder")
    cfg = config_from_hf(json.loads(cfg_file.read_text()), name or folder.name, allow_fields)
    expected = family_of(cfg).weight_shapes(cfg)
    total, tensors = read_checkpoint(folder)
    seen, pending = set(), {}
    # tensors keep their dtype: the store takes at most the checkpoint files' bytes
    size = sum(f.stat().st_size for f in checkpoint_files(folder))
    with StoreWriter(dest, cfg, source=str(folder), extra=extra, expected_bytes=size) as w:
        for hf_name, tensor in tqdm(tensors, total=total, desc="converting", unit="tensor",
                                    disable=not progress):
            raise_if_interrupted()
            for ours, value in stored_tensors(cfg, hf_name, tensor, pending):
                if ours is None or ours not in expected:
                    continue
                if tuple(value.shape) != expected[ours]:
                    raise ConfigError(f"{hf_name} has shape {tuple(tensor.shape)}, config.json "
                                      f"implies {expected[ours]} for {ours}; the checkpoint is "
                                      "inconsistent")
                if isinstance(value, Packed):  # MXFP4 blocks, kept as they are
                    w.add_blocks(ours, value.raw, value.shape, "MXFP4")
                else:
                    w.add(ours, *to_numpy(stored_value(cfg, ours, value)))
                seen.add(ours)
            del tensor
        missing = sorted(set(expected) - seen)
        if missing:
            raise ConfigError(f"{folder} lacks {len(missing)} tensors (first: {missing[0]}); "
                              "the checkpoint is partial, download it again")
        for fname in KEPT_FILES:
            if (folder / fname).is_file():
                shutil.copy(folder / fname, w.tmp / fname)
        if (folder / "tokenizer.json").is_file():
            w.tokenizer_file = "tokenizer.json"
        template = template_from_hf_folder(folder)
        if template:
            w.add_text(CHAT_FILE, template)
    return dest
