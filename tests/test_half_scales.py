"""Codes whose scales and minima are held as float16: exactly where they are float16 values
(a GGUF's plain types always, a K-quant only when every product of its float16 and its
small integers is one), dequantizing bit for bit as ``gguf`` does, multiplied by the
``_h16`` kernels (``kernels/linear_h16.c``) as the float32 form is, and by torch without
kernels; the portable build (no AVX2, no F16C) gives the same values."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from conftest import portable_kernels
from test_gguf_codes import random_blocks

from flexgen_infinigen.kernels import cpu_kernels, layers as cpu_layers
from flexgen_infinigen.memory.codes import Packed, PackedWeight, decompress
from flexgen_infinigen.weights import gguf_codes

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

PLAIN = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]
# where a K-quant keeps its float16 super-scales (bytes of a block)
SUPER = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def half_packed(raw, kind, shape) -> Packed:
    parts = gguf_codes.to_parts(raw, kind, shape, half=True)
    return Packed(*(torch.from_numpy(np.array(p)) for p in parts), shape)


def exact_k_blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random K-quant blocks whose super-scales are powers of two: each product with a
    6- or 8-bit integer is then a float16 exactly."""
    raw = random_blocks(kind, rows, cols, seed).reshape(rows, cols // 256, -1)
    rng = np.random.default_rng(seed)
    for at in SUPER[kind]:
        f = np.ldexp(1.0, rng.integers(-14, -6, raw.shape[:2])).astype(np.float16)
        raw[..., at:at + 2] = f.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", PLAIN + K_QUANTS)
def test_half_form_dequantizes_as_gguf(kind):
    """Plain types are always float16-exact; K-quants with random super-scales are not (they
    stay float32, and asking for float16 is an error), with power-of-two super-scales they
    are. Wherever the float16 form is taken, its values equal ``gguf``'s, bit for bit."""
    shape = (6, 512)
    raw = random_blocks(kind, *shape, seed=7)
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in K_QUANTS:
        assert not gguf_codes.half_exact(raw, kind, shape)
        with pytest.raises(ValueError, match="float16"):
            gguf_codes.to_parts(raw, kind, shape, half=True)
        raw = exact_k_blocks(kind, *shape, seed=7)
    assert gguf_codes.half_exact(raw, kind, shape)
    p = half_packed(raw, kind, shape)
    assert p.scale.dtype == p.minimum.dtype == torch.float16
    ref = dequantize(raw, qtype).reshape(shape)
    assert np.array_equal(decompress(p, torch.float32).numpy(), ref)
    w = PackedWeight(p, torch.float32)
    assert w.dtype == torch.float32 and torch.equal(w.dense(), torch.from_numpy(ref))
    ids = torch.tensor([[4, 1], [1, 0]])
    assert torch.equal(w.rows(ids), torch.from_numpy(ref)[ids])


def test_q4_0_overflowing_minimum_stays_float32():
    """Q4_0's minimum is -8 d: past float16's range for a huge d, so that tensor keeps
    float32 factors."""
    shape = (2, 64)
    raw = random_blocks("Q4_0", *shape, seed=3)
    assert gguf_codes.half_exact(raw, "Q4_0", shape)
    blocks = raw.reshape(2, 2, 18)
    blocks[1, 1, 0:2] = np.array([16384.0], np.float16).view(np.uint8)
    assert not gguf_codes.half_exact(raw, "Q4_0", shape)


def _weights(kind, shape, seed):
    """The same codes with float16 and with float32 factors (the float32 ones widened from
    the float16: the same values)."""
    raw = (exact_k_blocks(kind, *shape, seed) if kind in K_QUANTS
           else random_blocks(kind, *shape, seed=seed, scale=0.01))
    half = half_packed(raw, kind, shape)
    wide = Packed(half.codes, half.scale.float(), half.minimum.float(), shape)
    return PackedWeight(half, torch.float32), PackedWeight(wide)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K", "Q5_1"])
@pytest.mark.parametrize("rows", [1, 3, 9, 16])
@pytest.mark.parametrize("width", [1280, 576, 64])
def test_h16_kernels_match_float32_factors(kind, rows, width):
    """``linear`` on float16 factors (the ``_h16`` kernels) gives what the float32 kernels
    give on the same values, to float rounding, and what ``F.linear`` gives on the expanded
    weights (4 bits within 1e-3 of the largest output: x rounded to 16 bits; 8 bits to
    float rounding). K = 1280
    leaves a partial block of eight 32-value groups; 576 (18 groups of 32) ends a row's
    minima with a part of eight (read in registers), 64 has fewer than eight in all."""
    if kind in ("Q4_K", "Q6_K") and width != 1280:
        pytest.skip("K-quants come in 256-value blocks")
    shape = (37, width) if kind in ("Q4_0", "Q4_1", "Q8_0", "Q5_1") else (37, 1024)
    half, wide = _weights(kind, shape, seed=rows)
    assert half.kernel_ready and wide.kernel_ready
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, shape[1], generator=gen)
    b = torch.randn(shape[0], generator=gen)
    ours = cpu_layers.linear_q4(x, half, b)
    theirs = cpu_layers.linear_q4(x, wide, b)
    if ours is None or theirs is None:
        pytest.skip("no kernel for these codes here")
    ref = torch.nn.functional.linear(x.double(), wide.dense().double(), b.double())
    assert (ours - theirs).abs().max() <= 1e-6 * theirs.abs().max()
    tol = 1e-3 if half.packed.bits == 4 else 1e-5
    assert (ours.double() - ref).abs().max() <= tol * ref.abs().max()


def test_torch_fallback_without_kernels(monkeypatch):
    """Without the compiled kernels a float16-factor weight goes through torch: the same
    product as on its expanded float32 weight."""
    monkeypatch.setattr(cpu_kernels, "_tried", True)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    half, wide = _weights("Q4_1", (24, 512), seed=5)
    x = torch.randn(2, 512)
    out = cpu_layers.linear(x, half)
    assert out.dtype == torch.float32
    assert torch.allclose(out, torch.nn.functional.linear(x, wide.dense()), atol=1e-5)


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """``linear_h16.c`` built for a plain x86-64 (no AVX2, no F16C): the portable paths."""
    lib = portable_kernels(tmp_path_factory, "linear_h16.c")
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in ("linear_q4_h16", "linear_q8_h16"):
        getattr(lib, name).argtypes = [ptr] * 6 + [i64] * 5
        getattr(lib, name).restype = ctypes.c_int
    lib.h16_widen_rows.argtypes = [ptr, ptr, i64]
    return lib


def test_portable_half_conversion(portable):
    """Every float16 bit pattern widens to numpy's float32 of it (NaNs stay NaN)."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(bits.size, np.float32)
    portable.h16_widen_rows(bits.ctypes.data, out.ctypes.data, bits.size)
    ref = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), ref[~nan].view(np.uint32))


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q8_0", "Q6_K"])
def test_portable_kernels(portable, kind):
    """The portable kernels (plain float loops) against ``F.linear`` on the expanded
    weights, to float rounding."""
    shape = (21, 1024)
    half, wide = _weights(kind, shape, seed=11)
    p = half.packed
    x = torch.randn(3, shape[1])
    b = torch.randn(shape[0])
    out = torch.empty(3, shape[0])
    kernel = portable.linear_q8_h16 if p.bits == 8 else portable.linear_q4_h16
    assert kernel(x.data_ptr(), p.codes.data_ptr(), p.scale.data_ptr(), p.minimum.data_ptr(),
                  b.data_ptr(), out.data_ptr(), 3, shape[0], shape[1], p.group, 2)
    ref = torch.nn.functional.linear(x.double(), wide.dense().double(), b.double())
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
