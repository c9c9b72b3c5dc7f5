"""K-quant blocks as llama.cpp lays them out, and random ones of a chosen spread, for
``random_kquant_gguf.py`` (``gguf.quants`` reads them back; tests/test_random_kquant_gguf.py).

- Q4_K, 256 values in 144 bytes: float16 ``d``, float16 ``dmin``, 12 bytes of eight 6-bit
  scales and eight 6-bit minima, 128 bytes of 4-bit codes; value ``d*sc*q - dmin*m``;
- Q6_K, 256 values in 210 bytes: 128 bytes of low nibbles ``ql``, 64 of high bit pairs
  ``qh``, 16 int8 scales, float16 ``d``; value ``d*sc*(q - 32)``.

Random blocks have uniform codes (random bytes are uniform nibbles and bit pairs) and values
of mean ~0 and std ``STD``: each sub-block's scale is random in 4..8 (Q4_K's minimum
``round(7.5 * sc)``, the codes' mean, with ``dmin = d``), each block's ``d`` random within
25% of the value that gives that std.
"""
from __future__ import annotations

import numpy as np

QK = 256  # values a K-quant super-block
Q4_K_BYTES, Q6_K_BYTES = 144, 210
STD = 0.02  # the values' standard deviation
CHUNK = 1 << 17  # blocks drawn at a time: a tensor's bytes plus ~30 MB of temporaries
# Q4_K: sub-block scales uniform on 4..8, codes uniform on 0..15 (variance 255/12)
_Q4_SC = np.arange(4, 9)
_Q4_D = STD / np.sqrt(np.mean(_Q4_SC.astype(float) ** 2) * 255 / 12)
# Q6_K: scales uniform on 4..8, codes - 32 uniform on -32..31 (mean square 4095/12 + 1/4)
_Q6_D = STD / np.sqrt(np.mean(_Q4_SC.astype(float) ** 2) * (4095 / 12 + 0.25))


def pack_q4_k(d, dmin, sc, mn, qs) -> np.ndarray:
    """Q4_K blocks ``uint8 [n, 144]`` from ``d``, ``dmin`` (float16 [n]), the sub-blocks'
    6-bit scales and minima (``[n, 8]``) and the 128 code bytes (``[n, 128]``, as
    :func:`q4_k_code_bytes` lays codes out)."""
    sc, mn = np.asarray(sc, np.uint8), np.asarray(mn, np.uint8)
    if sc.max(initial=0) > 63 or mn.max(initial=0) > 63:
        raise ValueError("Q4_K scales and minima are 6 bits (0..63)")
    out = np.empty((len(d), Q4_K_BYTES), np.uint8)
    out[:, 0:2] = np.asarray(d, np.float16).reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = np.asarray(dmin, np.float16).reshape(-1, 1).view(np.uint8)
    # bytes 0-3: scales 0-3, 4-7: minima 0-3 (low six bits each); 8-11: the low four bits
    # of scales / minima 4-7, whose top two bits fill the spare bits 6-7 of bytes 0-7
    out[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    out[:, 16:] = qs
    return out


def q4_k_code_bytes(codes) -> np.ndarray:
    """4-bit codes in value order ``[n, 256]`` as Q4_K's 128 bytes: each run of 32 bytes
    holds one 32-value sub-block in its low nibbles and the next one in its high nibbles."""
    c = np.asarray(codes, np.uint8).reshape(-1, 4, 2, 32)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(-1, 128)


def pack_q6_k(d, scales, ql, qh) -> np.ndarray:
    """Q6_K blocks ``uint8 [n, 210]`` from ``d`` (float16 [n]), the 16 int8 scales of its
    16-value groups (``[n, 16]``) and the code bytes ``ql [n, 128]``, ``qh [n, 64]``."""
    out = np.empty((len(d), Q6_K_BYTES), np.uint8)
    out[:, 0:128] = ql
    out[:, 128:192] = qh
    out[:, 192:208] = np.asarray(scales, np.int8).view(np.uint8)
    out[:, 208:210] = np.asarray(d, np.float16).reshape(-1, 1).view(np.uint8)
    return out


def q6_k_code_bytes(codes) -> tuple[np.ndarray, np.ndarray]:
    """6-bit codes in value order ``[n, 256]`` as Q6_K's ``ql`` and ``qh``: each half of 128
    values is four runs of 32 (k = 0..3); run k's low nibbles go to ``ql`` bytes
    ``32 * (k % 2) + l`` (low nibble for k < 2, high for k >= 2) and its top two bits to
    bits ``2k`` of ``qh`` byte ``l``."""
    c = np.asarray(codes, np.uint8).reshape(-1, 2, 4, 32)
    lo, hi = c & 0x0F, c >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)],
                        axis=-1)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return ql.reshape(-1, 128), qh.reshape(-1, 64)


def _bytes(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Uniform random bytes: uniform 4-bit codes two a byte, 2-bit ones four a byte."""
    return np.frombuffer(rng.bytes(shape[0] * shape[1]), np.uint8).reshape(shape)


def _d(rng: np.random.Generator, n: int, base: float) -> np.ndarray:
    return (base * rng.uniform(0.75, 1.25, n)).astype(np.float16)


def random_blocks(rng: np.random.Generator, dims: tuple[int, int], kind: str) -> np.ndarray:
    """A ``rows x cols`` matrix's random blocks, ``uint8 [rows, cols / 256 * bytes]``."""
    rows, cols = dims
    if cols % QK:
        raise ValueError(f"{kind} needs columns in multiples of {QK} (got {cols})")
    n, size = rows * cols // QK, Q4_K_BYTES if kind == "Q4_K" else Q6_K_BYTES
    out = np.empty((n, size), np.uint8)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        sc = rng.integers(_Q4_SC[0], _Q4_SC[-1] + 1, (m, 8 if kind == "Q4_K" else 16),
                          dtype=np.uint8)
        if kind == "Q4_K":
            d = _d(rng, m, _Q4_D)
            # dmin = d and minimum round(7.5 sc): each sub-block centred on its codes' mean
            mn = np.rint(sc * 7.5).astype(np.uint8)
            out[start:start + m] = pack_q4_k(d, d, sc, mn, _bytes(rng, (m, 128)))
        else:
            out[start:start + m] = pack_q6_k(_d(rng, m, _Q6_D), sc, _bytes(rng, (m, 128)),
                                             _bytes(rng, (m, 64)))
    return out.reshape(rows, cols // QK * size)
