"""The GGUF block kernels (kernels/c/gguf_dot.c through kernels/gguf.py) against the format's
reference: ``gguf.quants.dequantize`` followed by a float64 matrix product. Random blocks of
every kept type (random codes, scales set to sane values); x quantized to 8 bits per block as
the kernel does, so the products agree to float rounding, and within the rounding of 8-bit
activations against x itself."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flexgen_infinigen.kernels.cpu_kernels import library
from flexgen_infinigen.memory.codes import BLOCK_FORMS, Blocks, PackedWeight

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(library() is None, reason="no C compiler for the kernels")

from flexgen_infinigen.kernels import gguf as kernels  # noqa: E402
from flexgen_infinigen.kernels.layers import linear  # noqa: E402

# (byte offset, typical value) of each float16 factor in a block: d, and m or dmin
FACTORS = {"Q4_0": [(0, .01)], "Q4_1": [(0, .01), (2, -.05)], "Q5_0": [(0, .01)],
           "Q5_1": [(0, .01), (2, -.05)], "Q8_0": [(0, .001)], "Q4_K": [(0, .001), (2, .002)],
           "Q5_K": [(0, .001), (2, .002)], "Q6_K": [(208, .001)], "MXFP4": []}
# MXFP4's exponent byte (block byte 0): 2^(e - 128) for e in this range, weights' sizes
MXFP4_E = (118, 131)


def random_blocks(kind: str, n: int, k: int, rng) -> np.ndarray:
    size, per = BLOCK_FORMS[kind]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at, v in FACTORS[kind]:
        vals = ((rng.random((n, k // per)) * 0.5 + 0.75) * v).astype(np.float16)
        raw[..., at:at + 2] = vals[..., None].view(np.uint8)
    if kind == "MXFP4":
        raw[..., 0] = rng.integers(*MXFP4_E, (n, k // per))
    return np.ascontiguousarray(raw.reshape(n, -1))


def reference(raw: np.ndarray, kind: str, shape) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(shape)


def quantized(x: np.ndarray, per: int) -> np.ndarray:
    """x as the kernel sees it: per block of ``per`` values, d = max|x| / 127, codes rounded."""
    b = x.reshape(x.shape[0], -1, per)
    amax = np.abs(b).max(-1, keepdims=True)
    q = np.round(b * np.where(amax > 0, 127 / np.where(amax > 0, amax, 1), 0))
    return (q * amax / 127).reshape(x.shape)


@pytest.mark.parametrize("kind", sorted(BLOCK_FORMS))
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_products_match_the_dequantized_reference(kind, rows):
    rng = np.random.default_rng(rows)
    n, k = 37, 512
    raw = random_blocks(kind, n, k, rng)
    order = torch.from_numpy(rng.permutation(n).astype(np.int32))
    w = PackedWeight(Blocks(torch.from_numpy(raw), kind, (n, k), order))
    x = rng.standard_normal((rows, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    out = kernels.linear_blocks(torch.from_numpy(x), w, torch.from_numpy(bias))
    assert out is not None and out.shape == (rows, n)
    dense = reference(raw, kind, (n, k)).astype(np.float64)[order.numpy()]
    exact = quantized(x.astype(np.float64), BLOCK_FORMS[kind][1]) @ dense.T + bias
    scale = np.abs(exact).max()
    assert np.abs(out.numpy() - exact).max() <= 1e-5 * scale
    # against x itself: within the rounding of 8-bit activations (a few parts in a thousand)
    floats = x.astype(np.float64) @ dense.T + bias
    assert np.abs(out.numpy() - floats).max() <= 3e-2 * np.abs(floats).max()
    # the layer's entry point takes the same path, whatever the rows' leading shape
    again = linear(torch.from_numpy(x).view(1, rows, k), w, torch.from_numpy(bias))
    assert torch.equal(again.view(rows, n), out)


@pytest.mark.parametrize("kind", sorted(BLOCK_FORMS))
def test_rows_expand_exactly_as_the_format_defines(kind):
    rng = np.random.default_rng(1)
    n, k = 9, 512
    raw = random_blocks(kind, n, k, rng)
    blocks = Blocks(torch.from_numpy(raw), kind, (n, k))
    ids = torch.tensor([[4, 0], [8, 4]])
    got = kernels.dequantize_rows(blocks, ids)
    want = reference(raw, kind, (n, k))[ids.numpy()]
    assert got.shape == (2, 2, k) and np.array_equal(got.numpy(), want)
    # the memory layer's own expansion (gguf's reference) gives the same rows
    assert torch.equal(PackedWeight(blocks).rows(ids), got)


def test_an_input_the_kernels_do_not_take_falls_back_to_floats():
    """A float64 input: the block kernel declines, and the layer multiplies the expanded
    weight (gguf's reference values) in torch."""
    rng = np.random.default_rng(2)
    raw = random_blocks("Q8_0", 4, 64, rng)
    w = PackedWeight(Blocks(torch.from_numpy(raw), "Q8_0", (4, 64)))
    x = torch.randn(2, 64, dtype=torch.float64)
    assert kernels.linear_blocks(x, w) is None
    dense = torch.from_numpy(reference(raw, "Q8_0", (4, 64)).astype(np.float64))
    assert torch.allclose(linear(x, w), x @ dense.T, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q5_0", "Q8_0", "MXFP4"])
def test_a_row_gives_the_same_floats_alone_and_in_any_batch(kind):
    """Each row's sums sit in the same lanes whatever the tile's row count (1-8, a chunk's
    last rows): a request's output does not depend on its neighbours in a batch."""
    rng = np.random.default_rng(3)
    n, k = 11, 768
    w = PackedWeight(Blocks(torch.from_numpy(random_blocks(kind, n, k, rng)), kind, (n, k)))
    x = torch.from_numpy(rng.standard_normal((19, k)).astype(np.float32))
    batch = kernels.linear_blocks(x, w)
    for lo, hi in ((0, 1), (5, 6), (18, 19), (3, 7), (0, 9)):
        assert torch.equal(kernels.linear_blocks(x[lo:hi], w), batch[lo:hi]), (lo, hi)


@pytest.mark.parametrize("march", [None, "haswell"])
def test_every_instruction_set_gives_the_reference(tmp_path_factory, march):
    """gguf_dot.c built without AVX (the portable loops) and for AVX2 alone (its tiles, as a
    CPU without AVX-512 runs them): every type's product equals the reference, as the
    machine's own build does above."""
    import ctypes

    from conftest import portable_kernels

    lib = portable_kernels(tmp_path_factory, "gguf_dot.c", march)
    rng = np.random.default_rng(4)
    n, k = 13, 512
    for kind in sorted(BLOCK_FORMS):
        raw = random_blocks(kind, n, k, rng)
        dense = reference(raw, kind, (n, k)).astype(np.float64)
        for rows in (1, 6):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            out = np.zeros((rows, n), np.float32)
            c = ctypes.c_void_p
            ok = lib.gguf_linear(ctypes.c_int64(kernels.TYPE_IDS[kind]), c(raw.ctypes.data),
                                 None, c(x.ctypes.data), None, c(out.ctypes.data),
                                 *(ctypes.c_int64(v) for v in (rows, n, k, 2)))
            assert ok == 1, kind
            exact = quantized(x.astype(np.float64), BLOCK_FORMS[kind][1]) @ dense.T
            assert np.abs(out - exact).max() <= 1e-5 * np.abs(exact).max(), (kind, rows)

