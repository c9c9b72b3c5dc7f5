"""Group-wise quantized tensors: codes plus a scale and a minimum per group along the last dim.

The runtime's own 4-bit compression (``--compress-weight``, ``--compress-cache``) makes groups
of 64 from floats (min/max per group). Weights that a GGUF file already quantized arrive as
their own codes (:mod:`..weights.gguf_codes`): 4-bit in groups of 32, or one signed byte a
code in groups of 32 or 16. Every form is ``value = code * scale + minimum`` per group.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

GROUP_SIZE = 64

# GGUF block types kept as stored (:class:`Blocks`): bytes a block, values a block
BLOCK_FORMS = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32),
               "Q8_0": (34, 32), "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256),
               "MXFP4": (17, 32)}


def block_row_bytes(kind: str, values: int) -> int:
    """Bytes of one row of ``values`` values as GGUF blocks of ``kind``."""
    size, per = BLOCK_FORMS[kind]
    return values // per * size


class CodeLayout(NamedTuple):
    """The form of a weight that arrives as a quantized file's codes: code bits, values a
    group, and whether its scales and minima are held as float16 (exact: they are float16
    values) rather than in the compute dtype. ``kind`` (a GGUF type name such as ``Q4_K``):
    the weight arrives as the file's blocks, as stored (:class:`Blocks`), and stays so."""

    bits: int
    group: int
    half: bool = False
    kind: str | None = None


@dataclass
class Blocks:
    """A weight as a GGUF file stores it: each matrix row one run of the type's blocks
    (uint8 ``[rows, bytes a row]``), read by the CPU kernels as they are (integer dot
    products against 8-bit activations; :mod:`flexgen_infinigen.kernels.gguf`). Nothing is
    widened or reordered; ``order`` (int32 ``[rows]``, or None for the identity) says which
    stored row is output row ``o`` (llama.cpp interleaves the rotary rows of llama's q/k
    projections; reading row ``order[o]`` undoes that without moving a byte)."""

    raw: torch.Tensor  # uint8 [rows, bytes a row]
    kind: str  # the GGUF type name
    shape: tuple[int, ...]  # the matrix's shape in values
    order: torch.Tensor | None = None  # int32 [rows]

    @property
    def parts(self) -> tuple[torch.Tensor]:
        return (self.raw,)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def with_parts(self, raw: torch.Tensor) -> "Blocks":
        """The same blocks over other bytes (the whole tensor's, copied to another place)."""
        return Blocks(raw, self.kind, self.shape, self.order)

    def stored_rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Which stored rows hold output rows ``ids`` (all rows when None)."""
        if ids is None:
            ids = torch.arange(self.raw.shape[0])
        return ids if self.order is None else self.order.long()[ids]

    def dense(self, dtype: torch.dtype = torch.float32, ids: torch.Tensor | None = None
              ) -> torch.Tensor:
        """Rows ``ids`` (all when None) as floats, through ``gguf.quants.dequantize`` (the
        format's reference; the CPU kernels' own expansion is tested equal to it). For the
        paths that need floats: a GPU, an embedding lookup, a prefill without kernels."""
        from gguf import GGMLQuantizationType, quants

        rows = self.stored_rows(ids).reshape(-1)
        flat = self.raw.reshape(self.raw.shape[0], -1)
        out = torch.empty(rows.numel(), *self.shape[1:], dtype=dtype)
        step = max(1, CHUNK_VALUES // max(1, math.prod(self.shape[1:])))
        kind = GGMLQuantizationType[self.kind]
        for at in range(0, rows.numel(), step):  # a chunk of rows at a time: small temporaries
            part = flat[rows[at:at + step]].cpu().numpy()
            out[at:at + step] = torch.from_numpy(quants.dequantize(part, kind)).reshape(
                -1, *self.shape[1:]).to(dtype)
        return out if ids is None else out.view(*ids.shape, *self.shape[1:])


@dataclass
class Packed:
    """A quantized tensor: two 4-bit codes per byte (uint8 ``[..., groups, group / 2]``,
    element 2j of a group in the low nibble of byte j) or one signed code per byte (int8
    ``[..., groups, group]``), plus a scale and minimum per group."""

    codes: torch.Tensor  # uint8 [..., groups, group/2] or int8 [..., groups, group]
    scale: torch.Tensor  # [..., groups, 1] in the original dtype, or float16 (see CodeLayout)
    minimum: torch.Tensor  # [..., groups, 1], the scale's dtype
    shape: tuple[int, ...]  # the original shape

    @property
    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.minimum

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)

    def with_parts(self, codes, scale, minimum) -> "Packed":
        """The same form over other tensors (rows of it, moved to another place)."""
        return Packed(codes, scale, minimum, self.shape)

    @property
    def bits(self) -> int:
        return 8 if self.codes.dtype == torch.int8 else 4

    @property
    def group(self) -> int:
        return self.codes.shape[-1] * (8 // self.bits)


def can_compress(shape: tuple[int, ...], group: int = GROUP_SIZE) -> bool:
    return len(shape) >= 2 and shape[-1] % group == 0


def stored_bytes(shape: tuple[int, ...], itemsize: int, compress: bool,
                 layout: CodeLayout | None = None) -> int:
    """Bytes of a tensor of ``shape`` as stored: packed codes plus a scale and a minimum per
    group (what :attr:`Packed.nbytes` counts) when compressed and compressible, or when it
    came quantized with ``layout`` (its scales float16 or ``itemsize`` bytes)."""
    n = math.prod(shape)
    if layout is not None and CodeLayout(*layout).kind is not None:
        return math.prod(shape[:-1]) * block_row_bytes(CodeLayout(*layout).kind, shape[-1])
    if layout is not None:
        bits, group, half = CodeLayout(*layout)[:3]
        return n // group * (group * bits // 8 + 2 * (2 if half else itemsize))
    if compress and can_compress(tuple(shape)):
        return n // GROUP_SIZE * (GROUP_SIZE // 2 + 2 * itemsize)
    return n * itemsize


def packed_shapes(shape: tuple[int, ...], group: int = GROUP_SIZE, bits: int = 4):
    groups = shape[-1] // group
    lead = tuple(shape[:-1])
    return lead + (groups, group * bits // 8), lead + (groups, 1), lead + (groups, 1)


def codes_dtype(bits: int) -> torch.dtype:
    return torch.int8 if bits == 8 else torch.uint8


# rows of groups compressed or decompressed at a time: the temporaries stay near 16 MB
# however large the tensor (a 545 MB embedding table would otherwise need two or three
# full-size float temporaries: 1.9 GB of peak memory placing Qwen2.5's weights in 4 bits)
CHUNK_VALUES = 1 << 22


def _pack(g: torch.Tensor, dtype: torch.dtype):
    """Codes, scales and minima of float groups ``g [..., group]``."""
    lo = g.amin(-1, keepdim=True)
    span = (g.amax(-1, keepdim=True) - lo) / 15
    safe = torch.where(span > 0, span, torch.ones_like(span))
    q = torch.clamp(torch.round((g - lo) / safe), 0, 15).to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4), span.to(dtype), lo.to(dtype)


def compress(x: torch.Tensor, group: int = GROUP_SIZE) -> Packed:
    """Groups of ``group`` values along the last dimension as 4-bit codes (two a byte, the
    even element in the low nibble) with a minimum and a scale each; a large tensor a chunk
    of rows at a time (each group on its own: the same codes whatever the chunk)."""
    shape = tuple(x.shape)
    groups = shape[-1] // group
    rows = x.reshape(-1, groups, group)
    step = max(1, CHUNK_VALUES // (groups * group))
    if rows.shape[0] <= step:  # a cache's new rows, most weights: at once
        parts = _pack(rows.float(), x.dtype)
    else:
        parts = (torch.empty(rows.shape[0], groups, group // 2, dtype=torch.uint8,
                             device=x.device),
                 torch.empty(rows.shape[0], groups, 1, dtype=x.dtype, device=x.device),
                 torch.empty(rows.shape[0], groups, 1, dtype=x.dtype, device=x.device))
        for r in range(0, rows.shape[0], step):
            for whole, part in zip(parts, _pack(rows[r:r + step].float(), x.dtype)):
                whole[r:r + step] = part
    codes, scale, minimum = parts
    lead = shape[:-1]
    return Packed(codes.view(*lead, groups, group // 2), scale.view(*lead, groups, 1),
                  minimum.view(*lead, groups, 1), shape)


def decompress(p: Packed | Blocks, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A file's blocks (:class:`Blocks`) expanded by their format (float32 by default); or
    codes' values ``code * scale + minimum``, in ``dtype`` (default: the scale's). Scales
    held in another dtype (float16 scales of float32 weights) are widened to float32 first:
    the products are computed in float32, as with float32 scales of the same values."""
    if isinstance(p, Blocks):
        return p.dense(dtype or torch.float32).to(p.raw.device)
    codes = p.codes
    groups, width, group = codes.shape[-2], codes.shape[-1], p.group
    if dtype is not None and p.scale.dtype != dtype:
        p = Packed(p.codes, p.scale.float(), p.minimum.float(), p.shape)
    out = torch.empty(*codes.shape[:-2], groups * group, dtype=p.scale.dtype,
                      device=codes.device)
    flat_codes = codes.reshape(-1, groups, width)
    scale, minimum = p.scale.reshape(-1, groups, 1), p.minimum.reshape(-1, groups, 1)
    flat_out = out.view(-1, groups, group)
    step = max(1, CHUNK_VALUES // (groups * group))
    eight = p.bits == 8
    for start in range(0, flat_codes.shape[0], step):
        part = slice(start, start + step)
        c = flat_codes[part]
        q = (c if eight else torch.stack([c & 0x0F, c >> 4], dim=-1).flatten(-2)).to(out.dtype)
        torch.mul(q, scale[part], out=flat_out[part])
        flat_out[part] += minimum[part]
    return out if dtype is None else out.to(dtype)


@dataclass
class PackedWeight:
    """A compressed weight handed to the model's math as stored (in CPU memory that a CPU
    computes on): ``cpu_layers.linear`` multiplies with its codes directly, anything else
    asks for :meth:`dense` rows or :meth:`rows`."""

    packed: Packed | Blocks
    value_dtype: torch.dtype | None = None  # the weight's values (default: the scale's)

    def __post_init__(self):
        p = self.packed
        if isinstance(p, Blocks):  # the file's blocks: kernels/gguf.py multiplies them
            self.kernel_ready = (len(p.shape) == 2 and self.dtype == torch.float32
                                 and not p.raw.is_cuda and p.raw.is_contiguous()
                                 and (p.order is None or p.order.dtype == torch.int32))
            self.expert_view = None
            return
        # what the CPU kernels take (cpu_layers.linear_q4 / linear_q8, or their _h16 forms
        # for float16 scales): a float32 matrix, every part contiguous; 4-bit codes in
        # groups of 64 or 32 along rows of whole 64-value blocks, 8-bit codes in groups of
        # a multiple of 8
        fits = (p.group in (32, 64) and p.shape[-1] % 64 == 0) if p.bits == 4 \
            else p.group % 8 == 0
        scales = p.scale.dtype in (torch.float32, torch.float16) and \
            p.minimum.dtype == p.scale.dtype
        self.kernel_ready = (len(p.shape) == 2 and fits and scales
                             and self.dtype == torch.float32 and not p.codes.is_cuda
                             and all(t.is_contiguous() for t in p.parts))
        # what the one-call experts kernel needs of a matrix (4-bit codes, float16 factors),
        # worked out once: a decode step hands it every routed matrix of a layer
        self.expert_view = ((p.group, *p.shape, p.codes.data_ptr(), p.scale.data_ptr(),
                             p.minimum.data_ptr())
                            if self.kernel_ready and p.bits == 4
                            and p.scale.dtype == torch.float16 else None)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.packed.shape

    @property
    def dtype(self) -> torch.dtype:
        if isinstance(self.packed, Blocks):
            return self.value_dtype or torch.float32
        return self.value_dtype or self.packed.scale.dtype

    def dense(self) -> torch.Tensor:
        return decompress(self.packed, self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``dense()[ids]`` without expanding the other rows (an embedding lookup)."""
        p = self.packed
        if isinstance(p, Blocks):
            return p.dense(self.dtype, ids.cpu()).to(ids.device)
        flat = ids.reshape(-1)
        picked = Packed(p.codes[flat], p.scale[flat], p.minimum[flat],
                        (flat.numel(), *p.shape[1:]))
        return decompress(picked, self.dtype).view(*ids.shape, *p.shape[1:])


def dense(w):
    """A weight as a tensor, whether it came packed (:class:`PackedWeight`) or not."""
    return w.dense() if isinstance(w, PackedWeight) else w


def lookup(w, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of an embedding table, packed or not."""
    if isinstance(w, PackedWeight):
        return w.rows(ids)
    return torch.nn.functional.embedding(ids, w)
