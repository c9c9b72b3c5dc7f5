"""The tensors of an index store (:mod:`.gguf_index`), read in place from the GGUF files it
names: each file mapped once, read-only, and each tensor a view of its bytes there.

The manifest's ``"files"`` holds each file's path, size and modification time as indexed,
and every tensor entry its ``"file"`` (a position in that list), ``"offset"`` and
``"bytes"``. A file that is gone, or whose size or time changed since (a rewrite may have
moved its tensors), or shorter than an entry's end, is a fault named before any tensor is
read: faults come from ``stat``, never from the data.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from . import gguf_codes

NUMPY = {"bfloat16": np.int16}  # stored dtypes numpy lacks: their bits


def rotary_order(rows: int, heads: int) -> np.ndarray:
    """Which stored row is each row of a llama q/k projection that llama.cpp interleaved
    per head for its rotary kernel (a head's two halves paired up row by row): row ``o``
    of Hugging Face's half-split layout is stored row ``order[o]``."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)


def picked_rows(runs) -> np.ndarray:
    """The row indices of ``(first, count)`` runs, in order."""
    return np.concatenate([np.arange(int(first), int(first) + int(count))
                           for first, count in runs])


def picked(info: dict) -> np.ndarray | None:
    """The stored rows an entry reads, when it picks some of a tensor's (else None)."""
    runs = info.get("rows")
    return None if runs is None else picked_rows(runs)


def entry_span(info: dict) -> int:
    """The bytes of the file the entry's tensor lies in (all its stored rows)."""
    rows = picked(info)
    if rows is None:
        return int(info["bytes"])
    return int(info["stored_rows"]) * (int(info["bytes"]) // len(rows))


def entry_bytes(info: dict) -> int:
    """The bytes a tensor of the entry's shape takes: its GGUF blocks, or its values."""
    shape, kind = info["shape"], info.get("gguf_type")
    if kind is not None:
        size, per = gguf_codes.BLOCKS[kind][:2]
        return math.prod(shape[:-1]) * (shape[-1] // per) * size
    return math.prod(shape) * np.dtype(NUMPY.get(info["dtype"], info["dtype"])).itemsize


class InPlaceFiles:
    """The GGUF files of one index store's manifest (``files``: its ``"files"`` list)."""

    def __init__(self, files: list):
        self.files = files
        self._maps: dict[int, np.memmap] = {}
        self._faults: dict[int, str | None] = {}

    def path(self, info: dict) -> str:
        return str(self.files[int(info["file"])]["path"])

    def _file_fault(self, i: int) -> str | None:
        """The file gone, or not at its indexed size and time; checked once a store."""
        if i not in self._faults:
            f = self.files[i]
            path = Path(f["path"])
            try:
                st = path.stat()
            except OSError:
                self._faults[i] = f"the GGUF file it reads in place, {path}, is missing"
            else:
                changed = (st.st_size, st.st_mtime_ns) != (int(f["size"]), int(f["mtime_ns"]))
                self._faults[i] = (f"the GGUF file it reads in place, {path}, changed since "
                                   "it was indexed (its size or time differ)" if changed
                                   else None)
        return self._faults[i]

    def fault(self, name: str, info: dict) -> str | None:
        """What is wrong with tensor ``name``'s entry ``info`` (None: nothing)."""
        try:
            i, start, count = int(info["file"]), int(info["offset"]), int(info["bytes"])
            fault = self._file_fault(i)
            if fault is not None:
                return fault
            need = entry_bytes(info)
            if count != need or start < 0:
                return f"tensor {name!r} is indexed as {count} bytes, its shape needs {need}"
            if start + entry_span(info) > int(self.files[i]["size"]):
                return (f"the GGUF file it reads in place, {self.files[i]['path']}, ends "
                        f"before tensor {name!r} does (cut short)")
        except (ValueError, KeyError, TypeError, IndexError) as e:
            return f"its index entry of {name!r} is damaged ({type(e).__name__})"
        return None

    def array(self, info: dict) -> np.ndarray:
        """The entry's bytes as stored, a read-only map of the file: blocks as uint8
        ``[rows, bytes a row]``, floats as their values (bf16 as int16 bits) in the shape
        (an entry that picks rows: a copy of them)."""
        i, start = int(info["file"]), int(info["offset"])
        if i not in self._maps:  # one map a file: a tensor is a view, not a mapping of its own
            self._maps[i] = np.memmap(self.files[i]["path"], np.uint8, mode="r")
        data, shape = self._maps[i][start:start + entry_span(info)], info["shape"]
        rows = picked(info)
        if rows is not None:  # some of a tensor's rows: copied, whole rows at a time
            data = data.reshape(int(info["stored_rows"]), -1)[rows].reshape(-1)
        if info.get("gguf_type"):
            return data.reshape(math.prod(shape[:-1]), -1)
        dtype = np.dtype(NUMPY.get(info["dtype"], info["dtype"]))
        if start % dtype.itemsize:  # a file aligned below the value size: values copied
            data = np.array(data)
        return data.view(dtype).reshape(shape)
