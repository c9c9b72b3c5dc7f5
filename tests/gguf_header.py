"""The metadata llama.cpp's converter writes for a small transformers model, shared by the
tests that write GGUF files (float ones in test_gguf_families, quantized in test_gguf_codes)."""
from __future__ import annotations


def add_model_metadata(w, c, arch: str, vocab_model: str, extra_blocks: int = 0) -> None:
    """Shapes, norm and rotary settings of config ``c``, and a placeholder vocabulary (a score
    per token for SentencePiece ones), into ``gguf.GGUFWriter`` ``w``; ``extra_blocks``:
    blocks past the model's (GLM's multi-token-prediction layers, counted by llama.cpp)."""
    w.add_block_count(c.num_hidden_layers + extra_blocks)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if "rope_theta" in c.rope_parameters:  # one RoPE for every layer (a Gemma 3 adds its own)
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if arch in ("qwen3", "qwen3moe", "glm4moe"):  # its head size is not hidden / heads
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_tokenizer_model(vocab_model)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    if vocab_model == "llama":
        w.add_token_scores([-float(i) for i in range(c.vocab_size)])
