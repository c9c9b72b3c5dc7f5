"""The random Q4_K_M GGUF writer (benchmarks/random_kquant_gguf.py): its blocks read back
through ``gguf.quants`` (the reference reader) as the values the codes and scales give by
the formats' formulas, and a tiny model's file holds llama.cpp's Q4_K_M mix, its metadata
and sane values; a cut is the whole file's first layers byte for byte."""
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kquant_blocks as kb  # noqa: E402
import random_kquant_gguf as rk  # noqa: E402

T = gguf.GGMLQuantizationType
# qwen2 shapes small enough to write in a moment; 8 layers: Q6_K on 0, 3, 6, 7
TINY = rk.Dense("Tiny", "qwen2", 256, 512, 8, 2, 1, 600, 1e6, 1e-6, 4096)


def test_q4_k_blocks_read_back_as_d_sc_q_minus_dmin_m():
    rng = np.random.default_rng(1)
    n = 40
    codes = rng.integers(0, 16, (n, 256))
    sc, mn = rng.integers(0, 64, (n, 8)), rng.integers(0, 64, (n, 8))
    d = rng.uniform(1e-3, 2e-3, n).astype(np.float16)
    dmin = rng.uniform(1e-3, 2e-3, n).astype(np.float16)
    blocks = kb.pack_q4_k(d, dmin, sc, mn, kb.q4_k_code_bytes(codes))
    assert blocks.shape == (n, 144)
    want = (d.astype(np.float32)[:, None, None] * sc[:, :, None] * codes.reshape(n, 8, 32)
            - dmin.astype(np.float32)[:, None, None] * mn[:, :, None]).reshape(n, 256)
    np.testing.assert_allclose(dequantize(blocks, T.Q4_K).reshape(n, 256), want, rtol=1e-6,
                               atol=1e-9)


def test_q6_k_blocks_read_back_as_d_sc_q_minus_32():
    rng = np.random.default_rng(2)
    n = 40
    codes = rng.integers(0, 64, (n, 256))
    scales = rng.integers(-128, 128, (n, 16))
    d = rng.uniform(1e-4, 2e-4, n).astype(np.float16)
    blocks = kb.pack_q6_k(d, scales, *kb.q6_k_code_bytes(codes))
    assert blocks.shape == (n, 210)
    want = (d.astype(np.float32)[:, None, None] * scales[:, :, None]
            * (codes.reshape(n, 16, 16) - 32)).reshape(n, 256)
    np.testing.assert_allclose(dequantize(blocks, T.Q6_K).reshape(n, 256), want, rtol=1e-6,
                               atol=1e-9)


def test_q4_k_scales_past_six_bits_are_refused():
    with pytest.raises(ValueError, match="6 bits"):
        kb.pack_q4_k(np.ones(1, np.float16), np.ones(1, np.float16), np.full((1, 8), 64),
                     np.zeros((1, 8)), np.zeros((1, 128), np.uint8))


def test_llama_cpp_more_bits_layers():
    # llama.cpp's use_more_bits for 28 layers (Qwen2.5-7B): 0-2, every third from 5, 24-27
    assert [i for i in range(28) if rk.use_more_bits(i, 28)] == \
        [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(rk.SHAPES, "tiny", TINY)
    return "tiny"


def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def _field(reader, key):
    return reader.fields[key].contents()


def test_a_tiny_model_holds_the_q4_k_m_mix_and_sane_values(tiny, tmp_path):
    path = tmp_path / "tiny.gguf"
    info = rk.write_dense_gguf(tiny, path, progress=False)
    assert not list(tmp_path.glob("*.part"))
    reader = gguf.GGUFReader(str(path))
    assert _field(reader, "general.architecture") == "qwen2"
    assert _field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert _field(reader, "qwen2.block_count") == 8
    assert _field(reader, "qwen2.attention.head_count_kv") == 1
    assert _field(reader, "qwen2.rope.freq_base") == 1e6
    assert len(_field(reader, "tokenizer.ggml.tokens")) == 600
    tensors = {t.name: t for t in reader.tensors}
    more = [0, 3, 6, 7]
    assert info["q6_k_layers"] == more
    for i in range(8):
        for name in ("attn_v", "ffn_down"):
            kind = tensors[f"blk.{i}.{name}.weight"].tensor_type.name
            assert kind == ("Q6_K" if i in more else "Q4_K"), (i, name)
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert tensors[f"blk.{i}.{name}.weight"].tensor_type.name == "Q4_K"
        for name in ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_norm.weight",
                     "ffn_norm.weight"):
            assert tensors[f"blk.{i}.{name}"].tensor_type.name == "F32"
    assert tensors["token_embd.weight"].tensor_type.name == "Q4_K"
    assert tensors["output.weight"].tensor_type.name == "Q6_K"
    assert sum(int(t.n_bytes) for t in reader.tensors) == info["tensor_bytes"]
    assert info["decode_read_bytes"] == info["tensor_bytes"] - int(
        tensors["token_embd.weight"].n_bytes)
    for name in ("blk.1.ffn_up.weight", "blk.0.ffn_down.weight", "output.weight"):
        t = tensors[name]
        v = dequantize(np.asarray(t.data), t.tensor_type)
        assert v.shape == tuple(int(x) for x in reversed(t.shape))
        assert np.isfinite(v).all()
        assert abs(v.mean()) < 0.002 and 0.017 < v.std() < 0.023, (name, v.mean(), v.std())
    np.testing.assert_array_equal(np.asarray(tensors["blk.0.attn_norm.weight"].data), 1.0)


def test_a_cut_is_the_whole_files_first_layers(tiny, tmp_path):
    whole, cut = tmp_path / "whole.gguf", tmp_path / "cut.gguf"
    rk.write_dense_gguf(tiny, whole, progress=False)
    rk.write_dense_gguf(tiny, cut, layers=3, progress=False)
    a, b = _tensors(whole), _tensors(cut)
    assert gguf.GGUFReader(str(cut)).fields["qwen2.block_count"].contents() == 3
    assert set(b) == {n for n in a if not n.startswith("blk.") or int(n.split(".")[1]) < 3}
    for name, t in b.items():
        assert t.tensor_type == a[name].tensor_type, name
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(a[name].data))


def test_a_stopped_write_leaves_no_file(tiny, tmp_path, monkeypatch):
    real, calls = rk.tensor_data, []

    def failing(*args):
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(rk, "tensor_data", failing)
    with pytest.raises(KeyboardInterrupt):
        rk.write_dense_gguf(tiny, tmp_path / "tiny.gguf", progress=False)
    assert not list(tmp_path.iterdir())


def test_a_cut_past_the_model_is_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="1..8"):
        rk.write_dense_gguf(tiny, tmp_path / "x.gguf", layers=9, progress=False)
