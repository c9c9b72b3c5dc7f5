"""Where weights come from when a model is loaded: a converted store, or dummy values."""
from __future__ import annotations

import zlib

import torch

from ..config import ModelConfig
from .store import WeightStore


class StoreSource:
    """Tensors of a converted weight store, memory-mapped; a tensor kept as a quantized
    file's codes comes as a :class:`~flexgen_infinigen.memory.codes.Packed` (its ``layout``)."""

    def __init__(self, store: WeightStore):
        self.store = store

    def __call__(self, name: str, shape: tuple[int, ...]):
        if self.store.layout(name) is not None:
            return self.store.packed(name)
        return self.store.tensor(name)

    def layout(self, name: str):
        return self.store.layout(name) if name in self.store.tensors else None

    def formats(self) -> dict[str, str]:
        """Each tensor's stored format (``Q4_1``, ``Q8_0``, ``F32``, ...)."""
        return {name: self.store.format(name) for name in self.store.tensors}


class DummySource:
    """Seeded random weights in the model's true shapes (for models we cannot download).

    Matrices are normal with std 0.02 (the usual initialization scale), norm scales
    are one and biases zero, so activations stay in a realistic range.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0, std: float = 0.02):
        self.cfg, self.seed, self.std = cfg, seed, std

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if len(shape) == 1:
            return torch.ones(shape)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=gen) * self.std
