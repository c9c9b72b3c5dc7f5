"""Memory tiers (compute device, host, disk) and the one place where data moves between them.

Every copy between tiers goes through :class:`Tiers`, which counts its bytes by
link (``disk->host``, ``host->device``, ``device->host``, ``host->disk``) and by
kind (``weights``, ``kv_cache``, ``activations``), and tracks how many bytes each
tier holds so that the report can give a peak per tier.
"""
from __future__ import annotations

import os
import shutil
import threading
import tempfile
import uuid
import weakref
from collections import defaultdict

import numpy as np
import torch

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)
LINKS = ("disk->host", "host->device", "device->host", "host->disk")
KINDS = ("weights", "kv_cache", "activations")

_NUMPY_STORAGE = {torch.float32: np.float32, torch.float16: np.float16,
                  torch.bfloat16: np.int16, torch.uint8: np.uint8, torch.int64: np.int64}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Tiers:
    """Owns the compute device, pinned host buffers, the disk folder, and the byte ledger."""

    def __init__(self, device: torch.device, offload_dir: str | None = None,
                 pin_host: bool | None = None):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.pin_host = self.is_cuda if pin_host is None else (pin_host and self.is_cuda)
        self._offload_root = offload_dir
        self._disk_dir: str | None = None
        self.bytes_moved: dict[str, dict[str, int]] = {
            link: {kind: 0 for kind in KINDS} for link in LINKS}
        self.held = defaultdict(int)
        self.peak = defaultdict(int)
        self._scratch: dict[str, list] = {}
        self._scratch_lock = threading.Lock()

    # ---- accounting -------------------------------------------------------------------------
    def count(self, link: str, kind: str, n: int) -> None:
        self.bytes_moved[link][kind] += n

    def _hold(self, tier: str, n: int) -> None:
        self.held[tier] += n
        if self.held[tier] > self.peak[tier]:
            self.peak[tier] = self.held[tier]

    def track(self, t: torch.Tensor, tier: str) -> torch.Tensor:
        """Count ``t`` as held by ``tier`` until it is garbage collected."""
        n = nbytes(t)
        self._hold(tier, n)
        weakref.finalize(t, self._hold, tier, -n)
        return t

    def reset_counters(self) -> None:
        for per_kind in self.bytes_moved.values():
            for kind in per_kind:
                per_kind[kind] = 0

    # ---- allocation -------------------------------------------------------------------------
    @property
    def disk_dir(self) -> str:
        if self._disk_dir is None:
            root = self._offload_root or tempfile.gettempdir()
            os.makedirs(root, exist_ok=True)
            self._disk_dir = tempfile.mkdtemp(prefix="flexgen_infinigen-", dir=root)
        return self._disk_dir

    def empty(self, tier: str, shape, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
        if tier == DEVICE:
            t = torch.empty(shape, dtype=dtype, device=self.device)
        elif tier == HOST:
            t = torch.empty(shape, dtype=dtype, pin_memory=self.pin_host and pin)
        else:
            path = os.path.join(self.disk_dir, uuid.uuid4().hex + ".bin")
            count = int(np.prod(shape)) if len(shape) else 1
            arr = np.memmap(path, dtype=_NUMPY_STORAGE[dtype], mode="w+", shape=(max(count, 1),))
            t = torch.from_numpy(arr)[:count].view(dtype).view(shape)
        return self.track(t, tier)

    SCRATCH_SLOTS = 3  # buffers in flight per tag: the one computing, the next load, a spare

    def scratch(self, tag: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized compute-device buffer for data read again at every decode step.

        On CUDA a plain allocation (the caching allocator reuses its blocks). On a CPU each
        tag cycles through a few buffers kept between steps: a fresh large allocation there
        is new memory from the kernel, whose page faults cost as much as the copy into it.
        """
        if self.is_cuda:
            return self.track(torch.empty(shape, dtype=dtype, device=self.device), DEVICE)
        numel = int(np.prod(shape))
        with self._scratch_lock:
            ring = self._scratch.setdefault(tag, [0])
            ring[0] = (ring[0] + 1) % self.SCRATCH_SLOTS
            slot = 1 + ring[0]
            while len(ring) <= slot:
                ring.append(None)
            buf = ring[slot]
            if buf is None or buf.dtype != dtype or buf.numel() < numel:
                buf = self.track(torch.empty(numel, dtype=dtype, device=self.device), DEVICE)
                ring[slot] = buf
        return buf[:numel].view(shape)

    def close(self) -> None:
        if self._disk_dir is not None:
            shutil.rmtree(self._disk_dir, ignore_errors=True)
            self._disk_dir = None

    # ---- transfers --------------------------------------------------------------------------
    def to_compute(self, src: torch.Tensor, tier: str, kind: str) -> torch.Tensor:
        """Bring a tensor held in ``tier`` to the compute device (a view when already there)."""
        if tier == DEVICE:
            return src
        if tier == DISK:
            staged = torch.empty(src.shape, dtype=src.dtype, pin_memory=self.pin_host)
            staged.copy_(src)
            self.count("disk->host", kind, nbytes(src))
            src = staged
        out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        out.copy_(src, non_blocking=self.is_cuda)
        self.count("host->device", kind, nbytes(src))
        return self.track(out, DEVICE)

    def gather_to_compute(self, src: torch.Tensor, tier: str, index: torch.Tensor,
                          kind: str) -> torch.Tensor:
        """``src.gather(0, index)`` brought to the compute device; only gathered rows move.

        Off the device, the rows are gathered on the host into a (pinned) staging buffer
        and copied from there; ``index`` must then live on the CPU.
        """
        if tier == DEVICE:
            return src.gather(0, index)
        staged = torch.empty(index.shape, dtype=src.dtype, pin_memory=self.pin_host)
        torch.gather(src, 0, index, out=staged)
        if tier == DISK:
            self.count("disk->host", kind, nbytes(staged))
        out = torch.empty(staged.shape, dtype=staged.dtype, device=self.device)
        out.copy_(staged, non_blocking=self.is_cuda)
        self.count("host->device", kind, nbytes(staged))
        return self.track(out, DEVICE)

    def take_to_compute(self, src: torch.Tensor, tier: str, index: torch.Tensor,
                        kind: str) -> torch.Tensor:
        """``src[index]`` (rows along dim 0) on the compute device; only those rows move.

        Off the device the rows are gathered on the host into a (pinned) staging buffer and
        copied from there; ``index`` must then live on the CPU.
        """
        if tier == DEVICE:
            return src.index_select(0, index)
        shape = (index.shape[0], *src.shape[1:])
        n = int(np.prod(shape)) * src.element_size()
        if tier == DISK:
            self.count("disk->host", kind, n)
        self.count("host->device", kind, n)
        if not self.is_cuda:  # the compute device is host memory: gather straight into place
            return self.track(torch.index_select(src, 0, index), DEVICE)
        staged = torch.empty(shape, dtype=src.dtype, pin_memory=self.pin_host)
        torch.index_select(src, 0, index, out=staged)
        out = torch.empty(shape, dtype=src.dtype, device=self.device)
        out.copy_(staged, non_blocking=True)
        return self.track(out, DEVICE)

    def to_host(self, src: torch.Tensor, tier: str, kind: str) -> torch.Tensor:
        """Bring a tensor held in ``tier`` to host memory (for compute on the CPU)."""
        if tier == HOST:
            return src
        out = torch.empty(src.shape, dtype=src.dtype, pin_memory=self.pin_host)
        out.copy_(src)
        self.count("disk->host" if tier == DISK else "device->host", kind, nbytes(src))
        return out

    def write(self, dst: torch.Tensor, tier: str, src: torch.Tensor, kind: str,
              src_tier: str = DEVICE) -> None:
        """Copy ``src`` (in ``src_tier``) into ``dst`` (in ``tier``), counting each link."""
        n = nbytes(src)
        if tier == src_tier:
            dst.copy_(src)
            return
        if tier == DEVICE:  # from host (or disk, through host)
            if src_tier == DISK:
                self.count("disk->host", kind, n)
            dst.copy_(src, non_blocking=self.is_cuda)
            self.count("host->device", kind, n)
            return
        if src_tier == DEVICE:
            self.count("device->host", kind, n)
            if tier == DISK and self.is_cuda:
                src = src.to("cpu")
        elif src_tier == DISK:  # disk to host memory
            self.count("disk->host", kind, n)
        if tier == DISK:
            self.count("host->disk", kind, n)
        dst.copy_(src)
