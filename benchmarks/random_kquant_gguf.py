"""A dense model's GGUF in real shapes with random codes in llama.cpp's Q4_K_M mix, for timing
our runtime and llama.cpp on the same file at the sizes people run (nothing in it is trained).

    python benchmarks/random_kquant_gguf.py --models qwen2.5-7b --out /data/gguf
    python benchmarks/random_kquant_gguf.py --models qwen2.5-7b --layers 2 --out /tmp/g

The mix is what llama.cpp's quantizer makes for ``Q4_K_M`` (``llama_tensor_get_type``):
Q4_K for every matrix and ``token_embd``; Q6_K for ``output.weight``; ``attn_v`` and
``ffn_down`` in Q6_K on the layers its ``use_more_bits`` picks (the first and last eighth,
and every third layer between), Q4_K elsewhere; norms and biases F32. A cut (``--layers N``)
keeps the first N layers with the types they have in the whole model, and everything else.

The blocks (``kquant_blocks.py``, read back by ``gguf.quants`` in
tests/test_random_kquant_gguf.py) hold uniform random codes under scales drawn so that values
have mean ~0 and std ~0.02 (the usual initialisation scale, as ``--dummy`` weights): the
activations stay finite through every layer. Llama-3.1's
``rope_freqs.weight`` (its long-context RoPE factors) is left out: this runtime's GGUF path
refuses it, and the matrices' shapes are the same without it. The vocabulary is placeholder
tokens of the model's size (llama.cpp needs one; the benchmarks feed random token ids).

The file is written one tensor at a time (never the model in memory), as ``FILE.part``
renamed when complete, so a stopped write never looks like a file.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np

from kquant_blocks import Q4_K_BYTES, Q6_K_BYTES, QK, STD, random_blocks

DESCRIPTION = ("random codes in llama.cpp's Q4_K_M mix (benchmarks/random_kquant_gguf.py): "
               "nothing in it is a trained value")


@dataclasses.dataclass(frozen=True)
class Dense:
    """A dense decoder's shapes as its GGUF stores them."""

    name: str
    arch: str  # GGUF general.architecture: qwen2 (q/k/v biases) or llama
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float
    norm_eps: float
    context: int
    head_dim: int = 128

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"


SHAPES = {
    "qwen2.5-7b": Dense("Qwen2.5-7B", "qwen2", 3584, 18944, 28, 28, 4, 152064, 1e6, 1e-6, 32768),
    "llama-3.1-8b": Dense("Llama-3.1-8B", "llama", 4096, 14336, 32, 32, 8, 128256, 5e5, 1e-5,
                          131072),
    "qwen2.5-14b": Dense("Qwen2.5-14B", "qwen2", 5120, 13824, 48, 40, 8, 152064, 1e6, 1e-6,
                         32768),
    "qwen2.5-32b": Dense("Qwen2.5-32B", "qwen2", 5120, 27648, 64, 40, 8, 152064, 1e6, 1e-6,
                         32768),
}
NOTES = {"llama-3.1-8b": "rope_freqs.weight (Llama 3.1's long-context RoPE factors) left out: "
                         "this runtime's GGUF path refuses it; the matrices' shapes are the same"}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_plan(shape: Dense, layers: int | None = None) -> list[tuple[str, tuple, str]]:
    """(GGUF name, (rows, columns) or (length,), type) of each tensor in file order; a cut to
    ``layers`` keeps each layer's type in the whole model."""
    h, kv, n = shape.hidden, shape.kv_heads * shape.head_dim, shape.layers
    q = shape.heads * shape.head_dim
    out = [("token_embd.weight", (shape.vocab, h), "Q4_K")]
    for i in range(n if layers is None else layers):
        more = "Q6_K" if use_more_bits(i, n) else "Q4_K"
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,), "F32"),
                (b + "attn_q.weight", (q, h), "Q4_K"),
                (b + "attn_k.weight", (kv, h), "Q4_K"),
                (b + "attn_v.weight", (kv, h), more)]
        if shape.qkv_bias:
            out += [(b + "attn_q.bias", (q,), "F32"), (b + "attn_k.bias", (kv,), "F32"),
                    (b + "attn_v.bias", (kv,), "F32")]
        out += [(b + "attn_output.weight", (h, q), "Q4_K"),
                (b + "ffn_norm.weight", (h,), "F32"),
                (b + "ffn_gate.weight", (shape.intermediate, h), "Q4_K"),
                (b + "ffn_up.weight", (shape.intermediate, h), "Q4_K"),
                (b + "ffn_down.weight", (h, shape.intermediate), more)]
    return out + [("output_norm.weight", (h,), "F32"), ("output.weight", (shape.vocab, h), "Q6_K")]


def tensor_bytes(dims: tuple, kind: str) -> int:
    if kind == "F32":
        return 4 * int(np.prod(dims))
    rows, cols = dims
    return rows * cols // QK * (Q4_K_BYTES if kind == "Q4_K" else Q6_K_BYTES)


def file_bytes(shape: Dense, layers: int | None = None) -> int:
    """The tensors' bytes (the file is these plus a header of a few MB: the vocabulary)."""
    return sum(tensor_bytes(d, k) for _, d, k in tensor_plan(shape, layers))


def tensor_data(name: str, dims: tuple, kind: str, seed: int) -> np.ndarray:
    """One tensor's bytes, drawn from a generator of its own (seed and name): a cut's
    tensors are the whole model's first layers' tensors, byte for byte."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if kind != "F32":
        return random_blocks(rng, dims, kind)
    if name.endswith(".bias"):
        return (rng.standard_normal(dims, dtype=np.float32) * STD).astype(np.float32)
    return np.ones(dims, np.float32)  # norms


# --- the file -------------------------------------------------------------------------------

def file_name(key: str, layers: int | None = None) -> str:
    shape = SHAPES[key]
    cut = "" if layers is None or layers == shape.layers else f"-{layers}-of-{shape.layers}L"
    return f"{shape.name}{cut}-Q4_K_M-random.gguf"


def check_room(folder: Path, need: int) -> None:
    """One error before writing when ``folder``'s disk has no room for ``need`` bytes."""
    free = shutil.disk_usage(folder).free
    if free < need + (1 << 30):
        raise SystemExit(f"error: {folder} has {free / 1e9:.1f} GB free; the file needs "
                         f"{need / 1e9:.1f} GB (and 1 GB to spare): pass --out on a disk with "
                         "room, or fewer --models / a --layers cut")


def write_plan(path: str | Path, arch: str, plan: list, metadata, size_of, data_of,
               progress: bool = True) -> None:
    """Write the tensors of ``plan`` ((GGUF name, numpy dims, type) in file order) as a GGUF
    of architecture ``arch``: ``metadata(writer)`` adds its fields, ``size_of(dims, type)``
    gives a tensor's bytes, ``data_of(name, dims, type)`` its data (float32 values, or
    blocks ``uint8 [rows, bytes]``), one at a time. Written as ``FILE.part``, renamed when
    complete; removed on any error (a cut-short file never looks complete)."""
    import gguf
    from tqdm.auto import tqdm

    path = Path(path)
    part = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(str(part), arch)
    try:
        metadata(w)
        for name, dims, kind in plan:
            size = size_of(dims, kind)
            if kind == "F32":
                w.add_tensor_info(name, dims, np.dtype(np.float32), size)
            else:
                rows = int(np.prod(dims[:-1]))
                w.add_tensor_info(name, (*dims[:-1], size // rows), np.dtype(np.uint8), size,
                                  raw_dtype=gguf.GGMLQuantizationType[kind])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(size_of(d, k) for _, d, k in plan)
        with tqdm(total=total, unit="B", unit_scale=True, desc=path.name,
                  disable=not progress) as bar:
            for name, dims, kind in plan:
                data = data_of(name, dims, kind)
                w.write_tensor_data(data)
                bar.update(data.nbytes)
                del data
        w.close()
        os.replace(part, path)
    except BaseException:
        w.close()
        part.unlink(missing_ok=True)
        raise


def write_dense_gguf(key: str, path: str | Path, layers: int | None = None, seed: int = 0,
                     progress: bool = True) -> dict:
    """Write the file (``key`` from :data:`SHAPES`); returns what it holds (its tensors'
    bytes by type, the bytes a decode step reads: all but ``token_embd``)."""
    shape = SHAPES[key]
    if layers is not None and not 1 <= layers <= shape.layers:
        raise ValueError(f"--layers {layers}: {shape.name} has 1..{shape.layers} layers")
    n = shape.layers if layers is None else layers
    write_plan(path, shape.arch, tensor_plan(shape, n), lambda w: _metadata(w, shape, n),
               tensor_bytes, lambda name, dims, kind: tensor_data(name, dims, kind, seed),
               progress)
    return describe(key, n, seed)


def write_gguf(key: str, path, layers: int | None = None) -> dict:
    """The file (the interface ``gguf_sizes.files_of`` names)."""
    return write_dense_gguf(key, path, layers)


def decode_read_bytes(key: str, layers: int, batch: int) -> int:
    """The weight bytes a decode step reads at any batch: all but ``token_embd``."""
    return describe(key, layers)["decode_read_bytes"]


def kv_read_bytes(key: str, layers: int, context: float) -> float:
    """f16 K and V rows of ``context`` tokens in every layer (llama.cpp's cache), a row."""
    shape = SHAPES[key]
    return 2 * layers * shape.kv_heads * shape.head_dim * 2 * context


def describe(key: str, layers: int, seed: int = 0) -> dict:
    """What a file of ``key`` cut to ``layers`` holds, for a results JSON."""
    shape = SHAPES[key]
    plan = tensor_plan(shape, layers)
    by_type: dict[str, int] = {}
    for _, dims, kind in plan:
        by_type[kind] = by_type.get(kind, 0) + tensor_bytes(dims, kind)
    embd = tensor_bytes(*next((d, k) for name, d, k in plan if name == "token_embd.weight"))
    return {"model": shape.name, "arch": shape.arch, "layers": layers,
            "model_layers": shape.layers, "mix": "Q4_K_M", "seed": seed,
            "tensor_bytes": sum(by_type.values()), "tensor_bytes_by_type": by_type,
            "decode_read_bytes": sum(by_type.values()) - embd,
            "q6_k_layers": [i for i in range(layers) if use_more_bits(i, shape.layers)],
            **({"note": NOTES[key]} if key in NOTES else {})}


def _metadata(w, shape: Dense, layers: int) -> None:
    import gguf

    w.add_name(shape.name + " (random Q4_K_M codes)")
    w.add_description(DESCRIPTION)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.norm_eps)
    add_placeholder_vocab(w, shape.vocab)


def add_placeholder_vocab(w, vocab: int) -> None:
    """A SentencePiece vocabulary of ``vocab`` placeholder tokens (llama.cpp needs one; the
    benchmarks feed random ids): unk, bos, eos, the 256 bytes, then ``t{i}``."""
    import gguf

    w.add_vocab_size(vocab)
    special = ["<unk>", "<s>", "</s>"]
    tokens = special + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"t{i}" for i in range(vocab - len(tokens))]
    T = gguf.TokenType
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
                      + [T.NORMAL] * (len(tokens) - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def value_stats(path: str | Path, names: tuple[str, ...] = ("blk.0.attn_q.weight",
                                                            "blk.0.ffn_down.weight",
                                                            "output.weight"),
                rows: int = 64) -> dict:
    """Mean, std and finiteness of the first ``rows`` rows of some tensors, dequantized with
    ``gguf.quants`` (the reference reader): the file's values are what was meant."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        if t.name in names:
            v = dequantize(np.asarray(t.data[:rows]), t.tensor_type)
            out[t.name] = {"type": t.tensor_type.name, "mean": float(v.mean()),
                           "std": float(v.std()), "finite": bool(np.isfinite(v).all())}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen2.5-7b"], choices=list(SHAPES))
    p.add_argument("--out", required=True, help="the folder the files go to")
    p.add_argument("--layers", type=int, default=None,
                   help="a cut: the first N layers (everything else as the whole model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="write again over an existing file")
    a = p.parse_args(argv)
    out = Path(a.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    for key in a.models:
        if a.layers is not None and not 1 <= a.layers <= SHAPES[key].layers:
            p.error(f"--layers {a.layers}: {SHAPES[key].name} has 1..{SHAPES[key].layers}")
    todo = [k for k in a.models if a.force or not (out / file_name(k, a.layers)).is_file()]
    check_room(out, sum(file_bytes(SHAPES[k], a.layers) for k in todo))
    for key in a.models:
        path = out / file_name(key, a.layers)
        if key in todo:
            write_dense_gguf(key, path, a.layers, a.seed)
        print(f"{path}: {path.stat().st_size / 1e9:.2f} GB; "
              f"{value_stats(path, rows=16)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
