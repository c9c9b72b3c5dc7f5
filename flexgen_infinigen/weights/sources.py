"""Where weights come from when a model is loaded: a converted store, or dummy values."""
from __future__ import annotations

import zlib

import torch

from ..config import ModelConfig
from .store import WeightStore


class StoreSource:
    """Tensors of a converted weight store, memory-mapped."""

    def __init__(self, store: WeightStore):
        self.store = store

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.store.tensor(name)


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
