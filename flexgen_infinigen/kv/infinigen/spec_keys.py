"""The speculation key cache: a small copy of every cached key, kept on the compute device.

InfiniGen scores layer i+1's cached tokens during layer i without reading the KV cache, from
a cheap copy of the keys. Two kinds (``--speculation-keys``):

* ``partial``: the ``r`` kept skewed columns of each key in the runtime dtype (the paper's);
* ``int4`` / ``int8`` / ``int2``: the same projected key quantized per token and KV head
  (asymmetric, min and scale in the runtime dtype), so all ``head_dim`` columns fit where a few
  did. The CPU kernel multiplies 4-bit codes as bytes; 8- and 2-bit codes are expanded.

Rows are preallocated for the whole sequence and written in place, head-major.
"""
from __future__ import annotations

import torch

from .spec_pages import PAGE_KINDS
from ...kernels.cpu_kernels import library, score_packed, spec_write, speculate_mass

KINDS = {"partial": None, "int8": 8, "int4": 4, "int2": 2}


def bytes_per_key(kind: str, columns: int, item: int) -> float:
    """Device bytes per cached token and KV head (what equal-memory comparisons use)."""
    if kind in PAGE_KINDS:  # a float32 minimum and maximum per page
        return 2 * columns * 4 / PAGE_KINDS[kind]
    bits = KINDS[kind]
    if bits is None:
        return columns * item
    return -(-columns * bits // 8) + 2 * item  # packed codes, plus a minimum and a scale


class SpeculationKeys:
    """Rows kept head-major: each column (batch x KV head) holds its tokens one after the
    other (``[columns, max_len, ...]``), so that scoring a column reads one stream."""

    def __init__(self, kind: str, max_len: int, columns: int, width: int, dtype: torch.dtype,
                 tiers):
        self.kind, self.bits, self.width, self.dtype = kind, KINDS[kind], width, dtype
        self.tiers = tiers
        dev = tiers.device
        if self.bits is None:
            self.data = tiers.track(torch.zeros(columns, max_len, width, dtype=dtype,
                                                device=dev), "device")
            return
        self.per_byte = 8 // self.bits
        self.shifts = None  # each code slot's shift in its byte, made at the first write
        self.use_kernel = not tiers.is_cuda and dtype == torch.float32
        packed = -(-width // self.per_byte)
        self.codes = tiers.track(torch.zeros(columns, max_len, packed, dtype=torch.uint8,
                                             device=dev), "device")
        self.lo = tiers.track(torch.zeros(columns, max_len, dtype=dtype, device=dev), "device")
        self.scale = tiers.track(torch.zeros(columns, max_len, dtype=dtype, device=dev),
                                 "device")

    def write(self, rows: torch.Tensor, start: int) -> None:
        """Projected keys ``[s, columns, width]`` for positions ``start..start+s``."""
        end = start + rows.shape[0]
        if self.bits is None:
            self.data[:, start:end] = rows.transpose(0, 1)
            return
        if self.use_kernel and spec_write(rows, self.codes, self.lo, self.scale, start,
                                          self.bits):
            return
        self._quantize(rows.float().transpose(0, 1), start)

    def write_columns(self, x: torch.Tensor, start: int) -> None:
        """Projected keys ``[columns, s, width]`` for positions ``start..start+s`` (the
        torch path, no kernel)."""
        if self.bits is None:
            self.data[:, start:start + x.shape[1]] = x
            return
        self._quantize(x.float(), start)

    def _quantize(self, x: torch.Tensor, start: int) -> None:
        """Keys ``[columns, s, width]`` (float32) quantized into place, in few ops."""
        end = start + x.shape[1]
        levels = (1 << self.bits) - 1
        lo, hi = torch.aminmax(x, dim=-1)
        scale = hi.sub_(lo).div_(levels).clamp_(min=1e-8)
        # in [0, levels] already: x >= lo, and (x - lo) / scale <= levels to rounding
        q = (x - lo.unsqueeze(-1)).div_(scale.unsqueeze(-1)).round_().to(torch.uint8)
        pad = (-q.shape[-1]) % self.per_byte
        if pad:
            q = torch.nn.functional.pad(q, (0, pad))
        q = q.view(*q.shape[:-1], -1, self.per_byte)
        if self.shifts is None:
            self.shifts = torch.arange(self.per_byte, device=q.device,
                                       dtype=torch.uint8) * self.bits
        torch.sum(q << self.shifts, -1, dtype=torch.uint8,
                  out=self.codes.narrow(1, start, end - start))
        self.lo.narrow(1, start, end - start).copy_(lo)
        self.scale.narrow(1, start, end - start).copy_(scale)

    def take_columns(self, other: "SpeculationKeys", cols: slice, start: int,
                     length: int) -> None:
        """Columns ``cols`` hold, from position ``start``, ``other``'s first ``length``
        positions (all its columns), as stored: codes copied, not quantized again."""
        at = slice(start, start + length)
        if self.bits is None:
            self.data[cols, at] = other.data[:, :length]
            return
        for mine, theirs in ((self.codes, other.codes), (self.lo, other.lo),
                             (self.scale, other.scale)):
            mine[cols, at] = theirs[:, :length]

    def keys(self, length: int) -> torch.Tensor:
        """The first ``length`` rows ``[length, columns, width]`` in the runtime dtype."""
        if self.bits is None:
            return self.data[:, :length].transpose(0, 1)
        codes = self.codes[:, :length]
        shifts = torch.arange(self.per_byte, device=codes.device, dtype=torch.uint8) * self.bits
        mask = (1 << self.bits) - 1
        q = ((codes[..., None] >> shifts) & mask).flatten(-2)[..., :self.width]
        keys = q.to(self.dtype) * self.scale[:, :length, None] + self.lo[:, :length, None]
        return keys.transpose(0, 1)

    def _query(self, pq: torch.Tensor) -> torch.Tensor:
        """Partial queries ``[b, KV, G, w]`` as float32 ``[columns, G, width]`` (zero columns
        where the packed width is wider)."""
        b, kv, g, w = pq.shape
        qf = pq.float().reshape(b * kv, g, w)
        width = self.codes.shape[-1] * self.per_byte
        return torch.nn.functional.pad(qf, (0, width - w)) if width > w else qf

    def scores(self, pq: torch.Tensor, length: int) -> torch.Tensor:
        """Approximate logits ``[b, KV, G, length]`` of partial queries ``pq [b, KV, G, w]``.

        Quantized keys are not dequantized: q.k = scale (q.codes) + min (sum of q). On a CPU
        a kernel reads the codes once (see cpu_kernels); the torch path takes each code slot
        of every byte in turn, against the query's columns of that slot."""
        b, kv, g, w = pq.shape
        if self.bits is None:
            pk = self.data[:, :length].transpose(1, 2)  # [columns, w, length]
            return torch.bmm(pq.to(pk.dtype).reshape(b * kv, g, w), pk).view(
                b, kv, g, length).float()
        if self.use_kernel:
            out = score_packed(self.codes, self.scale, self.lo, self._query(pq), self.bits,
                               length)
            if out is not None:
                return out.view(b, kv, g, length)
        # key column j * per_byte + slot is in byte j's slot: each slot's codes, shifted out
        # of the bytes, take the query's matching columns (one product per slot; the codes
        # are never written out whole, so a step issues few ops: each is a GPU launch)
        codes = self.codes.narrow(1, 0, length).transpose(1, 2)  # [columns, packed, t]
        mask = (1 << self.bits) - 1
        q = self._query(pq).to(self.dtype)
        dot = None
        for slot in range(self.per_byte):
            plane = codes if slot == self.per_byte - 1 else codes & (mask << slot * self.bits)
            plane = (plane >> slot * self.bits if slot else plane).to(self.dtype)
            part = q[..., slot::self.per_byte]
            dot = torch.bmm(part, plane) if dot is None else dot.baddbmm_(part, plane)
        dot = dot.mul_(self.scale.narrow(1, 0, length).unsqueeze(1))
        out = dot.addcmul_(q.sum(-1, keepdim=True), self.lo.narrow(1, 0, length).unsqueeze(1))
        return out.view(b, kv, g, length).float()

    @property
    def fused_selection(self) -> bool:
        """Whether :meth:`select_mass` can score and select in one kernel call here."""
        return self.bits is not None and self.use_kernel and library() is not None

    def select_mass(self, pq: torch.Tensor, visible: torch.Tensor, caps: torch.Tensor,
                    width: int) -> torch.Tensor | None:
        """The ``mass`` rule on the scores of ``pq [b, KV, G, w]`` over the first
        ``visible.shape[1]`` rows, scored and selected in one pass per column by a CPU kernel:
        ``order [b, KV, width]``, or None where the kernel does not apply."""
        if not self.fused_selection:
            return None
        b, kv = pq.shape[:2]
        order = speculate_mass(self.codes, self.scale, self.lo, self._query(pq), self.bits,
                               visible, caps, width)
        return None if order is None else order.view(b, kv, width)
