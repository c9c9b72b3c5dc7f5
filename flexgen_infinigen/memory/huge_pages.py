"""Huge pages for the large CPU buffers of a run (weights, KV caches)."""
from __future__ import annotations

import ctypes
import sys

import torch
from ..switches import HUGE_PAGES

HUGE_PAGE = 2 << 20
HUGE_MIN_BYTES = 32 << 20
_MADV_HUGEPAGE = 14


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask Linux to back a large new CPU buffer (weights, a KV cache) with 2 MB pages before
    it is first written: where transparent huge pages are in ``madvise`` mode (a common
    default) it would otherwise get 4 KB pages, and a decode step that walks a cache's rows
    with a stride of the batch's width touches a new page at every row.
    ``FLEXGEN_INFINIGEN_HUGE_PAGES=0`` turns it off; elsewhere it does nothing."""
    n = t.numel() * t.element_size()
    if n < HUGE_MIN_BYTES or not HUGE_PAGES.get() \
            or not sys.platform.startswith("linux"):
        return
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the 2 MB pages inside the buffer
    end = (t.data_ptr() + n) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC


_LIBC = None
