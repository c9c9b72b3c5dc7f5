"""A Qwen3.5-MoE GGUF (``qwen35moe``) in real shapes with random codes, for timing our runtime
and llama.cpp on the same file (nothing in it is trained).

    python benchmarks/random_qwen35_gguf.py --layers 4 --out /tmp/g

Qwen3.5-35B-A3B's shapes (its published config: 40 layers of which every fourth is gated
attention, the rest Gated DeltaNet; 256 routed experts of 512, 8 a token, one gated shared
expert), tensors named and laid out as llama.cpp's converter writes them: the matrices Q4_K
(the head Q6_K), the router, the convolution, the decay rates, step biases and norms
float32. Random codes hold values of std ~0.02; norms are ones, the decay rates
``-exp(A_log)`` drawn in [-2, -0.5], so that the recurrence decays as a trained one does. A
cut (``--layers N``) keeps the first N layers (its attention layers where they fall: one in
four) and everything else. The vocabulary is placeholder tokens.

Written one tensor at a time as ``FILE.part``, renamed when complete.
"""
from __future__ import annotations

import argparse
import dataclasses
import zlib
from pathlib import Path

import numpy as np

from kquant_blocks import Q4_K_BYTES, Q6_K_BYTES, QK, STD, random_blocks
from random_kquant_gguf import add_placeholder_vocab, write_plan

DESCRIPTION = ("random codes in Qwen3.5-35B-A3B's shapes (benchmarks/random_qwen35_gguf.py): "
               "nothing in it is a trained value")


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str = "Qwen3.5-35B-A3B"
    layers: int = 40
    hidden: int = 2048
    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 256
    key_heads: int = 16  # the DeltaNet's
    value_heads: int = 32
    key_dim: int = 128
    value_dim: int = 128
    conv: int = 4
    experts: int = 256
    top_k: int = 8
    width: int = 512  # each expert's, and the shared expert's
    vocab: int = 248320
    context: int = 262144
    every: int = 4  # one full-attention layer in so many

    def is_attention(self, layer: int) -> bool:
        return (layer + 1) % self.every == 0


SHAPES = {"qwen3.5-35b-a3b": Shape()}


def tensor_plan(s: Shape, layers: int | None = None) -> list[tuple[str, tuple, str]]:
    """(GGUF name, numpy dims, type) of each tensor in file order."""
    h, e, f = s.hidden, s.experts, s.width
    kd, vd = s.key_heads * s.key_dim, s.value_heads * s.value_dim
    out = [("token_embd.weight", (s.vocab, h), "Q4_K")]
    for i in range(s.layers if layers is None else layers):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (h,), "F32"))
        if s.is_attention(i):
            q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
            out += [(b + "attn_q.weight", (2 * q, h), "Q4_K"),  # each head's query, then gate
                    (b + "attn_k.weight", (kv, h), "Q4_K"), (b + "attn_v.weight", (kv, h), "Q4_K"),
                    (b + "attn_output.weight", (h, q), "Q4_K"),
                    (b + "attn_q_norm.weight", (s.head_dim,), "F32"),
                    (b + "attn_k_norm.weight", (s.head_dim,), "F32")]
        else:
            out += [(b + "attn_qkv.weight", (2 * kd + vd, h), "Q4_K"),
                    (b + "attn_gate.weight", (vd, h), "Q4_K"),
                    (b + "ssm_beta.weight", (s.value_heads, h), "Q4_K"),
                    (b + "ssm_alpha.weight", (s.value_heads, h), "Q4_K"),
                    (b + "ssm_conv1d.weight", (2 * kd + vd, s.conv), "F32"),
                    (b + "ssm_a", (s.value_heads,), "F32"),
                    (b + "ssm_dt.bias", (s.value_heads,), "F32"),
                    (b + "ssm_norm.weight", (s.value_dim,), "F32"),
                    (b + "ssm_out.weight", (h, vd), "Q4_K")]
        out += [(b + "post_attention_norm.weight", (h,), "F32"),
                (b + "ffn_gate_inp.weight", (e, h), "F32"),
                (b + "ffn_gate_exps.weight", (e, f, h), "Q4_K"),
                (b + "ffn_up_exps.weight", (e, f, h), "Q4_K"),
                (b + "ffn_down_exps.weight", (e, h, f), "Q4_K"),
                (b + "ffn_gate_inp_shexp.weight", (h,), "F32"),
                (b + "ffn_gate_shexp.weight", (f, h), "Q4_K"),
                (b + "ffn_up_shexp.weight", (f, h), "Q4_K"),
                (b + "ffn_down_shexp.weight", (h, f), "Q4_K")]
    return out + [("output_norm.weight", (h,), "F32"), ("output.weight", (s.vocab, h), "Q6_K")]


def tensor_bytes(dims: tuple, kind: str) -> int:
    if kind == "F32":
        return 4 * int(np.prod(dims))
    return int(np.prod(dims)) // QK * (Q4_K_BYTES if kind == "Q4_K" else Q6_K_BYTES)


def tensor_data(name: str, dims: tuple, kind: str, seed: int) -> np.ndarray:
    """One tensor's bytes from a generator of its own (seed and name): a cut's tensors are
    the whole model's, byte for byte."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if kind != "F32":
        rows = int(np.prod(dims[:-1]))
        return random_blocks(rng, (rows, dims[-1]), kind)
    if name.endswith("norm.weight"):
        return np.ones(dims, np.float32)
    if name.endswith("ssm_a"):
        return -rng.uniform(0.5, 2.0, dims).astype(np.float32)
    return (rng.standard_normal(dims, dtype=np.float32) * STD).astype(np.float32)


def file_name(key: str, layers: int | None = None) -> str:
    s = SHAPES[key]
    cut = "" if layers is None or layers == s.layers else f"-{layers}-of-{s.layers}L"
    return f"{s.name}{cut}-Q4_K-random.gguf"


def describe(key: str, layers: int | None = None) -> dict:
    """What the file holds, and the weight bytes one decode step at batch 1 must read: every
    tensor but the embedding (only looked up) and the routed experts, plus ``top_k`` experts
    of each layer."""
    s = SHAPES[key]
    n = s.layers if layers is None else layers
    plan = tensor_plan(s, n)
    total = sum(tensor_bytes(d, k) for _, d, k in plan)
    experts = sum(tensor_bytes(d, k) for name, d, k in plan if "_exps." in name)
    embd = tensor_bytes((s.vocab, s.hidden), "Q4_K")
    return {"model": s.name, "layers": n, "model_layers": s.layers,
            "attention_layers": sum(s.is_attention(i) for i in range(n)),
            "tensor_bytes": total, "expert_bytes": experts,
            "decode_read_bytes_batch_1": total - embd - experts + experts * s.top_k // s.experts}


def state_read_bytes(key: str, layers: int, context: float) -> float:
    """The cache a decode step reads and writes for one row: each attention layer's f16 K and
    V rows of ``context`` tokens, and each DeltaNet layer's float32 state (its matrices and
    the convolution's last inputs), read and written back."""
    s = SHAPES[key]
    attention = sum(s.is_attention(i) for i in range(layers))
    kv = 2 * s.kv_heads * s.head_dim * 2 * context * attention
    channels = 2 * s.key_heads * s.key_dim + s.value_heads * s.value_dim
    state = 4 * (s.value_heads * s.key_dim * s.value_dim + channels * (s.conv - 1))
    return kv + 2 * state * (layers - attention)


def write_gguf(key: str, path: str | Path, layers: int | None = None, seed: int = 0,
               progress: bool = True) -> dict:
    s = SHAPES[key]
    n = s.layers if layers is None else layers
    if not 1 <= n <= s.layers:
        raise ValueError(f"--layers {layers}: {s.name} has 1..{s.layers} layers")
    write_plan(path, "qwen35moe", tensor_plan(s, n), lambda w: _metadata(w, s, n), tensor_bytes,
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
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim // 4)
    # Qwen3.5's multimodal RoPE sections; a text token has one position in all of them
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_rope_freq_base(10_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_expert_feed_forward_length(s.width)
    w.add_expert_shared_feed_forward_length(s.width)
    w.add_ssm_conv_kernel(s.conv)
    w.add_ssm_state_size(s.key_dim)
    w.add_ssm_group_count(s.key_heads)
    w.add_ssm_time_step_rank(s.value_heads)
    w.add_ssm_inner_size(s.value_heads * s.value_dim)
    w.add_full_attention_interval(s.every)
    add_placeholder_vocab(w, s.vocab)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.5-35b-a3b", choices=list(SHAPES))
    p.add_argument("--out", required=True, help="the folder the file goes to")
    p.add_argument("--layers", type=int, default=None, help="the first N layers only")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / file_name(a.model, a.layers)
    info = write_gguf(a.model, path, a.layers, a.seed)
    print(f"{path}: {info['tensor_bytes'] / 1e9:.2f} GB of tensors")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
