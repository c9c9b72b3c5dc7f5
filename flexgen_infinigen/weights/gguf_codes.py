"""GGUF's quantized blocks as the runtime's packed weights, code for code.

A quantized GGUF tensor is kept in the weight store as the file wrote it (its blocks, one
row of blocks per matrix row). Loading turns one tensor at a time into a
:class:`~..runtime.compression.Packed` weight: integer codes plus a float32 scale and
minimum per group, so that ``code * scale + minimum`` is the value the file encodes,
computed with the same float32 operations as ``gguf.quants.dequantize`` (tested equal).
Only the order of the codes changes, never a code:

- Q4_0 (``d * (q - 8)``), Q4_1 (``d * q + m``), Q4_K (per 32-value sub-block
  ``d * sc * q - dmin * m``, ``sc``/``m`` six bits each): 4-bit codes, two a byte, groups of
  32 (what ``kernels/linear.c``'s 4-bit kernel reads);
- Q8_0, Q5_0, Q5_1, Q5_K (groups of 32) and Q6_K (groups of 16): one signed byte a code
  (``kernels/linear.c``'s 8-bit kernel). Q5_0's ``q - 16`` and Q6_K's ``q - 32`` become the
  codes themselves (minimum 0).

F32, F16 and BF16 tensors stay floats at their own width. Any other type is refused by name
(:func:`check_kept`) before anything is written.
"""
from __future__ import annotations

import numpy as np

from ..config import ConfigError

# type name -> (bytes a block, values a block, code bits, values a group)
BLOCKS = {
    "Q4_0": (18, 32, 4, 32), "Q4_1": (20, 32, 4, 32), "Q4_K": (144, 256, 4, 32),
    "Q8_0": (34, 32, 8, 32), "Q5_0": (22, 32, 8, 32), "Q5_1": (24, 32, 8, 32),
    "Q5_K": (176, 256, 8, 32), "Q6_K": (210, 256, 8, 16),
}
FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
KEPT = tuple(FLOATS) + tuple(BLOCKS)


def check_kept(type_name: str, tensor: str, source: str) -> None:
    """One error naming a tensor type this runtime cannot keep."""
    if type_name not in KEPT:
        raise ConfigError(
            f"GGUF {source}: tensor {tensor!r} has type {type_name}, which this runtime "
            f"cannot keep (it keeps {', '.join(KEPT)}); use a file quantized to one of those")


def layout(type_name: str) -> tuple[int, int]:
    """(code bits, values a group) of a kept quantized type."""
    return BLOCKS[type_name][2], BLOCKS[type_name][3]


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes at the end of ``b`` read as a float16, widened to float32 ``[..., 1]``."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _pair_nibbles(values: np.ndarray) -> np.ndarray:
    """4-bit values ``[..., group]`` as bytes: element 2j in the low nibble of byte j."""
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def _split_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 32-value blocks ``[..., 16]``: values 0..15 in the low nibbles, 16..31 high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and minima of a K-quant super-block's 12 bytes ``[..., 12]``:
    bytes 0-3 hold scales 0-3 (low six bits), 4-7 minima 0-3; scales and minima 4-7 take
    their low four bits from bytes 8-11 and their top two from the spare bits of 0-7."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_sub_blocks(qs: np.ndarray) -> np.ndarray:
    """A K-quant's 128 bytes of low nibbles ``[..., 128]`` as eight 32-value sub-blocks
    ``[..., 8, 32]``: each run of 32 bytes holds one sub-block low, the next one high."""
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (q & 0x0F).reshape(*qs.shape[:-1], 8, 32)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of a little-endian bit field ``qh [..., count // 8]`` as ``[..., count]``."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :count]


def to_parts(raw: np.ndarray, type_name: str, shape: tuple[int, ...]):
    """``(codes, scale, minimum)`` of a tensor of ``shape`` stored as GGUF blocks ``raw``
    (uint8, ``[rows, blocks * block bytes]``): codes ``[rows, groups, group / 2]`` uint8
    (4-bit) or ``[rows, groups, group]`` int8, scale and minimum ``[rows, groups, 1]``
    float32."""
    size, per, bits, group = BLOCKS[type_name]
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    blocks = np.asarray(raw).reshape(rows, k // per, size)
    zero = None
    if type_name == "Q4_0":
        d = _f16(blocks[..., 0:2])
        q = _split_nibbles(blocks[..., 2:18])
        scale, minimum = d, d * np.float32(-8)
    elif type_name == "Q4_1":
        scale, minimum = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        q = _split_nibbles(blocks[..., 4:20])
    elif type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc, mn = _k_scales(blocks[..., 4:16])
        scale, minimum = d * sc, -(dmin * mn)  # [rows, blocks, 8]
        if type_name == "Q4_K":
            q = _k_sub_blocks(blocks[..., 16:144])
        else:
            high = _high_bits(blocks[..., 16:48], 256).reshape(rows, -1, 32, 8)
            q = _k_sub_blocks(blocks[..., 48:176]) | (high.swapaxes(-1, -2) << 4)
    elif type_name == "Q8_0":
        scale, zero = _f16(blocks[..., 0:2]), True
        q = blocks[..., 2:34].view(np.int8)
    elif type_name in ("Q5_0", "Q5_1"):
        at = 2 if type_name == "Q5_0" else 4
        scale = _f16(blocks[..., 0:2])
        high = _high_bits(blocks[..., at:at + 4], 32)
        q = _split_nibbles(blocks[..., at + 4:at + 20]) | (high << 4)
        if type_name == "Q5_0":
            q, zero = q.astype(np.int8) - np.int8(16), True
        else:
            minimum = _f16(blocks[..., 2:4])
    elif type_name == "Q6_K":
        ql = blocks[..., 0:128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8
                                                                        ).reshape(2, 1)
        qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array(
            [0, 2, 4, 6], np.uint8).reshape(4, 1)
        q = ((ql & 0x0F).reshape(rows, -1, 8, 32) | ((qh & 0x03).reshape(rows, -1, 8, 32)
                                                     << 4)).astype(np.int8) - np.int8(32)
        sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
        scale, zero = _f16(blocks[..., 208:210]) * sc, True
    else:  # pragma: no cover - guarded by check_kept
        raise ConfigError(f"GGUF type {type_name} is not kept")
    groups = k // group
    q = q.reshape(rows, groups, group)
    codes = _pair_nibbles(q) if bits == 4 else q.astype(np.int8)
    scale = np.broadcast_to(scale, (rows, k // per, per // group)).reshape(rows, groups, 1)
    if zero:
        minimum = np.zeros_like(scale)
    else:
        minimum = np.broadcast_to(minimum, (rows, k // per, per // group)).reshape(
            rows, groups, 1)
    lead = tuple(shape[:-1])
    return (np.ascontiguousarray(codes).reshape(*lead, groups, -1),
            np.ascontiguousarray(scale, dtype=np.float32).reshape(*lead, groups, 1),
            np.ascontiguousarray(minimum, dtype=np.float32).reshape(*lead, groups, 1))
