"""Prefix pages: the keys and values of token sequences seen before, kept so that a request
that starts the same way (a chat's history, a shared system prompt, a repeated document)
prefills only what follows.

A sequence is cut into pages of ``page_tokens`` tokens from its first token; a page holds
every attention layer's keys and values of its tokens (``[layers, page_tokens, KV, d]``
each). A page is named by a hash chained through the pages before it and the model's key
(:func:`~.prefill_cache.model_key`), so one name means one model and one whole prefix:
the keys and values of a token depend on every token before it.

Pages live in CPU memory up to ``memory_bytes``; the least recently used go to ``folder``
(when there is one) up to ``disk_bytes``, and past that are dropped. Files are safetensors
(never pickled) written to a temporary name and renamed when whole; each records the
model key, its page name, its token ids and a CRC-32 of its bytes, and is checked on every
read: a truncated, foreign or damaged file is a miss (and is removed), never a wrong answer.
With ``persistent`` the folder's pages are found again by a later process.
"""
from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "1"
SUFFIX = ".page.safetensors"


@dataclass
class Page:
    """One page in memory: every layer's keys and values of its tokens."""

    k: torch.Tensor  # [layers, page_tokens, KV, d]
    v: torch.Tensor | None  # None: the values are the keys (MLA's latent), kept once

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + (0 if self.v is None else self.v.nbytes)


class PrefixPages:
    """Pages by name, in CPU memory and (with ``folder``) on disk, least recently used out
    first."""

    def __init__(self, model_key: str, page_tokens: int = 64, memory_bytes: int = 1 << 30,
                 folder: str | os.PathLike | None = None, disk_bytes: int = 0,
                 persistent: bool = False):
        if page_tokens < 1:
            raise ValueError("page_tokens must be at least 1")
        self.model_key, self.page_tokens = model_key, page_tokens
        self.memory_bytes, self.disk_bytes = memory_bytes, disk_bytes
        self.folder = Path(folder) if folder is not None else None
        self.persistent = persistent
        self.memory: OrderedDict[str, Page] = OrderedDict()
        self.disk: OrderedDict[str, int] = OrderedDict()  # name -> file bytes
        self.in_memory = self.on_disk = 0
        self._page_ids: dict[str, list[int]] = {}  # a memory page's tokens (for its file)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            if persistent:  # oldest first, so that the newest are evicted last
                found = sorted(self.folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
                for path in found:
                    self.disk[path.name[:-len(SUFFIX)]] = path.stat().st_size
                    self.on_disk += path.stat().st_size
                self._trim_disk()

    # ---- names ------------------------------------------------------------------------------
    def names(self, ids: list[int]) -> list[str]:
        """The name of each whole page of ``ids``, in order."""
        out, h = [], hashlib.sha256(self.model_key.encode()).hexdigest()
        n = self.page_tokens
        for start in range(0, len(ids) - n + 1, n):
            page = ids[start:start + n]
            h = hashlib.sha256(f"{h} {json.dumps(page)}".encode()).hexdigest()
            out.append(h[:40])
        return out

    # ---- lookups ----------------------------------------------------------------------------
    def longest(self, ids: list[int], limit: int | None = None) -> int:
        """Tokens of ``ids``'s longest prefix held here, in whole pages, at most ``limit``
        tokens."""
        names = self.names(ids[:limit] if limit is not None else ids)
        found = 0
        for name in names:
            if name not in self.memory and name not in self.disk:
                break
            found += 1
        return found * self.page_tokens

    def gather(self, ids: list[int], tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys and values of the first ``tokens`` tokens of ``ids`` (a multiple of the
        page size that :meth:`longest` found), ``[layers, tokens, KV, d]`` each; None when a
        page turns out to be missing or damaged."""
        names = self.names(ids[:tokens])
        pages = []
        for i, name in enumerate(names):
            page = self._get(name, ids[i * self.page_tokens:(i + 1) * self.page_tokens])
            if page is None:
                return None
            pages.append(page)
        k = torch.cat([p.k for p in pages], 1)
        return k, (k if pages[0].v is None else torch.cat([p.v for p in pages], 1))

    def _get(self, name: str, ids: list[int]) -> Page | None:
        page = self.memory.get(name)
        if page is not None:
            self.memory.move_to_end(name)
            return page
        if name not in self.disk:
            return None
        path = self._path(name)
        page = _read(path, self.model_key, name, ids)
        size = self.disk.pop(name)
        self.on_disk -= size
        if page is None:  # damaged or foreign: a miss, and never read again
            path.unlink(missing_ok=True)
            return None
        if not self.persistent:
            path.unlink(missing_ok=True)
        else:  # the file stays; it is now also in memory
            self.disk[name] = size
            self.on_disk += size
        self._keep(name, page, ids)
        return page

    # ---- adding -----------------------------------------------------------------------------
    def add(self, ids: list[int], k: torch.Tensor, v: torch.Tensor | None) -> int:
        """Keep the whole pages of a sequence: ``ids`` its tokens, ``k``, ``v``
        ``[layers, len(ids), KV, d]`` their keys and values (``v`` None: the values are the
        keys). Pages held already are only marked used. Returns the pages added."""
        added = 0
        n = self.page_tokens
        for i, name in enumerate(self.names(ids)):
            if name in self.memory:
                self.memory.move_to_end(name)
                continue
            if name in self.disk:
                self.disk.move_to_end(name)
                continue
            # copies of their own: a page does not keep the whole sequence alive
            page = Page(*(None if t is None else
                          t[:, i * n:(i + 1) * n].clone(memory_format=torch.contiguous_format)
                          for t in (k, v)))
            if page.nbytes > self.memory_bytes and self.folder is None:
                break
            self._keep(name, page, ids[i * n:(i + 1) * n])
            added += 1
        return added

    def _keep(self, name: str, page: Page, ids: list[int]) -> None:
        self.memory[name] = page
        self.memory.move_to_end(name)
        self.in_memory += page.nbytes
        self._page_ids[name] = ids
        if self.persistent and name not in self.disk:
            self._spill(name, page, ids)  # written through: a restart finds it
        while self.in_memory > self.memory_bytes and self.memory:
            old, evicted = self.memory.popitem(last=False)
            self.in_memory -= evicted.nbytes
            old_ids = self._page_ids.pop(old)
            if old not in self.disk:
                self._spill(old, evicted, old_ids)

    def _spill(self, name: str, page: Page, ids: list[int]) -> None:
        """The page to disk (when there is a folder and a disk budget)."""
        if self.folder is None or self.disk_bytes <= 0:
            return
        path = self._path(name)
        _write(path, page, self.model_key, name, ids)
        size = path.stat().st_size
        self.disk[name] = size
        self.on_disk += size
        self._trim_disk()

    def _trim_disk(self) -> None:
        while self.on_disk > self.disk_bytes and self.disk:
            old, size = self.disk.popitem(last=False)
            self.on_disk -= size
            self._path(old).unlink(missing_ok=True)

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}{SUFFIX}"

    def close(self) -> None:
        """Forget the memory pages; remove the files unless the folder is persistent."""
        self.memory.clear()
        self._page_ids.clear()
        self.in_memory = 0
        if self.folder is not None and not self.persistent:
            for name in list(self.disk):
                self._path(name).unlink(missing_ok=True)
            self.disk.clear()
            self.on_disk = 0
            try:
                self.folder.rmdir()  # a folder of this process's own; left if anything else
            except OSError:
                pass


def _write(path: Path, page: Page, model_key: str, name: str, ids: list[int]) -> None:
    """One page as a safetensors file, to a temporary name renamed when whole."""
    from safetensors.torch import save_file

    tensors = {"k": page.k.contiguous(), "ids": torch.tensor(ids, dtype=torch.int64)}
    if page.v is not None:
        tensors["v"] = page.v.contiguous()
    meta = {"format": FORMAT, "model": model_key, "page": name, "crc32": _crc(tensors)}
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _crc(tensors: dict[str, torch.Tensor]) -> str:
    crc = 0
    for n in ("k", "v", "ids"):
        if n not in tensors:  # no values: they are the keys
            continue
        crc = zlib.crc32(tensors[n].contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return str(crc)


def _read(path: Path, model_key: str, name: str, ids: list[int]) -> Page | None:
    """The page in ``path`` if it is whole and is this model's page ``name`` of tokens
    ``ids``; else None."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if (meta.get("format"), meta.get("model"), meta.get("page")) != \
                    (FORMAT, model_key, name):
                return None
            got = {n: f.get_tensor(n) for n in f.keys() if n in ("k", "v", "ids")}
    except Exception:  # noqa: BLE001 - cut short, not safetensors, unreadable: a miss
        return None
    if "k" not in got or "ids" not in got or got["ids"].tolist() != list(ids) \
            or _crc(got) != meta.get("crc32"):
        return None
    return Page(got["k"], got.get("v"))
