"""Group-wise asymmetric 4-bit quantization (min/max per group of 64 along the last dim)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GROUP_SIZE = 64


@dataclass
class Packed:
    """A quantized tensor: two 4-bit codes per byte, plus a scale and minimum per group."""

    codes: torch.Tensor  # uint8 [..., groups, group/2]
    scale: torch.Tensor  # [..., groups, 1] in the original dtype
    minimum: torch.Tensor  # [..., groups, 1]
    shape: tuple[int, ...]  # the original shape

    @property
    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.minimum

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)


def can_compress(shape: tuple[int, ...], group: int = GROUP_SIZE) -> bool:
    return len(shape) >= 2 and shape[-1] % group == 0


def stored_bytes(shape: tuple[int, ...], itemsize: int, compress: bool) -> int:
    """Bytes of a tensor of ``shape`` as stored: packed 4-bit codes plus a scale and a minimum
    per group (what :attr:`Packed.nbytes` counts) when compressed and compressible."""
    n = math.prod(shape)
    if compress and can_compress(tuple(shape)):
        return n // GROUP_SIZE * (GROUP_SIZE // 2 + 2 * itemsize)
    return n * itemsize


def packed_shapes(shape: tuple[int, ...], group: int = GROUP_SIZE):
    groups = shape[-1] // group
    lead = tuple(shape[:-1])
    return lead + (groups, group // 2), lead + (groups, 1), lead + (groups, 1)


def compress(x: torch.Tensor, group: int = GROUP_SIZE) -> Packed:
    shape = tuple(x.shape)
    g = x.reshape(*shape[:-1], shape[-1] // group, group).float()
    lo = g.amin(-1, keepdim=True)
    hi = g.amax(-1, keepdim=True)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round((g - lo) / safe), 0, 15).to(torch.uint8)
    codes = q[..., 0::2] | (q[..., 1::2] << 4)
    return Packed(codes, scale.to(x.dtype), lo.to(x.dtype), shape)


# rows of groups decompressed at a time: the temporaries stay near 16 MB however large the
# tensor (a 113 MB embedding table would otherwise need three full-size float temporaries)
CHUNK_VALUES = 1 << 22


def decompress(p: Packed, dtype: torch.dtype | None = None) -> torch.Tensor:
    codes = p.codes
    groups, half = codes.shape[-2], codes.shape[-1]
    out = torch.empty(*codes.shape[:-2], groups * half * 2, dtype=p.scale.dtype,
                      device=codes.device)
    flat_codes = codes.reshape(-1, groups, half)
    scale, minimum = p.scale.reshape(-1, groups, 1), p.minimum.reshape(-1, groups, 1)
    flat_out = out.view(-1, groups, 2 * half)
    step = max(1, CHUNK_VALUES // (groups * half * 2))
    for start in range(0, flat_codes.shape[0], step):
        part = slice(start, start + step)
        c = flat_codes[part]
        q = torch.stack([c & 0x0F, c >> 4], dim=-1).flatten(-2).to(out.dtype)
        torch.mul(q, scale[part], out=flat_out[part])
        flat_out[part] += minimum[part]
    return out if dtype is None else out.to(dtype)
