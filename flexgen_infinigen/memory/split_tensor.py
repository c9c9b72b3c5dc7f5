"""A tensor split across the three tiers along one dimension, optionally held as group codes
(the runtime's 4-bit compression, or the codes a quantized file came with)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import codes as compression
from .tiers import DEVICE, HOST, TIERS, Tiers, nbytes


def split_sizes(n: int, fractions: tuple[float, float, float]) -> list[int]:
    """Split ``n`` items into device/host/disk counts that follow ``fractions`` to the item."""
    dev = round(n * fractions[0])
    dev_host = round(n * (fractions[0] + fractions[1]))
    return [dev, dev_host - dev, n - dev_host]


@dataclass
class Segment:
    tier: str
    start: int
    stop: int
    data: torch.Tensor | compression.Packed


class SplitTensor:
    """``shape`` split along ``split_dim`` into device, host and disk segments.

    Rows along dim 0 can be read or written in place (a KV cache appends one
    token row at a time); a compressed tensor keeps 4-bit codes in every tier
    and is decompressed only where it is used.

    ``head_major`` (a KV cache ``[tokens, columns, d]`` split along its columns): when the
    tensor is one uncompressed segment in CPU memory that a CPU computes on, it is stored
    column after column (``[columns, tokens, d]`` in memory) and shown as the usual
    ``[tokens, columns, d]`` view, so that decode attention reads each column's rows as one
    stream (a token-major cache puts a column's rows ``columns x d`` apart). Everything that
    indexes it sees the same logical tensor; only strides differ.
    """

    def __init__(self, tiers: Tiers, shape: tuple[int, ...], dtype: torch.dtype,
                 fractions: tuple[float, float, float], kind: str, split_dim: int = 0,
                 compress: bool = False, pin: bool = True, head_major: bool = False,
                 layout: compression.CodeLayout | None = None):
        """``layout`` (code bits, group, float16 scales): the tensor arrives as codes of that
        form (a :class:`~.codes.Packed` handed to :meth:`write`, rows along dim 0) and
        is held as they are, its scales and minima in float16 where the layout says so (else
        in ``dtype``); else ``compress`` packs floats into the runtime's 4-bit groups of 64."""
        self.tiers, self.shape, self.dtype, self.kind = tiers, tuple(shape), dtype, kind
        self.split_dim = split_dim
        self.layout = None if layout is None else compression.CodeLayout(*layout)
        self.compressed = layout is not None or (compress and compression.can_compress(self.shape))
        assert layout is None or split_dim == 0
        sizes = [(tier, size) for tier, size in
                 zip(TIERS, split_sizes(self.shape[split_dim], fractions)) if size]
        # the compute device can read it where it is: one uncompressed segment on the device,
        # or in CPU memory when the compute device is the CPU (``Tiers.host_in_place``)
        one_place = len(sizes) == 1 and (
            sizes[0][0] == DEVICE or (sizes[0][0] == HOST and tiers.host_in_place))
        self.addressable = not self.compressed and one_place
        # one uncompressed segment in host memory the compute device reads rows of by index
        # (:mod:`flexgen_infinigen.memory.mapped_rows`), pinned where the device is a GPU
        self.mapped = (not self.compressed and len(sizes) == 1 and sizes[0][0] == HOST
                       and not self.addressable and tiers.maps_host
                       and (pin or not tiers.is_cuda))
        # 4-bit codes a CPU reads where they are (a kernel expands them in its registers)
        self.packed_in_place = self.compressed and one_place and not tiers.is_cuda
        # a file's blocks that a CPU reads in CPU memory (as the compute device, or as the
        # host tier it reads in place): the source's bytes are taken as they are (a memory
        # map of the file: no copy, no second resident set), not copied
        self.adopts = (self.layout is not None and self.layout.kind is not None
                       and len(sizes) == 1 and not tiers.is_cuda
                       and (sizes[0][0] == DEVICE
                            or (sizes[0][0] == HOST and tiers.host_in_place)))
        self.head_major = (head_major and (self.addressable or self.packed_in_place)
                           and not tiers.is_cuda and split_dim == 1 and len(self.shape) == 3)
        self.segments: list[Segment] = []
        start = 0
        for tier, size in sizes:
            seg_shape = list(self.shape)
            seg_shape[split_dim] = size
            self.segments.append(Segment(tier, start, start + size,
                                         self._alloc(tier, tuple(seg_shape), pin)))
            start += size
        # nothing to move: every segment sits on the compute device, uncompressed
        self.resident = not self.compressed and all(s.tier == DEVICE for s in self.segments)
        self._packed = None  # read_for_compute's handle on packed codes, made once

    def _alloc(self, tier: str, shape: tuple[int, ...], pin: bool):
        def empty(shape, dtype):  # head-major: columns first in memory, rows first in view
            if not self.head_major:
                return self.tiers.empty(tier, shape, dtype, pin)
            swapped = (shape[1], shape[0], *shape[2:])
            return self.tiers.empty(tier, swapped, dtype, pin).transpose(0, 1)

        if not self.compressed:
            return empty(shape, self.dtype)
        if self.layout is not None and self.layout.kind is not None:
            kind = self.layout.kind
            rows = (math.prod(shape[:-1]), compression.block_row_bytes(kind, shape[-1]))
            raw = torch.empty(0, rows[1], dtype=torch.uint8) if self.adopts else \
                empty(rows, torch.uint8)
            return compression.Blocks(raw, kind, shape)
        bits, group, half = (self.layout or (4, compression.GROUP_SIZE, False))[:3]
        cs, ss, ms = compression.packed_shapes(shape, group, bits)
        factor = torch.float16 if half else self.dtype
        return compression.Packed(empty(cs, compression.codes_dtype(bits)),
                                  empty(ss, factor), empty(ms, factor), shape)

    # ---- sizes ------------------------------------------------------------------------------
    def bytes_by_tier(self) -> dict[str, int]:
        out = {t: 0 for t in TIERS}
        for seg in self.segments:
            out[seg.tier] += seg.data.nbytes if self.compressed else nbytes(seg.data)
        return out

    # ---- reads and writes -------------------------------------------------------------------
    def _move(self, t: torch.Tensor, tier: str, to: str) -> torch.Tensor:
        if to == DEVICE:
            return self.tiers.to_compute(t, tier, self.kind)
        return self.tiers.to_host(t, tier, self.kind)

    def read(self, rows: slice | None = None, to: str = DEVICE,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``rows`` (along dim 0) of the whole tensor, brought to ``to`` and decompressed;
        into ``out`` (a buffer in ``to``) when given."""
        sel = slice(None) if rows is None else rows
        if out is not None and self.compressed:
            out.copy_(self.read(rows, to))
            return out
        if out is not None or (len(self.segments) > 1 and not self.compressed):
            return self._read_into_place(sel, to, out)
        parts = []
        for seg in self.segments:
            if self.compressed:
                packed = seg.data
                assert rows is None or getattr(packed, "order", None) is None, \
                    "rows of blocks held in stored order"
                moved = [self._move(p[sel], seg.tier, to) for p in packed.parts]
                parts.append(compression.decompress(packed.with_parts(*moved), self.dtype))
            else:
                parts.append(self._move(seg.data[sel], seg.tier, to))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.split_dim)

    def view(self, rows: slice | None = None) -> torch.Tensor:
        """Rows of an ``addressable`` tensor as they are stored: no copy, nothing counted."""
        assert self.addressable, "view() needs an addressable tensor"
        return self.segments[0].data[slice(None) if rows is None else rows]

    def read_for_compute(self):
        """What the model's math gets: the tensor on the compute device (:meth:`read`), or, for
        a compressed tensor a CPU computes on, its codes (a :class:`~.codes.PackedWeight`:
        nothing is expanded): as stored where it is one segment in CPU memory, else every
        segment's codes brought into one buffer (split over tiers, on disk, or in CPU memory
        copied as a GPU's link would). Expanding them to floats every step (:meth:`read`)
        writes 4-8x the codes' bytes and costs far more than reading them."""
        if (self.compressed and len(self.segments) == 1 and not self.tiers.is_cuda
                and (self.segments[0].tier == DEVICE
                     or (self.segments[0].tier == HOST and self.tiers.host_in_place))):
            if self._packed is None:
                self._packed = compression.PackedWeight(self.segments[0].data, self.dtype)
            return self._packed
        if self.compressed and not self.tiers.is_cuda and self.split_dim == 0:
            return compression.PackedWeight(self._codes_in_one_place(), self.dtype)
        return self.read()

    def _codes_in_one_place(self) -> compression.Packed:
        """Every segment's codes, scales and minima copied (or read from disk) into one
        fresh buffer on the compute device, rows in order; each link's bytes counted."""
        first = self.segments[0].data
        whole = [torch.empty((self.shape[0], *p.shape[1:]), dtype=p.dtype)
                 for p in first.parts]
        for seg in self.segments:
            for dst, src in zip(whole, seg.data.parts):
                self.tiers.write(dst[seg.start:seg.stop], DEVICE, src, self.kind,
                                 src_tier=seg.tier)
        if isinstance(first, compression.Blocks):
            return compression.Blocks(whole[0], first.kind, self.shape)
        return compression.Packed(*whole, self.shape)

    def _read_into_place(self, sel: slice, to: str, out: torch.Tensor | None) -> torch.Tensor:
        """A split tensor read into one buffer, each segment copied straight to its place
        (joining separately moved segments afterwards would copy the whole tensor again)."""
        if out is None:
            first = self.segments[0].data[sel]
            shape = list(first.shape)
            shape[self.split_dim] = self.shape[self.split_dim]
            out = self.tiers.empty(to, tuple(shape), self.dtype)
        for seg in self.segments:
            dst = out.narrow(self.split_dim, seg.start, seg.stop - seg.start)
            self.tiers.write(dst, to, seg.data[sel], self.kind, src_tier=seg.tier)
        return out

    def packed(self) -> compression.Packed:
        """The 4-bit codes, scales and minima of a tensor held whole in CPU memory that a CPU
        computes on (``packed_in_place``), as stored: no copy, nothing counted."""
        assert self.packed_in_place, "packed() needs a compressed tensor in one CPU place"
        return self.segments[0].data

    def flat_rows(self) -> tuple[torch.Tensor, int, int]:
        """An ``addressable`` (or ``mapped``) tensor's rows as one ``[n, d]`` view of its
        storage, and where row (t, c) is in it: ``t * token_stride + c * column_stride``."""
        data = self.segments[0].data if self.mapped else self.view()
        d = data.shape[-1]
        flat = data.as_strided((data.shape[0] * data.shape[1], d), (d, 1))
        return flat, data.stride(0) // d, data.stride(1) // d

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """Per-column rows: ``out[r, c] = self[index[r, c], c]`` on the compute device.

        ``index`` is ``[n, shape[1]]`` (a tensor split along dim 1, like the KV cache); only
        the gathered rows cross the links. Index columns of host and disk segments must be
        on the CPU, those of device segments on the device.
        """
        assert self.split_dim == 1
        parts = []
        for seg in self.segments:
            idx = index[:, seg.start:seg.stop]
            idx = idx.to(self.tiers.device if seg.tier == DEVICE else "cpu")
            tensors = seg.data.parts if self.compressed else (seg.data,)
            moved = []
            for t in tensors:
                full_idx = idx.view(*idx.shape, *([1] * (t.dim() - 2))).expand(
                    idx.shape[0], idx.shape[1], *t.shape[2:])
                moved.append(self.tiers.gather_to_compute(t, seg.tier, full_idx, self.kind))
            if self.compressed:
                shape = (idx.shape[0], idx.shape[1], *self.shape[2:])
                parts.append(compression.decompress(compression.Packed(*moved, shape),
                                                    self.dtype))
            else:
                parts.append(moved[0])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def take(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """``out[n] = self[rows[n], cols[n]]`` on the compute device, for (row, column) pairs
        sorted by column (a tensor split along dim 1, like the KV cache); exactly those
        entries cross the links. ``rows`` and ``cols`` are CPU long tensors."""
        assert self.split_dim == 1
        parts = []
        for seg in self.segments:
            lo, hi = torch.searchsorted(cols, torch.tensor([seg.start, seg.stop])).tolist()
            if hi == lo:
                continue
            width = seg.stop - seg.start
            flat = rows[lo:hi] * width + (cols[lo:hi] - seg.start)
            flat = self.tiers.index_to_device(flat) if seg.tier == DEVICE else flat
            tensors = seg.data.parts if self.compressed else (seg.data,)
            moved = []
            for t in tensors:
                src, index = _rows_of(t, rows[lo:hi], cols[lo:hi] - seg.start, flat)
                moved.append(self.tiers.take_to_compute(src, seg.tier, index, self.kind))
            if self.compressed:
                shape = (hi - lo, *self.shape[2:])
                parts.append(compression.decompress(compression.Packed(*moved, shape),
                                                    self.dtype))
            else:
                parts.append(moved[0])
        if not parts:
            return torch.empty((0, *self.shape[2:]), dtype=self.dtype, device=self.tiers.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def write(self, src, rows: slice | None = None, src_tier: str = DEVICE) -> None:
        """Write ``src`` (all columns, rows ``rows`` along dim 0) from ``src_tier`` into place:
        floats, or the codes of a tensor with a ``layout`` (a Packed, kept as it is)."""
        sel = slice(None) if rows is None else rows
        if isinstance(src, compression.Blocks):
            self._write_blocks(src, sel, src_tier)
            return
        if isinstance(src, compression.Packed):
            assert self.layout[:2] == (src.bits, src.group), "codes of another form"
            for seg in self.segments:
                for dst, part in zip(seg.data.parts, src.parts):
                    piece = part.narrow(0, seg.start, seg.stop - seg.start)
                    self.tiers.write(dst[sel], seg.tier, piece.to(dst.dtype), self.kind,
                                     src_tier)
            return
        for seg in self.segments:
            piece = src.narrow(self.split_dim, seg.start, seg.stop - seg.start)
            if self.compressed:
                packed = compression.compress(piece)
                for dst, part in zip(seg.data.parts, packed.parts):
                    self.tiers.write(dst[sel], seg.tier, part, self.kind, src_tier)
            else:
                self.tiers.write(seg.data[sel], seg.tier, piece, self.kind, src_tier)


    def write_columns(self, src: torch.Tensor, rows: slice, cols: slice,
                      src_tier: str = DEVICE) -> None:
        """Write ``src`` (rows ``rows`` along dim 0, columns ``cols`` of dim 1 only) into
        place, each segment's share through its tier's link (counted): a KV cache's row of
        the block taking another sequence's keys. Uncompressed tensors split along dim 1."""
        assert not self.compressed and self.split_dim == 1, "columns of a float tensor"
        start, stop = cols.start, cols.stop
        for seg in self.segments:
            lo, hi = max(start, seg.start), min(stop, seg.stop)
            if lo >= hi:
                continue
            piece = src.narrow(1, lo - start, hi - lo)
            dst = seg.data[rows, lo - seg.start:hi - seg.start]
            self.tiers.write(dst, seg.tier, piece, self.kind, src_tier)

    def _write_blocks(self, src: compression.Blocks, sel: slice, src_tier: str) -> None:
        """A file's blocks into place: taken as they are where the tensor ``adopts`` them
        (its one segment then is the source's memory: nothing copied, held as host bytes),
        else copied to each segment's tier (each link counted), rows put in their output
        order first (a row ``order`` is a property of one whole tensor in one place)."""
        assert self.layout.kind == src.kind, "blocks of another type"
        if self.adopts and sel == slice(None):
            seg = self.segments[0]
            seg.data = src
            self.tiers.track(src.raw, seg.tier)
            self._packed = None
            return
        raw = src.raw if src.order is None else src.raw[src.order.long()]
        for seg in self.segments:
            piece = raw.narrow(0, seg.start, seg.stop - seg.start)
            self.tiers.write(seg.data.raw[sel], seg.tier, piece, self.kind, src_tier)


def _rows_of(t: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, flat: torch.Tensor):
    """``t`` ([rows, columns, ...], token-major or a head-major view) as one ``[n, ...]`` view
    of its storage, and where the (row, column) pairs are in it (``flat`` when token-major,
    without copying ``t`` when not)."""
    if t.is_contiguous():
        return t.reshape(-1, *t.shape[2:]), flat
    inner = math.prod(t.shape[2:])
    view = t.as_strided((t.shape[0] * t.shape[1], *t.shape[2:]), (inner, *t.stride()[2:]),
                        t.storage_offset())
    index = (rows * t.stride(0) + cols * t.stride(1)) // inner
    return view, index.to(flat.device)

