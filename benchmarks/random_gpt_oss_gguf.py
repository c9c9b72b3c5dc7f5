"""A gpt-oss GGUF in real shapes with random codes, its experts MXFP4 as the published files
keep them, for timing our runtime and llama.cpp on the same file (nothing in it is trained).

    python benchmarks/random_gpt_oss_gguf.py --model gpt-oss-20b --out /data/gguf
    python benchmarks/random_gpt_oss_gguf.py --model gpt-oss-20b --layers 4 --out /tmp/g

Tensors as llama.cpp's converter writes a gpt-oss: the routed experts as fused
``ffn_{gate,up,down}_exps`` (``[experts, out, in]``) in MXFP4 with float32 biases
``[experts, out]``; the attention's matrices, the embedding and the head in Q8_0 (the
published MXFP4 files' 12-13 GB); norms, q/k/v/o biases, the sinks and the router (weight
and bias) float32. Random codes hold values of std ~0.02 (MXFP4: every block's exponent 2^-7,
uniform codes; Q8_0: a fixed scale, uniform codes); norms are ones, biases and sinks small.
A cut (``--layers N``) keeps the first N layers and everything else. The vocabulary is
placeholder tokens of the model's size (llama.cpp needs one; the benchmark feeds random ids).

Written one tensor at a time as ``FILE.part``, renamed when complete.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import zlib
from pathlib import Path

import numpy as np

from random_kquant_gguf import add_placeholder_vocab, write_plan

DESCRIPTION = ("random codes, MXFP4 experts and Q8_0 matrices (benchmarks/random_gpt_oss_gguf.py):"
               " nothing in it is a trained value")
STD = 0.02
BLOCK = {"MXFP4": (32, 17), "Q8_0": (32, 34)}  # values and bytes a block
MXFP4_E = 121  # 2^(e - 128) = 2^-7: codes' values (up to 12) times it have std ~0.02


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    experts: int
    hidden: int = 2880
    width: int = 2880  # each expert's
    heads: int = 64
    kv_heads: int = 8
    head_dim: int = 64
    vocab: int = 201088
    top_k: int = 4
    window: int = 128
    context: int = 131072


SHAPES = {"gpt-oss-20b": Shape("gpt-oss-20b", 24, 32),
          "gpt-oss-120b": Shape("gpt-oss-120b", 36, 128)}


def tensor_plan(s: Shape, layers: int | None = None) -> list[tuple[str, tuple, str]]:
    """(GGUF name, numpy dims, type) of each tensor in file order."""
    h, q, kv, e, f = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.experts, s.width
    out = [("token_embd.weight", (s.vocab, h), "Q8_0")]
    for i in range(s.layers if layers is None else layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,), "F32"),
                (b + "attn_q.weight", (q, h), "Q8_0"), (b + "attn_q.bias", (q,), "F32"),
                (b + "attn_k.weight", (kv, h), "Q8_0"), (b + "attn_k.bias", (kv,), "F32"),
                (b + "attn_v.weight", (kv, h), "Q8_0"), (b + "attn_v.bias", (kv,), "F32"),
                (b + "attn_output.weight", (h, q), "Q8_0"),
                (b + "attn_output.bias", (h,), "F32"),
                (b + "attn_sinks.weight", (s.heads,), "F32"),
                (b + "post_attention_norm.weight", (h,), "F32"),
                (b + "ffn_gate_inp.weight", (e, h), "F32"), (b + "ffn_gate_inp.bias", (e,), "F32"),
                (b + "ffn_gate_exps.weight", (e, f, h), "MXFP4"),
                (b + "ffn_gate_exps.bias", (e, f), "F32"),
                (b + "ffn_up_exps.weight", (e, f, h), "MXFP4"),
                (b + "ffn_up_exps.bias", (e, f), "F32"),
                (b + "ffn_down_exps.weight", (e, h, f), "MXFP4"),
                (b + "ffn_down_exps.bias", (e, h), "F32")]
    return out + [("output_norm.weight", (h,), "F32"), ("output.weight", (s.vocab, h), "Q8_0")]


def tensor_bytes(dims: tuple, kind: str) -> int:
    if kind == "F32":
        return 4 * int(np.prod(dims))
    per, size = BLOCK[kind]
    return int(np.prod(dims[:-1])) * dims[-1] // per * size


def file_bytes(s: Shape, layers: int | None = None) -> int:
    return sum(tensor_bytes(d, k) for _, d, k in tensor_plan(s, layers))


def tensor_data(name: str, dims: tuple, kind: str, seed: int) -> np.ndarray:
    """One tensor's bytes from a generator of its own (seed and name): a cut's tensors are
    the whole model's, byte for byte."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if kind == "F32":
        if name.endswith("norm.weight"):
            return np.ones(dims, np.float32)
        scale = STD if name.endswith(("ffn_gate_inp.weight",)) else STD / 4
        return (rng.standard_normal(dims, dtype=np.float32) * scale).astype(np.float32)
    per, size = BLOCK[kind]
    rows = int(np.prod(dims[:-1]))
    blocks = rng.integers(0, 256, (rows, dims[-1] // per, size), dtype=np.uint8)
    if kind == "MXFP4":
        blocks[..., 0] = MXFP4_E
    else:  # Q8_0: uniform codes (std ~74) times a float16 d
        blocks[..., 0:2] = np.frombuffer(np.float16(STD / 74).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def file_name(key: str, layers: int | None = None) -> str:
    s = SHAPES[key]
    cut = "" if layers is None or layers == s.layers else f"-{layers}-of-{s.layers}L"
    return f"{s.name}{cut}-MXFP4-random.gguf"


def describe(key: str, layers: int | None = None) -> dict:
    """What the file holds, and the bytes one decode step at batch 1 must read: every tensor
    but the embedding (only looked up) and the routed experts, plus ``top_k`` experts of each
    layer (their three matrices and biases)."""
    s = SHAPES[key]
    n = s.layers if layers is None else layers
    plan = tensor_plan(s, n)
    by_type: dict[str, int] = {}
    experts = 0
    for name, dims, kind in plan:
        size = tensor_bytes(dims, kind)
        by_type[kind] = by_type.get(kind, 0) + size
        if "_exps." in name:
            experts += size
    embd = tensor_bytes((s.vocab, s.hidden), "Q8_0")
    total = sum(by_type.values())
    return {"model": s.name, "layers": n, "model_layers": s.layers, "experts": s.experts,
            "top_k": s.top_k, "tensor_bytes": total, "tensor_bytes_by_type": by_type,
            "expert_bytes": experts,
            "decode_read_bytes_batch_1": total - embd - experts + experts * s.top_k // s.experts}


def decode_read_bytes(key: str, layers: int, batch: int) -> float:
    """The weight bytes a decode step of ``batch`` rows reads: every tensor but the embedding
    (only looked up) and, of each layer's experts, the expected number the rows route to
    (E (1 - (1 - k/E)^B), routes drawn uniformly)."""
    s, d = SHAPES[key], describe(key, layers)
    used = s.experts * (1 - (1 - s.top_k / s.experts) ** batch)
    return d["decode_read_bytes_batch_1"] + d["expert_bytes"] * (used - s.top_k) / s.experts


def kv_read_bytes(key: str, layers: int, context: float) -> float:
    """f16 K and V rows a row reads: ``context`` tokens in the full-attention layers, the
    window's in the windowed ones (every other layer, the first one windowed)."""
    s = SHAPES[key]
    windowed = (layers + 1) // 2
    tokens = (layers - windowed) * context + windowed * min(context, s.window)
    return 2 * s.kv_heads * s.head_dim * 2 * tokens


def write_gguf(key: str, path, layers: int | None = None) -> dict:
    """The file (the interface ``gguf_sizes.files_of`` names)."""
    return write_gpt_oss_gguf(key, path, layers)


def write_gpt_oss_gguf(key: str, path: str | Path, layers: int | None = None, seed: int = 0,
                       progress: bool = True) -> dict:
    s = SHAPES[key]
    n = s.layers if layers is None else layers
    if not 1 <= n <= s.layers:
        raise ValueError(f"--layers {layers}: {s.name} has 1..{s.layers} layers")
    write_plan(path, "gpt-oss", tensor_plan(s, n), lambda w: _metadata(w, s, n), tensor_bytes,
               lambda name, dims, kind: tensor_data(name, dims, kind, seed), progress)
    return describe(key, n)


def _metadata(w, s: Shape, layers: int) -> None:
    import gguf

    w.add_name(s.name + " (random codes)")
    w.add_description(DESCRIPTION)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(s.width)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(150000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_sliding_window(s.window)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_expert_feed_forward_length(s.width)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    add_placeholder_vocab(w, s.vocab)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-oss-20b", choices=list(SHAPES))
    p.add_argument("--out", required=True, help="the folder the file goes to")
    p.add_argument("--layers", type=int, default=None, help="the first N layers only")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / file_name(a.model, a.layers)
    if path.exists():
        print(f"{path} exists; kept")
        return 0
    print(write_gpt_oss_gguf(a.model, path, a.layers, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
