"""Where weights come from when a model is loaded: a converted store, or dummy values."""
from __future__ import annotations

import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from ..config import ModelConfig
from ..memory.codes import CodeLayout
from ..models.moe import is_expert_weight
from . import gguf_codes
from .store import WeightStore


class StoreSource:
    """Tensors of a weight store, memory-mapped (a GGUF's index maps the file itself); a
    tensor kept as a quantized file's codes comes as the file's blocks
    (:class:`~flexgen_infinigen.memory.codes.Blocks`, for a CPU: its ``layout`` has a
    ``kind``) or as codes (:class:`~flexgen_infinigen.memory.codes.Packed`)."""

    def __init__(self, store: WeightStore):
        self.store = store

    def __call__(self, name: str, shape: tuple[int, ...], layout: CodeLayout | None = None):
        if layout is not None and layout.kind is not None:
            return self.store.blocks(name)
        if self.store.layout(name) is not None:
            return self.store.packed(name)
        return self.store.tensor(name)

    def layout(self, name: str, native: bool = False,
               native_experts: bool = False) -> CodeLayout | None:
        """The form ``name`` is placed in: None for floats; its blocks as stored when
        ``native`` (a CPU computes), the CPU kernels read its type and it is not a routed
        expert that the compiled MoE call reads as codes (a type of
        :data:`~.gguf_codes.MOE_CODES`, unless ``native_experts``: the model's experts never
        take that call); else codes."""
        if name not in self.store.tensors:
            return None
        kind = self.store.tensors[name].get("gguf_type")
        # a routed expert stays codes where the MoE stage's one compiled call may read them
        coded = is_expert_weight(name) and kind in gguf_codes.MOE_CODES and not native_experts
        if (native and kind in gguf_codes.NATIVE and len(self.store.tensors[name]["shape"]) == 2
                and not coded):
            return CodeLayout(*gguf_codes.layout(kind), False, kind)
        return self.store.layout(name)

    def formats(self) -> dict[str, str]:
        """Each tensor's stored format (``Q4_1``, ``Q8_0``, ``F32``, ...)."""
        return {name: self.store.format(name) for name in self.store.tensors}


DUMMY_CHUNK = 1 << 23  # elements; a smaller tensor is one generator's draw


class DummySource:
    """Seeded random weights in the model's true shapes (for models we cannot download).

    Matrices are normal with std 0.02 (the usual initialization scale), norm scales
    are one and biases zero, so activations stay in a realistic range.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0, std: float = 0.02):
        self.cfg, self.seed, self.std = cfg, seed, std

    def __call__(self, name: str, shape: tuple[int, ...], layout=None) -> torch.Tensor:
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if len(shape) == 1:
            return torch.ones(shape)
        seed = self.seed * 1_000_003 + zlib.crc32(name.encode())
        n = math.prod(shape)
        if n <= DUMMY_CHUNK:
            return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * self.std
        # a big matrix in chunks, each from its own seed, on all cores (one generator draws
        # serially); the values depend on the seed and the name alone
        out = torch.empty(n)
        chunks = out.split(DUMMY_CHUNK)

        def fill(i: int) -> None:
            gen = torch.Generator().manual_seed(seed * 7_919 + i + 1)
            chunks[i].normal_(0.0, self.std, generator=gen)
        with ThreadPoolExecutor(min(len(chunks), os.cpu_count() or 1)) as pool:
            list(pool.map(fill, range(len(chunks))))
        return out.view(shape)
