"""The speculation key cache: a small copy of every cached key, kept on the compute device.

InfiniGen scores layer i+1's cached tokens during layer i without reading the KV cache, from
a cheap copy of the keys. Two kinds (``--speculation-keys``):

* ``partial``: the ``r`` kept skewed columns of each key in the runtime dtype (the paper's);
* ``int4`` / ``int2``: the same projected key quantized per token and KV head (asymmetric,
  min and scale in the runtime dtype), so all ``head_dim`` columns fit where a few did.

Rows are preallocated for the whole sequence and written in place.
"""
from __future__ import annotations

import torch

from ..cpu_kernels import score_packed

KINDS = {"partial": None, "int4": 4, "int2": 2}


def bytes_per_key(kind: str, columns: int, item: int) -> float:
    """Device bytes per cached token and KV head (what equal-memory comparisons use)."""
    bits = KINDS[kind]
    if bits is None:
        return columns * item
    return -(-columns * bits // 8) + 2 * item  # packed codes, plus a minimum and a scale


class SpeculationKeys:
    def __init__(self, kind: str, max_len: int, columns: int, width: int, dtype: torch.dtype,
                 tiers):
        self.kind, self.bits, self.width, self.dtype = kind, KINDS[kind], width, dtype
        self.tiers = tiers
        dev = tiers.device
        if self.bits is None:
            self.data = tiers.track(torch.zeros(max_len, columns, width, dtype=dtype,
                                                device=dev), "device")
            return
        self.per_byte = 8 // self.bits
        self.use_kernel = not tiers.is_cuda and dtype == torch.float32
        packed = -(-width // self.per_byte)
        self.codes = tiers.track(torch.zeros(max_len, columns, packed, dtype=torch.uint8,
                                             device=dev), "device")
        self.lo = tiers.track(torch.zeros(max_len, columns, 1, dtype=dtype, device=dev),
                              "device")
        self.scale = tiers.track(torch.zeros(max_len, columns, 1, dtype=dtype, device=dev),
                                 "device")

    def write(self, rows: torch.Tensor, start: int) -> None:
        """Projected keys ``[s, columns, width]`` for positions ``start..start+s``."""
        end = start + rows.shape[0]
        if self.bits is None:
            self.data[start:end] = rows
            return
        levels = (1 << self.bits) - 1
        x = rows.float()
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        scale = ((hi - lo) / levels).clamp(min=1e-8)
        q = torch.round((x - lo) / scale).clamp(0, levels).to(torch.uint8)
        pad = (-q.shape[-1]) % self.per_byte
        if pad:
            q = torch.nn.functional.pad(q, (0, pad))
        q = q.view(*q.shape[:-1], -1, self.per_byte)
        shifts = torch.arange(self.per_byte, device=q.device, dtype=torch.uint8) * self.bits
        self.codes[start:end] = (q << shifts).sum(-1, dtype=torch.uint8)
        self.lo[start:end] = lo.to(self.dtype)
        self.scale[start:end] = scale.to(self.dtype)

    def keys(self, length: int) -> torch.Tensor:
        """The first ``length`` rows ``[length, columns, width]`` in the runtime dtype."""
        if self.bits is None:
            return self.data[:length]
        codes = self.codes[:length]
        shifts = torch.arange(self.per_byte, device=codes.device, dtype=torch.uint8) * self.bits
        mask = (1 << self.bits) - 1
        q = ((codes[..., None] >> shifts) & mask).flatten(-2)[..., :self.width]
        return (q.to(self.dtype) * self.scale[:length] + self.lo[:length])

    def scores(self, pq: torch.Tensor, length: int) -> torch.Tensor:
        """Approximate logits ``[b, KV, G, length]`` of partial queries ``pq [b, KV, G, w]``.

        Quantized keys are not dequantized: q.k = scale (q.codes) + min (sum of q). The codes
        are unpacked token-major, as stored, one code slot of every byte after the other
        (the query's columns reordered to match), into a reused buffer, and scored with one
        batched matmul over the key rows, the layout decode attention reads."""
        b, kv, g, w = pq.shape
        if self.bits is None:
            pk = self.data[:length].view(length, b, kv, w).permute(1, 2, 3, 0)
            return torch.matmul(pq.to(pk.dtype), pk).float()
        codes = self.codes[:length]  # [t, cols, packed]
        cols, packed = codes.shape[1], codes.shape[2]
        width, mask = packed * self.per_byte, (1 << self.bits) - 1
        if self.use_kernel:  # codes expanded in registers, read once (see kernels.py)
            qf = pq.float().reshape(cols, g, w)
            if width > w:
                qf = torch.nn.functional.pad(qf, (0, width - w))
            out = score_packed(codes, self.scale[:length], self.lo[:length], qf, self.bits)
            if out is not None:
                return out.view(b, kv, g, length)
        unpacked = self.tiers.scratch("speculation.unpacked", (length, cols, width), self.dtype)
        planes = unpacked.view(length, cols, self.per_byte, packed)
        for slot in range(self.per_byte):  # column j * per_byte + slot of the key
            planes[:, :, slot].copy_((codes >> (slot * self.bits)) & mask)
        q = pq.to(self.dtype).reshape(cols, g, w)
        if width > w:
            q = torch.nn.functional.pad(q, (0, width - w))
        q = torch.cat([q[..., slot::self.per_byte] for slot in range(self.per_byte)], -1)
        dot = torch.bmm(q, unpacked.permute(1, 2, 0))  # [cols, G, t]
        scale = self.scale[:length].view(length, cols).t()[:, None, :]
        lo = self.lo[:length].view(length, cols).t()[:, None, :]
        out = dot * scale + q.sum(-1, keepdim=True) * lo
        return out.view(b, kv, g, length).float()
