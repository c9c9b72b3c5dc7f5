"""A GGUF file in a mixture-of-experts model's shapes with random Q4_0 codes, for timing
llama.cpp on the same shapes as our dummy weights (nothing in it is a trained value).

    write_random_gguf(cfg, "/tmp/qwen3-moe-4L.gguf")

Written with the ``gguf`` package's writer: ``qwen3moe`` for a Qwen3-MoE config (per-head
q/k norms), ``olmoe`` for OLMoE (q/k norms over all heads), each routed expert matrix as
the fused 3-D ``ffn_{gate,up,down}_exps`` tensors llama.cpp reads. Matrices are Q4_0
(blocks of 32 codes and one float16 scale, the scale fixed small so activations stay
finite); norms and the router are float32. The vocabulary is placeholder tokens of the
config's size (llama.cpp needs one; llama-bench feeds random token ids).
"""
from __future__ import annotations

import os

import numpy as np

Q4_0_BLOCK, Q4_0_BYTES = 32, 18  # values per block; bytes per block (float16 scale + 16)


def _q4_0(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Random Q4_0 bytes of a tensor of ``shape`` (row-major, last axis the rows' values)."""
    *outer, cols = shape
    blocks = rng.integers(0, 256, size=(*outer, cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return blocks.reshape(*outer, cols // Q4_0_BLOCK * Q4_0_BYTES)


def tensor_shapes(cfg) -> dict[str, tuple[tuple[int, ...], bool]]:
    """GGUF tensor name -> (numpy shape, Q4_0 or float32) for ``cfg``'s layers."""
    h, qd, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    e, f = cfg.num_experts, cfg.expert_intermediate_size
    out = {"token_embd.weight": ((cfg.vocab_size, h), True),
           "output_norm.weight": ((h,), False), "output.weight": ((cfg.vocab_size, h), True)}
    norm_q, norm_k = (qd, kv) if cfg.qk_norm_full else (cfg.head_dim, cfg.head_dim)
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": ((h,), False), b + "attn_q.weight": ((qd, h), True),
                    b + "attn_k.weight": ((kv, h), True), b + "attn_v.weight": ((kv, h), True),
                    b + "attn_output.weight": ((h, qd), True),
                    b + "attn_q_norm.weight": ((norm_q,), False),
                    b + "attn_k_norm.weight": ((norm_k,), False),
                    b + "ffn_norm.weight": ((h,), False),
                    b + "ffn_gate_inp.weight": ((e, h), False),
                    b + "ffn_gate_exps.weight": ((e, f, h), True),
                    b + "ffn_up_exps.weight": ((e, f, h), True),
                    b + "ffn_down_exps.weight": ((e, h, f), True)})
    return out


def _tensors(shapes: dict, seed: int, infos_only: bool = False):
    """(name, array) in file order; with ``infos_only`` each array is an empty stand-in of the
    right shape and dtype (its bytes are not drawn)."""
    rng = np.random.default_rng(seed)
    for name, (shape, quant) in shapes.items():
        if quant:
            *outer, cols = shape
            if infos_only:
                yield name, np.empty((*outer, cols // Q4_0_BLOCK * Q4_0_BYTES), np.uint8)
            else:
                yield name, _q4_0(rng, shape, 0.02 / 8)
        elif infos_only:
            yield name, np.empty(shape, np.float32)
        else:
            yield name, (np.ones(shape, np.float32) if len(shape) == 1
                         else rng.standard_normal(shape, dtype=np.float32))


def write_random_gguf(cfg, path: str, seed: int = 0) -> int:
    """Write the file; returns the bytes of its tensors."""
    import gguf

    arch = "olmoe" if cfg.qk_norm_full else "qwen3moe"
    part = path + ".part"  # renamed when complete: a stopped write never looks like a file
    w = gguf.GGUFWriter(part, arch)
    w.add_name(cfg.name)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_positions)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.experts_per_token)
    w.add_expert_feed_forward_length(cfg.expert_intermediate_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    special = ["<unk>", "<s>", "</s>"]
    tokens = special + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"t{i}" for i in range(cfg.vocab_size - len(tokens))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] \
        + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (len(tokens) - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    # the tensors' infos first, then their data drawn one tensor at a time: a whole model's
    # file (~17 GB for Qwen3-30B-A3B) is never in memory
    shapes = tensor_shapes(cfg)
    for name, data in _tensors(shapes, seed, infos_only=True):
        quant = shapes[name][1]
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes,
                          raw_dtype=gguf.GGMLQuantizationType.Q4_0 if quant else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = 0
    for _, data in _tensors(shapes, seed):
        w.write_tensor_data(data)
        total += data.nbytes
    w.close()
    os.replace(part, path)
    return total
