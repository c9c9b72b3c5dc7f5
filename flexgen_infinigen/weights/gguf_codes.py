"""GGUF's quantized blocks as the runtime's packed weights, code for code.

A quantized GGUF tensor is kept in the weight store as the file wrote it (its blocks, one
row of blocks per matrix row). Loading turns one tensor at a time into a
:class:`~flexgen_infinigen.memory.codes.Packed` weight: integer codes plus a scale and minimum per
group, so that ``code * scale + minimum`` is the value the file encodes, computed with the
same float32 operations as ``gguf.quants.dequantize`` (tested equal). The scales and minima
are held as float16 when every one of the tensor's is a float16 exactly (:func:`half_exact`:
always for the plain types, whose factors are the file's own float16s; for a K-quant only
when its products of a float16 and a small integer happen to be), else as float32: the
same values either way. Only the order of the codes changes, never a code:

- Q4_0 (``d * (q - 8)``), Q4_1 (``d * q + m``), Q4_K (per 32-value sub-block
  ``d * sc * q - dmin * m``, ``sc``/``m`` six bits each): 4-bit codes, two a byte, groups of
  32 (what ``kernels/c/linear.c``'s 4-bit kernel reads);
- Q8_0, Q5_0, Q5_1, Q5_K (groups of 32) and Q6_K (groups of 16): one signed byte a code
  (``kernels/c/linear.c``'s 8-bit kernel). Q5_0's ``q - 16`` and Q6_K's ``q - 32`` become the
  codes themselves (minimum 0);
- MXFP4 (gpt-oss's experts; blocks of 32 4-bit codes and one power-of-two exponent): the
  value each code names (an integer in [-12, 12], :data:`MXFP4_VALUES`) as a signed byte,
  its block's power of two as the scale.

F32, F16 and BF16 tensors stay floats at their own width. Any other type is refused by name
(:func:`check_kept`) before anything is written.
"""
from __future__ import annotations

import numpy as np

from ..config import ConfigError
from ..memory.codes import BLOCK_FORMS

# type name -> (bytes a block, values a block, code bits, values a group) of the codes
# they become for a GPU (or a CPU without the GGUF kernels)
_CODES = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q4_K": (4, 32), "Q8_0": (8, 32), "Q5_0": (8, 32),
          "Q5_1": (8, 32), "Q5_K": (8, 32), "Q6_K": (8, 16), "MXFP4": (8, 32)}
# MXFP4's 4-bit codes name these values (twice the FP4 E2M1 numbers), times its block's
# power of two 2^(e - 128) (half of the E8M0 exponent's 2^(e - 127))
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
BLOCKS = {kind: (*BLOCK_FORMS[kind], *form) for kind, form in _CODES.items()}
# the types the CPU kernels multiply as stored (kernels/c/gguf_dot.c): a weight of one of
# these stays the file's blocks when a CPU computes (memory.codes.Blocks)
NATIVE = tuple(BLOCK_FORMS)
# routed experts of these types become 4-bit codes with float16 factors when a CPU computes,
# which the compiled MoE calls read (kernels/c/moe_experts.c, moe_layer.c); experts of the
# other types stay the file's blocks, which kernels/c/moe_blocks.c reads as they lie
MOE_CODES = ("Q4_0", "Q4_1")
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


def _factors(blocks: np.ndarray, type_name: str):
    """``(scale, minimum)`` of blocks ``[rows, blocks, bytes]`` as float32, one a group
    within each block (``[rows, blocks, per / group]`` or ``[rows, blocks, 1]`` when a block
    is one group); minimum None where it is zero."""
    if type_name == "Q4_0":
        d = _f16(blocks[..., 0:2])
        return d, d * np.float32(-8)
    if type_name in ("Q4_1", "Q5_1"):
        return _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc, mn = _k_scales(blocks[..., 4:16])
        return d * sc, -(dmin * mn)  # [rows, blocks, 8]
    if type_name in ("Q8_0", "Q5_0"):
        return _f16(blocks[..., 0:2]), None
    if type_name == "Q6_K":
        sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
        return _f16(blocks[..., 208:210]) * sc, None
    if type_name == "MXFP4":  # exact powers of two, down to float32's subnormals
        e = blocks[..., 0:1].astype(np.int32)
        return np.ldexp(np.float32(1), e - 128).astype(np.float32), None
    raise ConfigError(f"GGUF type {type_name} is not kept")  # pragma: no cover


def _codes(blocks: np.ndarray, type_name: str) -> np.ndarray:
    """The integer codes of blocks ``[rows, blocks, bytes]``, in value order."""
    rows = blocks.shape[0]
    if type_name in ("Q4_0", "Q4_1"):
        return _split_nibbles(blocks[..., 2 if type_name == "Q4_0" else 4:][..., :16])
    if type_name == "Q4_K":
        return _k_sub_blocks(blocks[..., 16:144])
    if type_name == "Q5_K":
        high = _high_bits(blocks[..., 16:48], 256).reshape(rows, -1, 32, 8)
        return _k_sub_blocks(blocks[..., 48:176]) | (high.swapaxes(-1, -2) << 4)
    if type_name == "Q8_0":
        return blocks[..., 2:34].view(np.int8)
    if type_name in ("Q5_0", "Q5_1"):
        at = 2 if type_name == "Q5_0" else 4
        high = _high_bits(blocks[..., at:at + 4], 32)
        q = _split_nibbles(blocks[..., at + 4:at + 20]) | (high << 4)
        return q.astype(np.int8) - np.int8(16) if type_name == "Q5_0" else q
    if type_name == "Q6_K":
        ql = blocks[..., 0:128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8
                                                                        ).reshape(2, 1)
        qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array(
            [0, 2, 4, 6], np.uint8).reshape(4, 1)
        return ((ql & 0x0F).reshape(rows, -1, 8, 32) | ((qh & 0x03).reshape(rows, -1, 8, 32)
                                                        << 4)).astype(np.int8) - np.int8(32)
    if type_name == "MXFP4":
        return MXFP4_VALUES[_split_nibbles(blocks[..., 1:17])]
    raise ConfigError(f"GGUF type {type_name} is not kept")  # pragma: no cover


def _blocks(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    size, per = BLOCKS[type_name][:2]
    rows = int(np.prod(shape[:-1]))
    return np.asarray(raw).reshape(rows, shape[-1] // per, size)


def _fits_half(x: np.ndarray) -> bool:
    """Every value of float32 ``x`` is a float16 exactly (finite, no bits lost)."""
    with np.errstate(over="ignore"):  # a value past float16's range: inf, not equal
        return bool(np.array_equal(x.astype(np.float16).astype(np.float32), x))


def half_exact(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> bool:
    """Whether every scale and minimum of the tensor is a float16 exactly, so that they can
    be held at 16 bits with the same values. The plain types' factors are the file's own
    float16s (Q4_0's minimum ``-8 d`` too, short of an overflow); a K-quant's are products
    of a float16 and a 6- or 8-bit integer, exact in float16 only for some tensors (checked
    a chunk of rows at a time, reading only the factors' bytes)."""
    blocks = _blocks(raw, type_name, shape)
    step = max(1, (1 << 20) // max(1, blocks.shape[1]))
    for r in range(0, blocks.shape[0], step):
        for f in _factors(blocks[r:r + step], type_name):
            if f is not None and not _fits_half(f):
                return False
    return True


def to_parts(raw: np.ndarray, type_name: str, shape: tuple[int, ...], half: bool = False):
    """``(codes, scale, minimum)`` of a tensor of ``shape`` stored as GGUF blocks ``raw``
    (uint8, ``[rows, blocks * block bytes]``): codes ``[rows, groups, group / 2]`` uint8
    (4-bit) or ``[rows, groups, group]`` int8, scale and minimum ``[rows, groups, 1]``
    float32, or float16 with ``half`` (only where :func:`half_exact` says they are exact:
    checked here, an error otherwise)."""
    size, per, bits, group = BLOCKS[type_name]
    rows, k = int(np.prod(shape[:-1])), shape[-1]
    blocks = _blocks(raw, type_name, shape)
    scale, minimum = _factors(blocks, type_name)
    q = _codes(blocks, type_name)
    groups = k // group
    q = q.reshape(rows, groups, group)
    codes = _pair_nibbles(q) if bits == 4 else q.astype(np.int8)
    scale = np.broadcast_to(scale, (rows, k // per, per // group)).reshape(rows, groups, 1)
    if minimum is None:
        minimum = np.zeros_like(scale)
    else:
        minimum = np.broadcast_to(minimum, (rows, k // per, per // group)).reshape(
            rows, groups, 1)
    dtype = np.float32
    if half:
        if not (_fits_half(scale) and _fits_half(minimum)):
            raise ValueError(f"{type_name} factors are not all float16 values")
        dtype = np.float16
    lead = tuple(shape[:-1])
    return (np.ascontiguousarray(codes).reshape(*lead, groups, -1),
            np.ascontiguousarray(scale, dtype=dtype).reshape(*lead, groups, 1),
            np.ascontiguousarray(minimum, dtype=dtype).reshape(*lead, groups, 1))
