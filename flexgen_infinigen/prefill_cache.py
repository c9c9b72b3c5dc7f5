"""Prefills kept for reuse: one block's prompt keys and values and its first logits.

A long prompt's prefill is most of what a long-context run costs on a CPU (minutes at 8K
tokens, a quarter of an hour at 32K), and it does not depend on the KV policy that decodes
after it, only on the model, its weights' dtype and compression, and the token ids. A
:class:`PrefillCache` given to :meth:`~flexgen_infinigen.api.OffloadedLM.generate` keeps
each block's prefill the first time and hands it to later calls with the same prompts,
whatever their KV policy: the caches are filled from it (``store_prompt``) exactly as a
prefill fills them, so the decode that follows is the same, token for token (tested).

A policy that needs the prompt's queries at prefill (H2O's accumulated attention,
InfiniGen's per-prompt skew: :attr:`~.kv.base.KVPolicy.needs_prompt_queries`) runs its own
prefill. With a ``folder`` the prefills also live on disk (safetensors, written to a
temporary name and renamed when whole, never pickled), named by a hash of everything they
depend on, so other processes (each configuration of a benchmark) reuse them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT = 1


@dataclass
class Prefilled:
    """One block's prefill: ``kv[(layer, batch)] = (k, v)`` ``[b, P, KV, d]`` on the CPU, and
    every GPU batch's logits ``[b, vocab]`` at the prompt's last position. One read from a
    file (``path``) holds only the logits: each layer's keys and values are read when asked
    for (:meth:`take`), so that a 32K-token prefill never sits in memory beside its cache."""

    kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    logits: list[torch.Tensor] = field(default_factory=list)
    path: Path | None = None

    def keep(self, layer: int, batch: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[(layer, batch)] = (k.detach().cpu(), v.detach().cpu())

    def take(self, layer: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.path is None:
            return self.kv[(layer, batch)]
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as f:
            return f.get_tensor(f"k.{layer}.{batch}"), f.get_tensor(f"v.{layer}.{batch}")


class PrefillCache:
    """Prefills by key, in memory and, with ``folder``, on disk."""

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = Path(folder) if folder is not None else None
        self.memory: dict[str, Prefilled] = {}
        self.hits = self.misses = 0

    @staticmethod
    def key(lm, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
        """Everything a block's prefill depends on: the model (config and weight store),
        the runtime dtype, weight compression, the GPU batch shape and the padded ids."""
        h = hashlib.sha256()
        cfg = dataclasses.asdict(lm.cfg)
        h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
        store = getattr(lm, "store_path", None)
        if store is not None:
            manifest = Path(store) / "manifest.json"
            h.update(str(Path(store).resolve()).encode())
            if manifest.is_file():
                h.update(manifest.read_bytes())
        h.update(f"{lm.engine.dtype} {lm.policy.compress_weight} {FORMAT}".encode())
        for ids, valid in batches:
            h.update(str(tuple(ids.shape)).encode())
            h.update(ids.to(torch.int64).numpy().tobytes())
            h.update(valid.to(torch.bool).numpy().tobytes())
        return h.hexdigest()[:32]

    def get(self, key: str) -> Prefilled | None:
        found = self.memory.get(key)
        if found is None and self.folder is not None:
            found = _read(self.folder / f"{key}.safetensors")
            if found is not None:
                self.memory[key] = found
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def put(self, key: str, prefilled: Prefilled) -> None:
        """Keep ``prefilled``: in memory, or, with a folder, on disk only (later uses read it
        layer by layer)."""
        if self.folder is None:
            self.memory[key] = prefilled
            return
        path = self.folder / f"{key}.safetensors"
        _write(path, prefilled)
        self.memory[key] = Prefilled(logits=prefilled.logits, path=path)



def _write(path: Path, p: Prefilled) -> None:
    from safetensors.torch import save_file

    tensors = {f"k.{layer}.{b}": k.contiguous() for (layer, b), (k, _) in p.kv.items()}
    tensors.update({f"v.{layer}.{b}": v.contiguous() for (layer, b), (_, v) in p.kv.items()})
    tensors.update({f"logits.{b}": x.contiguous() for b, x in enumerate(p.logits)})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={"format": str(FORMAT)})
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
