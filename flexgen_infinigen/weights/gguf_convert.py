"""Convert a GGUF file into a weight store: the llama, qwen2 and qwen3 architectures, and
the mixture-of-experts qwen3moe, qwen2moe, olmoe and llama with experts (Mixtral), whose
fused expert tensors are cut into one store tensor per expert matrix (:mod:`.gguf_moe`).

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
MoE types likewise: qwen3moe as qwen3, qwen2moe as qwen2, olmoe's q/k norms span all heads). The
vocabulary becomes a Hugging Face ``tokenizer.json`` stored next to the weights
(:mod:`.gguf_tokenizer`: byte-level BPE by its pre-tokenizer type, or SentencePiece).
"""
from __future__ import annotations

import math
import mmap
import os
import re
import sys
from pathlib import Path

import numpy as np

from ..config import KNOWN_MODELS, ConfigError, ModelConfig
from ..models import llama
from ..guards import raise_if_interrupted
from ..text.chat import CHAT_FILE
from . import gguf_codes, gguf_moe
from .gguf_shards import JoinedReader, shard_paths
from .gguf_tokenizer import special_ids, tokenizer_from_gguf
from .store import StoreWriter

GGUF_MAGIC = b"GGUF"

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
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "olmoe")
# rotary rows interleaved by llama.cpp (undone on conversion) per architecture
PERMUTED = {"llama": True, "qwen2": False, "qwen3": False, "qwen3moe": False,
            "qwen2moe": False, "olmoe": False}


def store_names(gguf_name: str, cfg: ModelConfig | None = None) -> list[str]:
    """The store names of a GGUF tensor (one per expert for a fused MoE tensor);
    ConfigError for tensors we cannot use."""
    m = _LAYER_RE.fullmatch(gguf_name)
    moe = m and cfg is not None and m.group(3) == "weight" and gguf_moe.store_names(
        int(m.group(1)), m.group(2), cfg)
    return moe or [store_name(gguf_name)]


def store_name(gguf_name: str) -> str:
    """The store name of a dense model's GGUF tensor; ConfigError for tensors we cannot use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
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


def _open_reader(path: Path):
    import gguf

    if not path.is_file():
        raise ConfigError(f"GGUF file {path} does not exist; check the path")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ConfigError(f"{path} is not a GGUF file; pass a .gguf model file")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # corrupt or truncated files raise assorted errors
        raise ConfigError(f"cannot read GGUF file {path} ({e}); re-download it") from e


def open_model(path: Path):
    """The reader of a GGUF model: one file, or all shards of a split one (any shard
    named) read as one (:class:`.gguf_shards.JoinedReader`)."""
    paths = shard_paths(Path(path))
    if len(paths) == 1:
        return _open_reader(paths[0])
    return JoinedReader([_open_reader(p) for p in paths], str(path))


def field_value(reader, key: str, default=None):
    """The decoded value of one GGUF metadata key, or ``default``."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "gguf-model"


def config_from_gguf(reader, name: str | None = None, source: str = "") -> ModelConfig:
    """Build (or, for a known ``name``, verify) the model config from GGUF metadata."""
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"GGUF {source} has architecture {arch!r}; only "
                          f"{', '.join(ARCHITECTURES)} GGUF files can be converted")
    p = arch + "."
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ConfigError(f"GGUF {source} has no token_embd.weight; it is not a complete model")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    vocab = field_value(reader, p + "vocab_size") or (len(tokens) if tokens else None)
    vocab = vocab or int(tensors["token_embd.weight"].shape[-1])
    hidden = int(field_value(reader, p + "embedding_length"))
    heads = int(field_value(reader, p + "attention.head_count"))
    head_dim = int(field_value(reader, p + "attention.key_length", hidden // heads))
    rope_dim = field_value(reader, p + "rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ConfigError(f"GGUF {source} uses partial rotary embeddings ({rope_dim} of "
                          f"{head_dim} dims), which this runtime does not support")
    scaling = field_value(reader, p + "rope.scaling.type")
    rope = {}
    if scaling == "linear":
        rope = {"rope_type": "linear", "factor": float(field_value(reader,
                                                                   p + "rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ConfigError(f"GGUF {source} uses rope scaling {scaling!r}, which the GGUF path "
                          "does not read; convert the Hugging Face checkpoint instead")
    moe = gguf_moe.experts_from_gguf(reader, arch, source)
    meta = ModelConfig(
        name=name or _slug(field_value(reader, "general.name") or Path(source).stem),
        family="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(field_value(reader, p + "feed_forward_length", 0)
                              or moe.get("expert_intermediate_size", 0)),
        num_layers=int(field_value(reader, p + "block_count")),
        num_heads=heads,
        num_kv_heads=int(field_value(reader, p + "attention.head_count_kv", heads)),
        max_positions=int(field_value(reader, p + "context_length", 2048)),
        norm_eps=float(field_value(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field_value(reader, p + "rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=int(field_value(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=int(field_value(reader, "tokenizer.ggml.eos_token_id", 2)),
        pad_token_id=int(field_value(reader, "tokenizer.ggml.padding_token_id", 0)),
        attn_head_dim=head_dim if head_dim * heads != hidden else 0,
        qkv_bias="blk.0.attn_q.bias" in tensors, rope_scaling=rope,
        qk_norm="blk.0.attn_q_norm.weight" in tensors, qk_norm_full=arch == "olmoe",
        **{"model_type": arch, **moe},
    )
    if name is None or name not in KNOWN_MODELS:
        return meta
    known = KNOWN_MODELS[name]
    for field in ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "tie_word_embeddings", "head_dim", "qkv_bias",
                  "rope_scaling"):
        if getattr(known, field) != getattr(meta, field):
            raise ConfigError(f"GGUF {source} has {field}={getattr(meta, field)}, but "
                              f"{name} has {getattr(known, field)}; pick the matching --model")
    for field in ("norm_eps", "rope_theta"):
        if not math.isclose(getattr(known, field), getattr(meta, field), rel_tol=1e-5):
            raise ConfigError(f"GGUF {source} has {field}={getattr(meta, field)}, but "
                              f"{name} has {getattr(known, field)}; pick the matching --model")
    return known


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


def _tensor_rows(t, kind: str, shape: tuple[int, ...], src: Path) -> np.ndarray:
    """A GGUF tensor's data as stored: quantized blocks ``[rows, bytes a row]`` (uint8),
    F32/F16 values, or BF16 bits as int16, in ``shape``. One error when the file holds fewer
    bytes than the tensor needs (a file cut short)."""
    data = np.asarray(t.data)
    rows = math.prod(shape[:-1])
    if kind in gguf_codes.BLOCKS:
        size, per = gguf_codes.BLOCKS[kind][:2]
        want = (rows * (shape[-1] // per) * size, shape[-1] % per == 0)
        if data.nbytes != want[0] or not want[1]:
            raise ConfigError(f"GGUF {src}: tensor {t.name!r} holds {data.nbytes} bytes, its "
                              f"{kind} blocks need {want[0]}; the file is damaged or cut "
                              "short, re-download it")
        return data.view(np.uint8).reshape(rows, -1)
    dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}[kind]
    if data.nbytes != math.prod(shape) * np.dtype(dtype).itemsize:
        raise ConfigError(f"GGUF {src}: tensor {t.name!r} holds {data.nbytes} bytes, not "
                          f"{math.prod(shape)} {kind} values; the file is damaged or cut "
                          "short, re-download it")
    return data.view(dtype).reshape(shape)


def tokenizer_json_from_gguf(reader, pre_tokenizer: str | None = None) -> str | None:
    """The GGUF's tokenizer as a Hugging Face tokenizer.json (None: the file has none)."""
    tok = tokenizer_from_gguf(reader, pre_tokenizer)
    return None if tok is None else tok.to_str(pretty=True)


def _plan(reader, cfg: ModelConfig, src: Path) -> list[tuple]:
    """(tensor, store names, each one's shape) for every tensor of the file, all names and
    shapes checked against the config before anything is written; one error for a tensor
    the model does not have, a shape (or expert count) the metadata does not imply, or a
    tensor the file lacks."""
    expected = llama.weight_shapes(cfg)
    plan, seen = [], set()
    for t in reader.tensors:
        keys = store_names(t.name, cfg)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        for key in keys:
            if key not in expected:
                raise ConfigError(f"GGUF tensor {t.name!r} is not part of {cfg.name}; "
                                  "the file does not match the model config")
        if gguf_moe.is_moe_key(keys[0]):
            shape = gguf_moe.check_shape(t.name, shape, keys, expected, cfg, str(src))
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


def convert_gguf(gguf_path: str | os.PathLike, dest: str | os.PathLike,
                 name: str | None = None, progress: bool = True,
                 pre_tokenizer: str | None = None, extra: dict | None = None) -> Path:
    """Convert ``gguf_path`` into a weight store at ``dest`` (written atomically).

    ``pre_tokenizer`` overrides the file's ``tokenizer.ggml.pre``; ``extra`` goes into the
    store's manifest (the source identity of a ``--model FILE`` conversion)."""
    from tqdm import tqdm

    src, dest = Path(gguf_path), Path(dest)
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
    info = {"special_ids": special_ids(reader), **(extra or {})}
    # every tensor is kept as the file stores it: the store takes the file's tensor bytes
    size = sum(int(t.n_bytes) for t, _, _ in plan)
    with StoreWriter(dest, cfg, source=f"gguf:{src.name}", extra=info,
                     expected_bytes=size) as writer:
        for t, keys, shape in tqdm(plan, desc=f"converting {src.name}", unit="tensor",
                                   disable=not progress):
            raise_if_interrupted()
            kind = t.tensor_type.name
            whole = (len(keys), *shape) if len(keys) > 1 else shape
            w = _tensor_rows(t, kind, whole, src)
            key = keys[0]
            # whole rows move: a row's blocks (or values) stay together, codes unchanged
            if permuted and (key.endswith("q_proj.weight") or key.endswith("q_proj.bias")):
                w = unpermute_rotary(w, cfg.num_heads)
            elif permuted and (key.endswith("k_proj.weight") or key.endswith("k_proj.bias")):
                w = unpermute_rotary(w, cfg.num_kv_heads)
            for e, key in enumerate(keys):  # a fused tensor: matrix e is its e-th run of rows
                part = w.reshape(len(keys), -1, w.shape[-1])[e] if len(keys) > 1 else w
                _write(writer, key, part, shape, kind)
            del w
            _release(reader, t)
        template = field_value(reader, "tokenizer.chat_template")
        if template:
            writer.add_text(CHAT_FILE, template)
        if tokenizer is not None:
            writer.add_tokenizer_json(tokenizer)
    return dest
