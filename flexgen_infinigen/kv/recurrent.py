"""The state of a recurrent layer (a hybrid's Gated DeltaNet, :mod:`..models.qwen3_next`)
for one GPU batch, held where the placement puts the KV cache.

A recurrent layer keeps no keys or values: each row carries a fixed-size state that the
layer's math reads and replaces at every step. The engine keeps one
:class:`RecurrentState` per (layer, GPU batch) in the place a KV cache would be, so that
every schedule walk, abort and byte count treats it as one: its tensors are
:class:`~..memory.split_tensor.SplitTensor` rows split over the tiers by the cache's
fractions, and each read and write goes through the tiers (counted as ``kv_cache``
bytes). It answers the KV interface with nothing to load or store: the engine hands its
state to the family's ``recurrent_mix`` and writes back what comes out
(:meth:`read`, :meth:`write`). A row's state does not depend on a column count, so a
context grows it by nothing; the memory plan counts it once per row.
"""
from __future__ import annotations

import math

import torch

from ..memory.split_tensor import SplitTensor
from .base import CacheSpec, KVCache, Loaded


def state_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """One row's state in bytes (float32)."""
    return 4 * sum(math.prod(s) for s in shapes.values())


class RecurrentState(KVCache):
    """The rows' states of one recurrent layer and GPU batch (zero before a prompt)."""

    inline = True  # nothing to load or store ahead: the mixing reads and writes it itself

    def __init__(self, spec: CacheSpec, shapes: dict[str, tuple[int, ...]]):
        self.spec = spec
        self.parts = {name: SplitTensor(spec.tiers, (spec.batch_size, *shape), torch.float32,
                                        spec.fractions, "kv_cache")
                      for name, shape in shapes.items()}
        self.fresh = True  # nothing written yet: the state is zero

    def read(self) -> dict[str, torch.Tensor]:
        """Every part on the compute device, ``[b, ...]``."""
        dev = self.spec.tiers.device
        if self.fresh:
            return {name: torch.zeros(t.shape, dtype=torch.float32, device=dev)
                    for name, t in self.parts.items()}
        return {name: t.read() for name, t in self.parts.items()}

    def write(self, state: dict[str, torch.Tensor]) -> None:
        for name, t in self.parts.items():
            t.write(state[name].to(torch.float32))
        self.fresh = False

    # ---- rows taking other sequences between two steps --------------------------------------
    takes_rows = True  # a row's whole past is its state: a prompt's own state replaces it

    def take_row(self, row: int, start: int, other: KVCache, length: int) -> None:
        """Row ``row`` takes the state a prompt's prefill alone left in ``other`` (a one-row
        state of the same layer): exactly the state that prompt's own block would carry."""
        assert isinstance(other, RecurrentState)
        self._set_row(row, other.read())

    def restart_row(self, row: int) -> None:
        """Row ``row`` starts a new sequence: its state is zero again."""
        self._set_row(row, None)

    def _set_row(self, row: int, source: dict[str, torch.Tensor] | None) -> None:
        state = self.read()
        for name, t in state.items():
            t[row] = 0 if source is None else source[name][0]
        self.write(state)

    # ---- the KV interface: nothing moves ahead of the mixing -------------------------------
    def store_prompt(self, q, k, v, valid) -> None:
        raise RuntimeError("a recurrent layer keeps no keys or values")

    def load(self, length: int) -> Loaded:
        return Loaded.later()

    def attend(self, loaded, q, k_new, v_new, valid, bias, sinks=None):
        raise RuntimeError("a recurrent layer has no attention")

    def store_token(self, k_new, v_new, position: int) -> None:
        raise RuntimeError("a recurrent layer keeps no keys or values")

    def bytes_by_tier(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for t in self.parts.values():
            for tier, n in t.bytes_by_tier().items():
                total[tier] = total.get(tier, 0) + n
        return total
