"""Chosen K/V rows read by the compute device straight from host memory, by index.

InfiniGen chooses a few rows of a KV cache held in CPU memory. Gathering them on the host
needs their indices on the host: a device-to-host copy and a host wait per layer before the
gather and the copy up can even start. Here the indices never leave the device: a GPU kernel
reads each chosen row from the pinned (page-locked, mapped into the device's address space)
host KV over the link and writes it into the device buffer that attention reads, on a stream
that waits only for the speculation that produced the indices.

* CUDA: a Triton kernel (torch ships Triton with its CUDA builds). Triton takes a pinned host
  tensor as a pointer argument: its launcher asks the driver for the device address of the
  host pages (``cuPointerGetAttribute``), so the kernel's loads are reads over the link. One
  program per output row; rows past their KV head's count are not read (zeros are written),
  so only the chosen rows cross the link.
* CPU (``--host-in-place false``, where the host tier stands for a GPU's host memory): the
  CPU can address host memory, so the same call is ``index_select``: the decode path has the
  GPU's structure (no host wait between speculation and the row load), which tests check.

``FLEXGEN_MAPPED_ROWS=0`` turns it off (the rows are gathered on the host, as before).
"""
from __future__ import annotations


import torch
from ..switches import MAPPED_ROWS

ENV = MAPPED_ROWS.name

_kernel = None  # the compiled Triton function, or False where Triton is missing


def enabled() -> bool:
    return MAPPED_ROWS.get()


def _triton_kernel():
    global _kernel
    if _kernel is None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _kernel = False
            return _kernel

        @triton.jit
        def gather_rows(src, index, counts, out, cols, d, BLOCK_D: tl.constexpr):
            r = tl.program_id(0).to(tl.int64)  # output row: rank * cols + column
            count = tl.load(counts + r % cols)
            row = tl.load(index + r, mask=(r // cols) < count, other=0)
            offs = tl.arange(0, BLOCK_D)
            inside = offs < d
            # the row's test as a block, not a scalar: Triton's interpreter cannot combine a
            # scalar mask with a block one (the compiled kernel can)
            keep = (offs * 0 + r // cols) < count
            vals = tl.load(src + row * d + offs, mask=inside & keep, other=0.0)
            tl.store(out + r * d + offs, vals, mask=inside)

        _kernel = gather_rows
    return _kernel


def kernel_available() -> bool:
    """Whether a CUDA device can read chosen rows from pinned host memory here."""
    return enabled() and torch.cuda.is_available() and bool(_triton_kernel())


def gather(src: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, cols: int,
           out: torch.Tensor) -> None:
    """``out[r] = src[index[r]]`` for output rows ``r = rank * cols + column`` with ``rank <
    counts[column]`` (zeros elsewhere on CUDA; on a CPU every row is read). ``src [N, d]``
    lives in host memory (pinned on CUDA), ``index [M]`` int64 and ``counts [cols]`` on the
    compute device, ``out [M, d]`` on the compute device, all contiguous."""
    if not out.is_cuda:
        torch.index_select(src, 0, index, out=out)
        return
    launch(src, index, counts, cols, out)


def launch(src: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, cols: int,
           out: torch.Tensor) -> None:
    """The Triton kernel on :func:`gather`'s arguments (a CUDA device's path; on CPU tensors
    under ``TRITON_INTERPRET=1``, Triton's interpreter, as the tests run it)."""
    d = src.shape[-1]
    block = triton_next_power_of_2(d)
    _triton_kernel()[(out.shape[0],)](src, index, counts, out, cols, d, BLOCK_D=block,
                                      num_warps=1 if block <= 256 else 4)


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
