"""Group-wise asymmetric 4-bit quantization (min/max per group of 64 along the last dim)."""
from __future__ import annotations

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


def decompress(p: Packed, dtype: torch.dtype | None = None) -> torch.Tensor:
    codes = p.codes
    q = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2)
    out = q.to(p.scale.dtype) * p.scale + p.minimum
    lead = codes.shape[:-2]
    out = out.reshape(*lead, -1)
    return out if dtype is None else out.to(dtype)
