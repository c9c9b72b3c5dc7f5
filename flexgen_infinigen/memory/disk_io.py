"""The disk tier's files, read and written in large requests, not through page faults.

Each disk tensor is a file in the run's offload folder, its blocks reserved when it is
created. It is also memory-mapped, for the one access that needs it (gathers of scattered
rows), but whole-tensor and row-range reads go through ``preadv`` on a file descriptor into
the caller's buffer (never faulted into the process's memory map, so its resident memory does
not grow with the model), in requests of ``REQUEST_BYTES`` of which ``READERS`` are in flight:
buffered by default, or with ``O_DIRECT`` (``direct=True``: no page cache either) for the
aligned part of a request and buffered for the rest. Writes are ``pwrite`` calls. An I/O
error or a short read is one :class:`OffloadIOError` naming the file.
"""
from __future__ import annotations

import bisect
import ctypes
import errno
import os
import threading
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..config import ConfigError

ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffer addresses in whole blocks
REQUEST_BYTES = 16 << 20
# tensors up to SMALL_BYTES share files of SHARED_FILE_BYTES (descriptors are limited: a file
# holds two, and a MoE model has tens of thousands of expert tensors)
SMALL_BYTES = 16 << 20
SHARED_FILE_BYTES = 256 << 20
READERS = 4
_NUMPY_STORAGE = {torch.float32: np.float32, torch.float16: np.float16,
                  torch.bfloat16: np.int16, torch.uint8: np.uint8, torch.int8: np.int8,
                  torch.int64: np.int64}


class OffloadIOError(ConfigError):
    """Reading or writing an offload file failed (one line, naming the file)."""


@dataclass(eq=False)
class DiskFile:
    path: str
    base: int  # address of the memory map's first byte
    size: int
    fd: int  # buffered, read and write
    direct_fd: int | None  # O_DIRECT, read only; None where the filesystem refuses it


@dataclass(eq=False)
class _SharedFile:
    """A file that holds many small tensors, each a block-aligned piece of it."""

    entry: DiskFile
    arr: np.memmap  # the whole file, as bytes
    used: int = 0
    live: int = 0  # pieces not yet freed


def _buffer(t: torch.Tensor):
    """A writable byte view of a contiguous CPU tensor's memory (pinned or not)."""
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


class DiskFiles:
    """The files of one run's disk tier, and every read and write that moves whole rows."""

    def __init__(self, folder, direct: bool = False):
        self._folder = folder  # a callable: the folder is made on first use
        self.direct = direct
        self._files: list[DiskFile] = []
        self._bases: list[int] = []
        self._lock = threading.Lock()
        self._piece_lock = threading.Lock()
        # threads start on first use; read by every lane that reads the disk
        self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="disk-read")
        self.direct_bytes = self.buffered_bytes = 0  # what was read each way
        self.created = 0  # tensors made so far (each file is removed when its tensors are)
        self._shared: _SharedFile | None = None  # the shared file small tensors go to now

    # ---- files ------------------------------------------------------------------------------
    def allocate(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """``count`` elements on disk (blocks reserved now: a full disk is one clear error
        here, never a bus error later), as a flat memory-mapped tensor: a file of its own,
        or, when small, a block-aligned piece of a shared file (a model of tens of thousands
        of small tensors, a MoE's experts, would otherwise need two descriptors each)."""
        storage = _NUMPY_STORAGE[dtype]
        size = max(count, 1) * np.dtype(storage).itemsize
        with self._lock:
            self.created += 1
        if size <= SMALL_BYTES:
            return self._piece(size, storage, count, dtype)
        arr, _ = self._new_file(size, storage)
        # when the last view is gone the file goes too (and a later map may reuse the address)
        return torch.from_numpy(arr)[:count].view(dtype)

    def _piece(self, size: int, storage, count: int, dtype: torch.dtype) -> torch.Tensor:
        with self._piece_lock:  # one shared file filled at a time
            with self._lock:
                shared = self._shared
            if shared is None or shared.used + size > SHARED_FILE_BYTES:
                try:
                    arr, entry = self._new_file(SHARED_FILE_BYTES, np.uint8, release=False)
                except ConfigError:  # no room for a shared file: this one alone may fit
                    return torch.from_numpy(self._new_file(size, storage)[0])[:count].view(
                        dtype)
                shared = _SharedFile(entry, arr)
            with self._lock:
                self._shared = shared
                start, shared.used = shared.used, shared.used + -(-size // ALIGN) * ALIGN
                shared.live += 1
        piece = shared.arr[start:start + size].view(storage)
        weakref.finalize(piece, self._release_piece, shared)
        return torch.from_numpy(piece)[:count].view(dtype)

    def _release_piece(self, shared: "_SharedFile") -> None:
        """A piece of a shared file is gone; the file goes with its last piece (a new one
        is started for the next small tensor)."""
        with self._lock:
            shared.live -= 1
            if shared.live:
                return
            if self._shared is shared:
                self._shared = None
        self._release(shared.entry)

    def _new_file(self, size: int, storage, release: bool = True):
        """(flat memory map, entry) of a new file of ``size`` bytes; ``release``: the file
        goes when the map does."""
        path = os.path.join(self._folder(), uuid.uuid4().hex + ".bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                os.close(fd)
                os.unlink(path)
                raise ConfigError(
                    f"the offload folder {self._folder()} has no room for {size / 2**30:.2f} "
                    "GiB more (disk full); free space there or point --offload-dir at another "
                    "disk") from None
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                os.close(fd)
                raise
            os.ftruncate(fd, size)  # the filesystem cannot reserve: a sparse file
        direct_fd = None
        if self.direct and hasattr(os, "O_DIRECT"):
            try:
                direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:  # tmpfs and some others: buffered reads only
                direct_fd = None
        arr = np.memmap(path, dtype=storage, mode="r+",
                        shape=(size // np.dtype(storage).itemsize,))
        entry = DiskFile(path, arr.ctypes.data, size, fd, direct_fd)
        with self._lock:
            i = bisect.bisect(self._bases, entry.base)
            self._bases.insert(i, entry.base)
            self._files.insert(i, entry)
        if release:
            weakref.finalize(arr, self._release, entry)
        return arr, entry

    def _release(self, entry: DiskFile) -> None:
        with self._lock:
            if entry not in self._files:
                return  # closed already
            i = self._files.index(entry)
            del self._files[i], self._bases[i]
        self._close(entry)
        try:
            os.unlink(entry.path)
        except OSError:
            pass

    @staticmethod
    def _close(entry: DiskFile) -> None:
        for fd in (entry.fd, entry.direct_fd):
            if fd is not None:
                os.close(fd)

    def locate(self, t: torch.Tensor) -> tuple[DiskFile, int] | None:
        """The file holding the contiguous tensor ``t`` and ``t``'s offset in it."""
        if not t.is_contiguous() or t.device.type != "cpu":
            return None
        ptr = t.data_ptr()
        with self._lock:
            i = bisect.bisect(self._bases, ptr) - 1
            if i < 0:
                return None
            f = self._files[i]
        end = ptr + t.numel() * t.element_size()
        return (f, ptr - f.base) if end <= f.base + f.size else None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            files, self._files, self._bases = self._files, [], []
        for f in files:
            self._close(f)

    # ---- reads and writes -------------------------------------------------------------------
    def read_into(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Copy the disk tensor ``src`` into the contiguous CPU tensor ``dst``; False when
        ``src`` is not a contiguous piece of a disk file (the caller copies it instead)."""
        where = self.locate(src)
        if where is None or not dst.is_contiguous() or dst.device.type != "cpu":
            return False
        f, offset = where
        n = src.numel() * src.element_size()
        if n == 0:
            return True
        buf = memoryview(_buffer(dst)).cast("B")
        requests = [(pos, min(REQUEST_BYTES, n - pos)) for pos in range(0, n, REQUEST_BYTES)]
        if len(requests) == 1:
            self._read(f, offset, buf, 0, n)
            return True
        for job in [self._pool.submit(self._read, f, offset, buf, pos, size)
                    for pos, size in requests]:
            job.result()
        return True

    def _read(self, f: DiskFile, offset: int, buf: memoryview, pos: int, size: int) -> None:
        """``size`` bytes at file offset ``offset + pos`` into ``buf[pos:]``: the aligned
        middle with O_DIRECT when the buffer's address lines up with the file's, the rest
        buffered."""
        start, stop = offset + pos, offset + pos + size
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf, pos))
        direct = f.direct_fd is not None and (addr - start) % ALIGN == 0
        lo, hi = (-(-start // ALIGN) * ALIGN, stop // ALIGN * ALIGN) if direct else (stop, stop)
        if hi > lo:
            self._pread(f, f.direct_fd, buf, pos + lo - start, hi - lo, lo)
            with self._lock:
                self.direct_bytes += hi - lo
            self._pread(f, f.fd, buf, pos, lo - start, start)
            self._pread(f, f.fd, buf, pos + hi - start, stop - hi, hi)
        else:
            self._pread(f, f.fd, buf, pos, size, start)
        with self._lock:
            self.buffered_bytes += size - max(0, hi - lo)

    @staticmethod
    def _pread(f: DiskFile, fd: int, buf: memoryview, pos: int, size: int, at: int) -> None:
        done = 0
        while done < size:
            try:
                got = os.preadv(fd, [buf[pos + done:pos + size]], at + done)
            except OSError as e:
                raise OffloadIOError(f"reading the offload file {f.path} failed: "
                                     f"{e.strerror} (errno {e.errno})") from None
            if got == 0:
                raise OffloadIOError(f"short read from the offload file {f.path}: {done} of "
                                     f"{size} bytes at offset {at} (was it truncated?)")
            done += got

    def write_from(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Write the CPU tensor ``src`` into the disk tensor ``dst`` with ``pwrite``; False
        when ``dst`` is not a contiguous piece of a disk file."""
        where = self.locate(dst)
        if where is None:
            return False
        f, offset = where
        src = src.contiguous()
        buf = memoryview(_buffer(src)).cast("B")
        done = 0
        while done < len(buf):
            try:
                done += os.pwrite(f.fd, buf[done:], offset + done)
            except OSError as e:
                raise OffloadIOError(f"writing the offload file {f.path} failed: "
                                     f"{e.strerror} (errno {e.errno})") from None
        return True
