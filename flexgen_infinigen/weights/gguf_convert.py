"""A GGUF file's tensors as a weight store's: checked and named here (:func:`prepare`, also
for the index that reads them in place, :mod:`.gguf_index`), or copied into a store of their
own (:func:`convert_gguf`). The llama, qwen2, qwen3 and gemma3 architectures, the
Qwen3.5 / Qwen3-Next hybrids (:mod:`.gguf_hybrid`: a tensor whose rows hold two of ours
split by row picks), and
the mixture-of-experts qwen3moe, qwen2moe, olmoe, glm4moe, deepseek2, gpt-oss and llama with
experts (Mixtral), whose fused expert tensors (gpt-oss's expert biases too) are cut into one
store tensor per expert matrix (:mod:`.gguf_moe`); gpt-oss's ``attn_sinks`` become each
layer's ``sinks``.
The header and config are read by :mod:`.gguf_config`.

Every tensor is kept as the file stores it, renamed to the store's canonical names:
quantized ones as their blocks (the runtime reads their codes, :mod:`.gguf_codes`), float
ones at their own width (F32, F16, BF16); nothing is expanded to floats, so converting
holds one tensor's bytes at a time. A tensor type that cannot be kept is refused by name
before anything is written. For the llama architecture, llama.cpp stores
``attn_q``/``attn_k`` with the rows of each head interleaved for its rotary kernel; we
undo that (moving whole rows, codes unchanged) so the store matches Hugging Face's layout
(the ``rotate_half`` convention that :func:`flexgen_infinigen.models.llama.rotary`
implements). qwen2 files keep Hugging Face's order (llama.cpp rotates them the NeoX way)
and carry q/k/v biases; qwen3 files keep it too and add per-head q/k RMSNorm weights (the
MoE types likewise: qwen3moe as qwen3, qwen2moe as qwen2, olmoe's q/k norms span all heads;
gemma3 files keep it and hold Gemma's norm scales already shifted by 1, as our store does). The
vocabulary becomes a Hugging Face ``tokenizer.json`` stored next to the weights
(:mod:`.gguf_tokenizer`: byte-level BPE by its pre-tokenizer type, or SentencePiece).
"""
from __future__ import annotations

import math
import mmap
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ConfigError, ModelConfig
from ..guards import raise_if_interrupted
from ..models import family_of
from ..text.chat import CHAT_FILE
from . import gguf_codes, gguf_hybrid, gguf_moe
# the header's reading, kept importable from here
from .gguf_config import (ARCHITECTURES, GGUF_MAGIC, _open_reader,  # noqa: F401
                          config_from_gguf, field_value, open_model)
from .gguf_tokenizer import special_ids, tokenizer_from_gguf
from .in_place import picked_rows
from .store import StoreWriter

_GLOBAL_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "final_norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "attn_norm", "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
    "attn_output": "o_proj", "ffn_norm": "mlp_norm", "ffn_gate": "gate_proj",
    "ffn_up": "up_proj", "ffn_down": "down_proj", "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    # GLM-4.5 names its MLP's input norm so (Hugging Face's post_attention_layernorm)
    "post_attention_norm": "mlp_norm",
    # DeepSeek-V3's latent attention (kv_b whole, or split by llama.cpp into k_b and v_b)
    "attn_q_a": "q_a_proj", "attn_q_a_norm": "q_a_norm", "attn_q_b": "q_b_proj",
    "attn_kv_a_mqa": "kv_a_proj", "attn_kv_a_norm": "kv_a_norm", "attn_kv_b": "kv_b_proj",
    "attn_k_b": "k_b_proj", "attn_v_b": "v_b_proj",
}
# Gemma 3's norms of the attention's and the MLP's outputs (its MLP input norm is ffn_norm)
_GEMMA3_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attn_norm",
                 "post_ffw_norm": "post_mlp_norm"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# rotary rows interleaved by llama.cpp (undone on conversion, recorded by an index) by arch
PERMUTED = {"llama": True, "qwen2": False, "qwen3": False, "qwen3moe": False,
            "qwen2moe": False, "olmoe": False, "gemma3": False, "glm4moe": False,
            "deepseek2": False, "gpt-oss": False,
            **{arch: False for arch in gguf_hybrid.ARCHITECTURES}}


def store_names(gguf_name: str, cfg: ModelConfig | None = None) -> list[str]:
    """The store names of a GGUF tensor (one per expert for a fused MoE tensor);
    ConfigError for tensors we cannot use."""
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and cfg is not None and m.group(2) == "exp_probs_b" and cfg.router_sigmoid:
        return [f"layers.{m.group(1)}.router.choice_bias"]
    if m and cfg is not None and m.group(2) == "attn_sinks" and cfg.attn_sinks:
        return [f"layers.{m.group(1)}.sinks"]
    hybrid = cfg is not None and gguf_hybrid.store_names(gguf_name, cfg)
    if hybrid:
        return hybrid
    moe = m and cfg is not None and gguf_moe.store_names(int(m.group(1)), m.group(2), cfg,
                                                         m.group(3))
    return moe or [store_name(gguf_name, cfg)]


# any tensor of a block, drafting ones (blk.N.nextn.eh_proj) included
_BLOCK_RE = re.compile(r"blk\.(\d+)\.")


def store_name(gguf_name: str, cfg: ModelConfig | None = None) -> str:
    """The store name of a dense model's GGUF tensor; ConfigError for tensors we cannot use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA3_NAMES if cfg is not None and cfg.family == "gemma3" else _LAYER_NAMES
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in names:
        return f"layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", gguf_name):
        raise ConfigError(f"GGUF tensor {gguf_name!r} is one expert of an old Mixtral layout "
                          "(one tensor per expert), which this runtime does not read; convert "
                          "the model again with a current llama.cpp (fused ffn_*_exps)")
    if gguf_name == "rope_freqs.weight":
        raise ConfigError("this GGUF carries Llama 3.1-style RoPE frequency factors "
                          "(rope_freqs), which the GGUF path does not read; convert the "
                          "Hugging Face checkpoint with --checkpoint instead")
    raise ConfigError(f"GGUF tensor {gguf_name!r} is not computed by this runtime; it reads "
                      f"GGUF architectures {', '.join(ARCHITECTURES)} (llama with or without "
                      "experts)")


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's conversion of HF q/k rows: per head, halves [a | b] -> interleaved pairs."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, 2, out // n_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Exact inverse of :func:`permute_rotary`: back to HF's half-split rotary layout."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _release(reader, t) -> None:
    """Hand back the mapped pages of a tensor already written: the file stays in the page
    cache, but the process no longer holds it resident (converting an 8B file would
    otherwise count its 4.9 GB in the converter's memory)."""
    reader = getattr(reader, "owner", {}).get(t.name, reader)  # a shard's own reader
    mm = getattr(getattr(reader, "data", None), "_mmap", None)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, int(t.data_offset) + int(t.n_bytes) - start)
    except (OSError, ValueError):
        pass


FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}  # BF16: its bits


def held_bytes(name: str, have: int, kind: str, shape: tuple[int, ...], src: Path) -> int:
    """The bytes tensor ``name`` of ``kind`` and ``shape`` takes in the file (its blocks, or
    its values); one error when the file holds ``have`` bytes of it instead (a file cut
    short, or a row that is not whole blocks)."""
    if kind in gguf_codes.BLOCKS:
        size, per = gguf_codes.BLOCKS[kind][:2]
        want = math.prod(shape[:-1]) * (shape[-1] // per) * size
        if have != want or shape[-1] % per:
            raise ConfigError(f"GGUF {src}: tensor {name!r} holds {have} bytes, its "
                              f"{kind} blocks need {want}; the file is damaged or cut "
                              "short, re-download it")
        return want
    want = math.prod(shape) * np.dtype(FLOAT_DTYPES[kind]).itemsize
    if have != want:
        raise ConfigError(f"GGUF {src}: tensor {name!r} holds {have} bytes, not "
                          f"{math.prod(shape)} {kind} values; the file is damaged or cut "
                          "short, re-download it")
    return want


def _tensor_rows(t, kind: str, shape: tuple[int, ...], src: Path) -> np.ndarray:
    """A GGUF tensor's data as stored: quantized blocks ``[rows, bytes a row]`` (uint8),
    F32/F16 values, or BF16 bits as int16, in ``shape``. One error when the file holds fewer
    bytes than the tensor needs (a file cut short)."""
    data = np.asarray(t.data)
    held_bytes(t.name, data.nbytes, kind, shape, src)
    if kind in gguf_codes.BLOCKS:
        return data.view(np.uint8).reshape(math.prod(shape[:-1]), -1)
    return data.view(FLOAT_DTYPES[kind]).reshape(shape)


def tokenizer_json_from_gguf(reader, pre_tokenizer: str | None = None) -> str | None:
    """The GGUF's tokenizer as a Hugging Face tokenizer.json (None: the file has none)."""
    tok = tokenizer_from_gguf(reader, pre_tokenizer)
    return None if tok is None else tok.to_str(pretty=True)


def _plan(reader, cfg: ModelConfig, src: Path) -> list[tuple]:
    """(tensor, store names, each one's shape) for every tensor of the file, all names and
    shapes checked against the config before anything is written; one error for a tensor
    the model does not have, a shape (or expert count) the metadata does not imply, or a
    tensor the file lacks."""
    expected = family_of(cfg).weight_shapes(cfg)
    # the file's multi-token-prediction blocks (GLM, DeepSeek) come after the model's; they
    # only draft tokens, and are not read
    drafting = int(field_value(reader, f"{field_value(reader, 'general.architecture')}."
                               "nextn_predict_layers", 0) or 0)
    plan, seen = [], set()
    for t in reader.tensors:
        block = _BLOCK_RE.match(t.name)
        if drafting and block and int(block.group(1)) >= cfg.num_layers:
            continue
        keys = store_names(t.name, cfg)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        for key in keys:
            if key not in expected:
                raise ConfigError(f"GGUF tensor {t.name!r} is not part of {cfg.name}; "
                                  "the file does not match the model config")
        picks = gguf_hybrid.row_picks(keys, cfg)
        if picks is not None:
            shape = gguf_hybrid.check_picked(t.name, shape, keys, picks, expected, str(src))
        elif gguf_moe.is_moe_key(keys[0]):
            shape = gguf_moe.check_shape(t.name, shape, keys, expected, cfg, str(src))
        elif len(shape) == 3 and (shape[0] * shape[1], shape[2]) == expected[keys[0]]:
            shape = expected[keys[0]]  # per-head matrices (k_b, v_b): their rows, stacked
        elif shape != expected[keys[0]]:
            raise ConfigError(f"GGUF tensor {t.name!r} has shape {shape}, {cfg.name} "
                              f"wants {expected[keys[0]]}; the file does not match the model")
        plan.append((t, keys, shape))
        seen.update(keys)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ConfigError(f"GGUF {src} lacks {len(missing)} tensors (e.g. {missing[0]!r}); "
                          "the file is incomplete, re-download it")
    return plan


def _write(writer: StoreWriter, key: str, w: np.ndarray, shape: tuple[int, ...],
           kind: str) -> None:
    if kind in gguf_codes.BLOCKS:
        writer.add_blocks(key, w, shape, kind)
    elif kind == "BF16":
        writer.add(key, w.reshape(shape), dtype="bfloat16")
    else:
        writer.add(key, w.reshape(shape))


@dataclass
class Prepared:
    """A GGUF model opened and checked before anything is written: its config, the plan of
    its tensors (:func:`_plan`), the head count of each store tensor whose rows llama.cpp
    interleaved (``rotary_heads``), its tokenizer.json, chat template and manifest fields."""

    reader: object
    cfg: ModelConfig
    plan: list[tuple]
    rotary_heads: dict[str, int]
    tokenizer: str | None
    template: str | None
    info: dict


def prepare(src: Path, name: str | None = None, pre_tokenizer: str | None = None,
            extra: dict | None = None) -> Prepared:
    """Open and check the GGUF model ``src`` (every tensor's type, name and shape, and its
    tokenizer), one error for anything that cannot be kept; reads its header, no tensor."""
    reader = open_model(src)
    cfg = config_from_gguf(reader, name, str(src))
    permuted = PERMUTED[field_value(reader, "general.architecture")]
    for t in reader.tensors:  # every type checked before anything is written
        gguf_codes.check_kept(t.tensor_type.name, t.name, str(src))
    plan = _plan(reader, cfg, src)  # every name and shape too
    tokenizer = tokenizer_json_from_gguf(reader, pre_tokenizer)  # refused before any tensor
    if tokenizer is None:
        print("note: the GGUF has no tokenizer; the store has none: run it with --prompt-len",
              file=sys.stderr)
    heads = {}
    for _, keys, _ in plan if permuted else ():
        proj = keys[0].rsplit(".", 2)[-2]
        if proj in ("q_proj", "k_proj"):
            heads[keys[0]] = cfg.num_heads if proj == "q_proj" else cfg.num_kv_heads
    return Prepared(reader, cfg, plan, heads, tokenizer,
                    field_value(reader, "tokenizer.chat_template"),
                    {"special_ids": special_ids(reader), **(extra or {})})


def finish(writer: StoreWriter, prep: Prepared) -> None:
    """The chat template and tokenizer beside the tensors."""
    if prep.template:
        writer.add_text(CHAT_FILE, prep.template)
    if prep.tokenizer is not None:
        writer.add_tokenizer_json(prep.tokenizer)


def convert_gguf(gguf_path: str | os.PathLike, dest: str | os.PathLike,
                 name: str | None = None, progress: bool = True,
                 pre_tokenizer: str | None = None, extra: dict | None = None) -> Path:
    """Copy ``gguf_path``'s tensors into a weight store at ``dest`` (written atomically): a
    store that stands on its own (``convert --gguf``; ``--model FILE.gguf`` reads the file
    in place instead, :mod:`.gguf_index`).

    ``pre_tokenizer`` overrides the file's ``tokenizer.ggml.pre``; ``extra`` goes into the
    store's manifest."""
    from tqdm import tqdm

    src, dest = Path(gguf_path), Path(dest)
    prep = prepare(src, name, pre_tokenizer, extra)
    reader = prep.reader
    # every tensor is kept as the file stores it: the store takes the file's tensor bytes
    size = sum(int(t.n_bytes) for t, _, _ in prep.plan)
    with StoreWriter(dest, prep.cfg, source=f"gguf:{src.name}", extra=prep.info,
                     expected_bytes=size) as writer:
        for t, keys, shape in tqdm(prep.plan, desc=f"converting {src.name}", unit="tensor",
                                   disable=not progress):
            raise_if_interrupted()
            kind = t.tensor_type.name
            whole = (len(keys), *shape) if len(keys) > 1 else shape
            w = _tensor_rows(t, kind, whole, src)
            heads = prep.rotary_heads.get(keys[0])
            if heads:  # whole rows move: a row's blocks (or values) stay together
                w = unpermute_rotary(w, heads)
            picks = gguf_hybrid.row_picks(keys, prep.cfg)
            for e, key in enumerate(keys):  # a fused tensor: matrix e is its e-th run of rows
                if picks is not None:  # rows that interleave: each key's picked
                    part = w.reshape(-1, w.shape[-1])[picked_rows(picks[e])]
                else:
                    part = w.reshape(len(keys), -1, w.shape[-1])[e] if len(keys) > 1 else w
                _write(writer, key, part, shape, kind)
            del w
            _release(reader, t)
        finish(writer, prep)
    return dest
