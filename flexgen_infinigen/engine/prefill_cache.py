"""Prefills kept for reuse: one block's prompt keys and values and its first logits.

A long prompt's prefill is most of what a long-context run costs on a CPU (it grows with the
square of the prompt's length), and it does not depend on the KV policy that decodes after
it, only on the model, its weights' dtype and compression, and the token ids. A
:class:`PrefillCache` given to :meth:`~flexgen_infinigen.api.OffloadedLM.generate` keeps
each block's prefill the first time and hands it to later calls with the same prompts,
whatever their KV policy: the caches are filled from it (``store_prompt``) exactly as a
prefill fills them, so the decode that follows is the same, token for token (tested).

A policy that needs the prompt's queries at prefill (H2O's accumulated attention, a per-
prompt skew: :attr:`~..kv.base.KVPolicy.needs_prompt_queries`) runs its own prefill. With a
``folder`` the prefills also live on disk (safetensors, written to a temporary name and
renamed when whole, never pickled), named by a hash of everything they depend on, so other
processes (each configuration of a benchmark) reuse them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol
from pathlib import Path

import torch

FORMAT = 1


@dataclass
class Prefilled:
    """One block's prefill: every attention layer's prompt keys and values per GPU batch
    (``[b, P, KV, d]``), and every GPU batch's logits ``[b, vocab]`` at the prompt's last
    position.

    While a block runs, a prefill being kept holds no copy: ``sources`` read each layer back
    from its cache when the prefill is written (one layer at a time), so keeping a 32K-token
    prefill costs no memory beside its cache. One read from a file (``path``) holds only the
    logits; each layer is read when asked for (:meth:`take`)."""

    kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    logits: list[torch.Tensor] = field(default_factory=list)
    path: Path | None = None
    sources: dict[tuple[int, int], Callable] = field(default_factory=dict)

    def keep(self, layer: int, batch: int, k: torch.Tensor, v: torch.Tensor,
             source: Callable | None = None) -> None:
        """This layer's prompt keys and values; with ``source`` (a function that reads them
        back exactly, later, from the cache) nothing is copied now."""
        if source is not None:
            self.sources[(layer, batch)] = source
        else:
            self.kv[(layer, batch)] = (k.detach().cpu(), v.detach().cpu())

    def names(self) -> list[tuple[int, int]]:
        return sorted({*self.kv, *self.sources})

    def take(self, layer: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (layer, batch) in self.kv:
            return self.kv[(layer, batch)]
        if (layer, batch) in self.sources:
            k, v = self.sources[(layer, batch)]()
            return k.cpu(), v.cpu()
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            return f.get_tensor(f"k.{layer}.{batch}"), f.get_tensor(f"v.{layer}.{batch}")

    def materialized(self) -> "Prefilled":
        """A copy that outlives the block (every source read now)."""
        kv = {name: tuple(t.clone() for t in self.take(*name)) for name in self.names()}
        return Prefilled(kv, list(self.logits))


class PrefillSource(Protocol):
    """What a prefill's key is made of (the loaded model gives it)."""

    cfg: object  # the ModelConfig
    store_path: object  # the weight store's folder, or None (dummy weights)
    dtype: torch.dtype  # the runtime dtype
    policy: object  # the Placement (its weight compression)


def model_key(source: "PrefillSource") -> str:
    """What the keys and values of a token sequence depend on besides its ids: the model
    (config and weight store), the runtime dtype and weight compression."""
    h = hashlib.sha256()
    cfg = dataclasses.asdict(source.cfg)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    store = getattr(source, "store_path", None)
    if store is not None:
        manifest = Path(store) / "manifest.json"
        h.update(str(Path(store).resolve()).encode())
        if manifest.is_file():
            h.update(manifest.read_bytes())
    h.update(f"{source.dtype} {source.policy.compress_weight}".encode())
    return h.hexdigest()[:32]


class PrefillCache:
    """Prefills by key, in memory and, with ``folder``, on disk."""

    def __init__(self, folder: str | os.PathLike | None = None, keep: int | None = None):
        """``keep``: at most this many prefills in memory, the least recently used dropped
        (on disk they stay)."""
        self.folder = Path(folder) if folder is not None else None
        self.keep = keep
        self.memory: OrderedDict[str, Prefilled] = OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def key(source: "PrefillSource", batches: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
        """Everything a block's prefill depends on: the model (config and weight store),
        the runtime dtype, weight compression, the GPU batch shape and the padded ids."""
        h = hashlib.sha256(model_key(source).encode())
        h.update(f"{FORMAT}".encode())
        for ids, valid in batches:
            h.update(str(tuple(ids.shape)).encode())
            h.update(ids.to(torch.int64).numpy().tobytes())
            h.update(valid.to(torch.bool).numpy().tobytes())
        return h.hexdigest()[:32]

    def get(self, key: str) -> Prefilled | None:
        found = self.memory.get(key)
        if found is None and self.folder is not None:
            found = _read(self.folder / f"{key}.safetensors")
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self._remember(key, found)
        return found

    def _remember(self, key: str, prefilled: Prefilled) -> None:
        self.memory[key] = prefilled
        self.memory.move_to_end(key)
        while self.keep is not None and len(self.memory) > self.keep:
            self.memory.popitem(last=False)

    def put(self, key: str, prefilled: Prefilled) -> None:
        """Keep ``prefilled``: in memory, or, with a folder, on disk only (later uses read it
        layer by layer)."""
        if self.folder is None:
            self._remember(key, prefilled.materialized())
            return
        path = self.folder / f"{key}.safetensors"
        _write(path, prefilled)
        self._remember(key, Prefilled(logits=prefilled.logits, path=path))



_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _write(path: Path, p: Prefilled) -> None:
    """A safetensors file written one tensor at a time (the header first, from the shapes),
    so that only one layer's keys or values are ever copied at once; to a temporary name,
    renamed when whole."""
    names = p.names()
    first_k, first_v = p.take(*names[0])
    shape_k, shape_v = tuple(first_k.shape), tuple(first_v.shape)
    tensors = []  # (name, dtype, shape, reader)
    for layer, b in names:
        tensors.append((f"k.{layer}.{b}", first_k.dtype, shape_k, (layer, b, 0)))
        tensors.append((f"v.{layer}.{b}", first_v.dtype, shape_v, (layer, b, 1)))
    for b, x in enumerate(p.logits):
        tensors.append((f"logits.{b}", x.dtype, tuple(x.shape), x))
    header, offset = {"__metadata__": {"format": str(FORMAT)}}, 0
    for name, dtype, shape, _ in tensors:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, dtype, shape, what in tensors:
                t = what if isinstance(what, torch.Tensor) else p.take(*what[:2])[what[2]]
                assert tuple(t.shape) == shape and t.dtype == dtype, name
                f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
        os.replace(tmp, path)  # whole or not at all
    finally:
        tmp.unlink(missing_ok=True)


def _read(path: Path) -> Prefilled | None:
    """The logits of a kept prefill and where its keys and values are (read when asked)."""
    if not path.is_file():
        return None
    from safetensors import safe_open

    logits = {}
    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("format") != str(FORMAT):
            return None
        for name in f.keys():
            if name.startswith("logits."):
                logits[int(name.split(".")[1])] = f.get_tensor(name)
    return Prefilled(logits=[logits[b] for b in sorted(logits)], path=path)
