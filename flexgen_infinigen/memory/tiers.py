"""Memory tiers (compute device, host, disk) and the one place where data moves between them.

Every copy between tiers goes through :class:`Tiers`, which counts its bytes by
link (``disk->host``, ``host->device``, ``device->host``, ``host->disk``) and by
kind (``weights``, ``experts``: a mixture-of-experts model's routed experts, read only when
routed to, ``kv_cache``, ``activations``), and tracks how many bytes each
tier holds so that the report can give a peak per tier.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
import warnings
import weakref
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from . import mapped_rows
from .disk_io import ALIGN, DiskFiles
from .huge_pages import advise_huge_pages
from .offload_dir import DIR_PREFIX, OWNER_FILE, offload_root, remove_stale_folders

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)
LINKS = ("disk->host", "host->device", "device->host", "host->disk")
KINDS = ("weights", "experts", "kv_cache", "activations")

PAGE = 4096
# long-lived host buffers at least this large are allocated at their exact size and pinned in
# place; smaller ones come from PyTorch's caching host allocator (which rounds up to a power
# of two: a few bytes here, 1.7x the plan for the large segments of a big model)
EXACT_PIN_BYTES = 1 << 20
DEFERRED_MAX = 4096  # deferred byte counts kept before they are added up (on a CPU)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Tiers:
    """Owns the compute device, pinned host buffers, the disk folder, and the byte ledger."""

    def __init__(self, device: torch.device, offload_dir: str | None = None,
                 pin_host: bool | None = None, direct_io: bool = False,
                 host_in_place: bool = True):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        # on a CPU the host tier is the compute device's own memory: a KV cache held there is
        # read where it is (nothing crosses a link); False copies it as a GPU's link would
        self.host_in_place = host_in_place and not self.is_cuda
        self.pin_host = self.is_cuda if pin_host is None else (pin_host and self.is_cuda)
        # the compute device reads chosen rows of a host tensor by index itself (mapped_rows):
        # a GPU from pinned host memory, a CPU standing in for one (host_in_place false)
        self.maps_host = mapped_rows.enabled() and (
            (self.pin_host and mapped_rows.kernel_available()) if self.is_cuda
            else not self.host_in_place)
        self._mapped_checked = False  # the first GPU read is checked against a host gather
        self._row_stream = None
        self._deferred: list[tuple[str, str, torch.Tensor, float]] = []
        # freed exact-pinned blocks, still registered, for the next buffer of their size
        self.keep_pinned = True
        self._kept: list = []
        weakref.finalize(self, Tiers._unregister_kept, self._kept)
        self._offload_root = offload_dir
        self._disk_dir: str | None = None
        self._moved: dict[str, dict[str, int]] = {
            link: {kind: 0 for kind in KINDS} for link in LINKS}
        self.held = defaultdict(int)
        self.peak = defaultdict(int)
        self.host_syncs = 0  # reads of compute-device values by the host (syncs on a GPU)
        self.pinned_bytes = 0  # host bytes pinned at their exact size
        # cudaHostRegister's error code when it refused a buffer (then pinned by PyTorch's host
        # allocator instead, which rounds a buffer up to a power of two)
        self.register_error: int | None = None
        self._scratch: dict[str, list] = {}
        self._scratch_lock = threading.Lock()
        self._lock = threading.Lock()  # the ledger is updated from the lanes' threads too
        self.disk = DiskFiles(lambda: self.disk_dir, direct_io)

    # ---- accounting -------------------------------------------------------------------------
    def count(self, link: str, kind: str, n: int) -> None:
        with self._lock:
            self._moved[link][kind] += n

    @property
    def bytes_moved(self) -> dict[str, dict[str, int]]:
        """Bytes moved by link and kind (the deferred counts added first)."""
        self.settle()
        return self._moved

    def _hold(self, tier: str, n: int) -> None:
        with self._lock:
            self.held[tier] += n
            if self.held[tier] > self.peak[tier]:
                self.peak[tier] = self.held[tier]

    def reset_peak(self) -> None:
        """Peaks restart from what is held now (a run's peak leaves out loading)."""
        with self._lock:
            for tier in TIERS:
                self.peak[tier] = self.held[tier]
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def host_values(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Compute-device tensors read by the host: one synchronization on a GPU, counted
        (``host_syncs``) so that the syncs of a decode step can be asserted, on a CPU too."""
        with self._lock:
            self.host_syncs += 1
        return [t.cpu() for t in tensors]

    def host_values_async(self, *tensors: torch.Tensor):
        """Start copying compute-device tensors to the host on the current stream; returns a
        function that waits for them (the one counted sync) and gives the host copies."""
        if not self.is_cuda:
            done, host = None, list(tensors)
        else:
            host = [self.host_empty(t.shape, t.dtype, staging=True).copy_(t, non_blocking=True)
                    for t in tensors]
            done = torch.cuda.current_stream().record_event()

        def wait() -> list[torch.Tensor]:
            if done is not None:
                done.synchronize()
            self.count_sync()
            return host
        return wait

    def index_to_device(self, index: torch.Tensor) -> torch.Tensor:
        """A small host tensor (indices) on the compute device, through pinned memory and
        without a host wait."""
        if not self.is_cuda or index.is_cuda:
            return index
        staged = self.host_empty(index.shape, index.dtype, staging=True).copy_(index)
        return staged.to(self.device, non_blocking=True)

    def count_deferred(self, link: str, kind: str, rows: torch.Tensor, row_bytes: float) -> None:
        """Count the sum of ``rows`` (a device tensor of row counts: reading it now would be
        a host sync) times ``row_bytes`` once the step has synchronized (:meth:`settle`)."""
        with self._lock:
            self._deferred.append((link, kind, rows, row_bytes))
            fold = len(self._deferred) >= DEFERRED_MAX and not rows.is_cuda
        if fold:  # on a CPU reading them waits for nothing
            self.settle()

    def settle(self) -> None:
        """Add the deferred counts (after a synchronization: reading them waits for nothing)."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
        # the same counts come back for every layer of a step (the mass rule's caps): each
        # tensor is summed once
        totals: dict[tuple, list] = {}
        for link, kind, rows, row_bytes in deferred:
            entry = totals.setdefault((link, kind, id(rows)), [rows, 0.0])
            entry[1] += row_bytes
        for (link, kind, _), (rows, row_bytes) in totals.items():
            self.count(link, kind, round(int(rows.sum()) * row_bytes))

    def on_row_stream(self, fn, *inputs: torch.Tensor):
        """``fn()`` issued at once on a side stream that waits only for what the compute
        stream issued so far (on a CPU: run here). Returns ``(value, done)``: ``done`` is the
        event a user of ``value`` waits on (:meth:`wait_rows`), None on a CPU."""
        if not self.is_cuda:
            return fn(), None
        from .lanes import _record_on
        compute = torch.cuda.current_stream()
        if self._row_stream is None:
            self._row_stream = torch.cuda.Stream(self.device)
        stream = self._row_stream
        stream.wait_event(compute.record_event())
        _record_on(list(inputs), stream)  # not reused before the row reads are done
        with torch.cuda.stream(stream):
            value = fn()
            done = stream.record_event()
        _record_on(value, compute)  # nor the rows before the compute stream has used them
        return value, done

    @staticmethod
    def wait_rows(done) -> None:
        """The current stream waits (on the device, not the host) for :meth:`on_row_stream`'s
        work."""
        if done is not None:
            torch.cuda.current_stream().wait_event(done)

    def gather_mapped(self, src: torch.Tensor, index: torch.Tensor, counts: torch.Tensor,
                      cols: int, out: torch.Tensor) -> bool:
        """Rows ``src[index]`` of a host tensor read by the compute device into ``out`` (see
        :mod:`.mapped_rows`); the caller counts the bytes. False where the device cannot
        (the first GPU read is compared against a host gather; a mismatch or an error turns
        the mapped reads off for this run, and the caller gathers on the host)."""
        if not self.maps_host:
            return False
        try:
            mapped_rows.gather(src, index, counts, cols, out)
        except Exception as e:  # noqa: BLE001 (any failure: the host gather still works)
            self._mapping_failed(f"the mapped row read failed ({e!r})")
            return False
        if self.is_cuda and not self._mapped_checked:
            self._mapped_checked = True
            rank = torch.arange(out.shape[0], device=out.device) // cols
            keep = (rank < counts.reshape(-1).repeat(out.shape[0] // cols)).cpu()
            expect = src.index_select(0, index.cpu()[keep])
            if not torch.equal(out[keep.to(out.device)].cpu(), expect):
                self._mapping_failed("the mapped row read disagreed with a host gather")
                return False
        return True

    def _mapping_failed(self, why: str) -> None:
        import warnings
        self.maps_host = False
        warnings.warn(f"{why}: chosen KV rows are gathered on the host from now on "
                      f"(set {mapped_rows.ENV}=0 to skip trying)", RuntimeWarning, stacklevel=3)

    def count_sync(self) -> None:
        """A synchronization made elsewhere (an event wait, a device synchronize)."""
        with self._lock:
            self.host_syncs += 1

    def track(self, t: torch.Tensor, tier: str) -> torch.Tensor:
        """Count ``t`` as held by ``tier`` until it is garbage collected."""
        n = nbytes(t)
        self._hold(tier, n)
        weakref.finalize(t, self._hold, tier, -n)
        return t

    def reset_counters(self) -> None:
        with self._lock:
            self._deferred = []
        for per_kind in self._moved.values():
            for kind in per_kind:
                per_kind[kind] = 0

    # ---- allocation -------------------------------------------------------------------------
    @property
    def disk_dir(self) -> str:
        """This run's own folder under the offload root, with a pid file so that a later run
        removes it if this process dies without its cleanup (SIGKILL); removed at exit."""
        if self._disk_dir is None:
            root = offload_root(self._offload_root)
            remove_stale_folders(root)
            folder = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=root)
            (Path(folder) / OWNER_FILE).write_text(str(os.getpid()))
            self._disk_dir = folder
            self._cleanup = weakref.finalize(self, shutil.rmtree, folder, True)
        return self._disk_dir

    def empty(self, tier: str, shape, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
        if tier == DEVICE:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            if not self.is_cuda:
                advise_huge_pages(t)
        elif tier == HOST:
            t = self.host_empty(shape, dtype, pinned=pin)
            if not self.is_cuda:
                advise_huge_pages(t)
        else:
            count = int(np.prod(shape)) if len(shape) else 1
            t = self.disk.allocate(count, dtype).view(shape)
        return self.track(t, tier)

    def host_empty(self, shape, dtype: torch.dtype, pinned: bool = True,
                   staging: bool = False) -> torch.Tensor:
        """A host tensor, page-locked when the compute device is a GPU and ``pinned``.

        Long-lived buffers of ``EXACT_PIN_BYTES`` or more are allocated at their exact size
        and registered with CUDA (their own pages only); ``staging`` buffers (short-lived,
        reused) and small ones come from PyTorch's caching host allocator.
        """
        if not (self.pin_host and pinned):
            return torch.empty(shape, dtype=dtype)
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if staging or n < EXACT_PIN_BYTES:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        return self._pinned_exact(shape, dtype, n)

    def _pinned_exact(self, shape, dtype: torch.dtype, n: int) -> torch.Tensor:
        size = -(-n // PAGE) * PAGE  # whole pages, all inside ``raw``: no page is shared
        cudart = torch.cuda.cudart()
        block = self._kept_block(size, cudart)
        if block is None:
            raw = torch.empty(size + 2 * PAGE, dtype=torch.uint8)
            offset = -raw.data_ptr() % PAGE
            ptr = raw.data_ptr() + offset
            code = int(cudart.cudaHostRegister(ptr, size, 0))
            if code != 0:
                if self.register_error is None:
                    warnings.warn(f"cudaHostRegister refused {size / 1e9:.2f} GB (CUDA error "
                                  f"{code}); pinning through PyTorch's host allocator, which "
                                  "rounds each buffer up to a power of two", RuntimeWarning,
                                  stacklevel=2)
                self.register_error = code
                return torch.empty(shape, dtype=dtype, pin_memory=True)
            block = (raw, offset, ptr, size)
        raw, offset, ptr, size = block
        t = raw[offset:offset + n].view(dtype).view(shape)
        with self._lock:
            self.pinned_bytes += size
        weakref.finalize(t, self._unpin, cudart, block, self._kept)
        return t

    def _kept_block(self, size: int, cudart):
        """A registered block kept from a freed buffer of this exact size (the KV cache of
        the next generation with the same shapes: registering tens of GB again costs as much
        as copying them). A miss unregisters what is kept, so nothing is held twice."""
        with self._lock:
            for i, block in enumerate(self._kept):
                if block[3] == size:
                    return self._kept.pop(i)
            kept, self._kept[:] = list(self._kept), []
        for block in kept:
            cudart.cudaHostUnregister(block[2])
        return None

    def _unpin(self, cudart, block, kept: list) -> None:
        """A pinned buffer was freed: its block stays registered, kept for the next buffer
        of its size, until :meth:`close` (or a miss) unregisters it."""
        with self._lock:
            self.pinned_bytes -= block[3]
            if self.keep_pinned:
                kept.append(block)
                return
        cudart.cudaHostUnregister(block[2])

    @staticmethod
    def _unregister_kept(kept: list) -> None:
        if kept:
            cudart = torch.cuda.cudart()
            for block in kept:
                cudart.cudaHostUnregister(block[2])
            kept.clear()

    SCRATCH_SLOTS = 3  # buffers in flight per tag: the one computing, the next load, a spare

    def scratch(self, tag: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """A compute-device buffer for data read again at every decode step (uninitialized
        on CUDA; on a CPU zeros at first, then whatever the tag's earlier steps wrote).

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
                # zeros, not garbage: padding rows that attention masks must stay finite
                buf = self.track(torch.zeros(numel, dtype=dtype, device=self.device), DEVICE)
                ring[slot] = buf
        return buf[:numel].view(shape)

    def close(self) -> None:
        self.keep_pinned = False
        with self._lock:
            kept, self._kept[:] = list(self._kept), []
        self._unregister_kept(kept)
        self.disk.close()
        if self._disk_dir is not None:
            shutil.rmtree(self._disk_dir, ignore_errors=True)
            self._disk_dir = None

    # ---- transfers --------------------------------------------------------------------------
    def to_compute(self, src: torch.Tensor, tier: str, kind: str) -> torch.Tensor:
        """Bring a tensor held in ``tier`` to the compute device (a view when already there)."""
        if tier == DEVICE:
            return src
        return self._upload(self._read_disk(src) if tier == DISK else src, tier, kind)

    def _read_disk(self, src: torch.Tensor) -> torch.Tensor:
        """A disk tensor in a fresh host buffer (pinned on CUDA), read in large requests."""
        if self.is_cuda:
            out = self.host_empty(src.shape, src.dtype, staging=True)
        else:  # aligned, so that O_DIRECT reads land in it without a bounce
            raw = torch.empty(nbytes(src) + ALIGN, dtype=torch.uint8)
            start = -raw.data_ptr() % ALIGN
            out = raw[start:start + nbytes(src)].view(src.dtype).view(src.shape)
        if not self.disk.read_into(out, src):
            out.copy_(src)
        return out

    def _upload(self, host: torch.Tensor, tier: str, kind: str) -> torch.Tensor:
        """Copy ``host`` (in host memory, read from ``tier``) to the compute device, counting
        the bytes of each link it crossed. A buffer read from disk is already new memory:
        on a CPU it becomes the device's copy as it is."""
        self.count("host->device", kind, nbytes(host))
        if tier == DISK:
            self.count("disk->host", kind, nbytes(host))
            if not self.is_cuda:
                return self.track(host, DEVICE)
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        out.copy_(host, non_blocking=self.is_cuda)
        return self.track(out, DEVICE)

    def gather_to_compute(self, src: torch.Tensor, tier: str, index: torch.Tensor,
                          kind: str) -> torch.Tensor:
        """``src.gather(0, index)`` brought to the compute device; only gathered rows move.

        Off the device, the rows are gathered on the host into a (pinned) staging buffer
        and copied from there; ``index`` must then live on the CPU.
        """
        if tier == DEVICE:
            return src.gather(0, index)
        staged = self.host_empty(index.shape, src.dtype, staging=True)
        torch.gather(src, 0, index, out=staged)
        return self._upload(staged, tier, kind)

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
        staged = self.host_empty(shape, src.dtype, staging=True)
        torch.index_select(src, 0, index, out=staged)
        out = torch.empty(shape, dtype=src.dtype, device=self.device)
        out.copy_(staged, non_blocking=True)
        return self.track(out, DEVICE)

    def to_host(self, src: torch.Tensor, tier: str, kind: str) -> torch.Tensor:
        """Bring a tensor held in ``tier`` to host memory (for compute on the CPU)."""
        if tier == HOST:
            return src
        if tier == DISK:
            self.count("disk->host", kind, nbytes(src))
            return self._read_disk(src)
        out = self.host_empty(src.shape, src.dtype, staging=True)
        out.copy_(src)
        self.count("device->host", kind, nbytes(src))
        return out

    def write(self, dst: torch.Tensor, tier: str, src: torch.Tensor, kind: str,
              src_tier: str = DEVICE) -> None:
        """Copy ``src`` (in ``src_tier``) into ``dst`` (in ``tier``), counting each link."""
        n = nbytes(src)
        if tier == src_tier:
            dst.copy_(src)
            return
        if tier == DEVICE:  # from host (or disk, through a pinned staging buffer)
            if src_tier == DISK:
                self.count("disk->host", kind, n)
                if self.is_cuda or not self.disk.read_into(dst, src):
                    src = self._read_disk(src)
                    dst.copy_(src, non_blocking=self.is_cuda)
            else:
                dst.copy_(src, non_blocking=self.is_cuda)
            self.count("host->device", kind, n)
            return
        if src_tier == DEVICE:
            self.count("device->host", kind, n)
            if self.is_cuda and tier == DISK:  # through pinned memory; the file needs the host
                staged = self.host_empty(src.shape, src.dtype, staging=True)
                staged.copy_(src, non_blocking=True)
                torch.cuda.current_stream().synchronize()
                self.count_sync()
                src = staged
            elif self.is_cuda and kind == "activations" and dst.is_pinned():
                # only read back by a copy to the device on the same stream: no host wait
                # (KV rows are read by the host, in gathers: their copies stay blocking)
                dst.copy_(src, non_blocking=True)
                return
        elif src_tier == DISK:  # disk to host memory
            self.count("disk->host", kind, n)
            if not self.disk.read_into(dst, src):
                dst.copy_(self._read_disk(src))
            return
        if tier == DISK:
            self.count("host->disk", kind, n)
            if self.disk.write_from(dst, src):
                return
        dst.copy_(src)

