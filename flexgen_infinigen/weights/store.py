"""The on-disk weight store: one memory-mappable ``.npy`` file per tensor, or an index of a
GGUF file's tensors read in place.

Layout of a store folder::

    manifest.json      {"format": 2, "config": {...}, "tensors": {name: {"shape", "dtype"}},
                        "tokenizer": "tokenizer.json" | null, "source": "..."}
    <name>.npy         one file per tensor, written with numpy (never pickled)
    tokenizer.json     a Hugging Face ``tokenizers`` file, when one is known

A tensor is floats (``dtype`` float32, float16, or bfloat16 held as int16 bits), or, from a
quantized GGUF, the file's own blocks (format 2: ``"gguf_type": "Q4_1"``, ``dtype`` uint8,
the ``.npy`` shaped ``[rows, bytes a row]``, ``shape`` the tensor's own), turned into the
runtime's codes one tensor at a time when loaded (:mod:`.gguf_codes`). Format 1 stores (all
floats) still load.

An index store (format 3, written by :mod:`.gguf_index`, read by :mod:`.in_place`) has no
``.npy`` files: its ``"files"`` list the GGUF files it reads (path, size, modification
time) and each tensor says where its bytes are (``"file"``: a position in that list,
``"offset"``, ``"bytes"``), as a ``.npy`` would hold them. A llama q/k tensor whose rows
llama.cpp interleaved carries ``"heads"``: :meth:`WeightStore.load` un-permutes its rows
(a copy), :meth:`WeightStore.blocks` leaves them in place and says their order. A file
that is gone, shorter than a tensor's end, or of another size or time than indexed makes
the store damaged (:func:`damage`), read from the file's metadata, never its data.

A store is written into a temporary sibling folder and renamed into place only
after every tensor and the manifest are on disk, so an interrupted conversion
never leaves a folder that looks complete.
"""
from __future__ import annotations

import errno
import json
import math
import os
import shutil
import uuid
import warnings
from pathlib import Path

import numpy as np
import torch

from ..config import CACHE_ENV, ConfigError, ModelConfig
from ..memory.codes import Blocks, CodeLayout, Packed
from . import gguf_codes
from .in_place import InPlaceFiles, rotary_order

FORMAT_VERSION = 3  # the newest this version reads: 3 indexes a GGUF in place
COPY_FORMAT = 2  # a store holding its own tensor files
MANIFEST = "manifest.json"


# room kept beyond the tensors' bytes: .npy headers, the manifest, the tokenizer, and the
# filesystem's own blocks
ROOM_MARGIN = 1.02
ROOM_SLACK = 64 << 20


def check_room(dest: Path, nbytes: int, source: str) -> None:
    """One error before anything is written when a store of ``nbytes`` would not fit on the
    disk that will hold ``dest`` (a conversion that fills the disk half way would fail with
    a bare OSError after minutes of work)."""
    if nbytes <= 0:
        return
    root = Path(dest).absolute().parent
    while not root.exists():  # folders the writer will create: their disk is the parent's
        root = root.parent
    need, free = int(nbytes * ROOM_MARGIN) + ROOM_SLACK, shutil.disk_usage(root).free
    if need > free:
        raise ConfigError(
            f"converting {source or 'the model'} needs about {need / 1e9:.1f} GB in {root}, "
            f"which has {free / 1e9:.1f} GB free; free space there, or write the store to a "
            f"disk with room (convert's --out; for the cache, ${CACHE_ENV})")


class StoreWriter:
    """Writes a store atomically: ``with StoreWriter(dest, cfg) as w: w.add(name, array)``."""

    def __init__(self, dest: str | os.PathLike, config: ModelConfig, source: str = "",
                 extra: dict | None = None, expected_bytes: int = 0):
        self.dest = Path(dest)
        self.expected_bytes = expected_bytes  # refused up front when the disk has less
        self.config = config
        self.source = source
        self.extra = dict(extra or {})  # more manifest fields (special ids, source identity)
        self.tmp = self.dest.parent / (f".{self.dest.name}.partial-{os.getpid()}-"
                                       f"{uuid.uuid4().hex[:8]}")
        self.tensors: dict[str, dict] = {}
        self.tokenizer_file: str | None = None

    def __enter__(self) -> "StoreWriter":
        self._remove_stale_partials()  # what killed conversions left is free space for this one
        check_room(self.dest, self.expected_bytes, self.source)
        try:
            self.tmp.mkdir(parents=True)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise ConfigError(f"cannot write the weight store in {self.dest.parent} "
                              f"({e.strerror or type(e).__name__}); give a writable folder "
                              f"(convert's --out; for the cache, ${CACHE_ENV})") from None
        return self

    def _remove_stale_partials(self) -> None:
        """Delete partial folders left by conversions whose process was killed."""
        if not self.dest.parent.is_dir():
            return
        for old in self.dest.parent.glob(f".{self.dest.name}.partial-*"):
            try:
                pid = int(old.name.rsplit("partial-", 1)[1].split("-")[0])
                os.kill(pid, 0)  # still running: leave it alone
            except ProcessLookupError:
                shutil.rmtree(old, ignore_errors=True)
            except (ValueError, PermissionError):
                continue

    def add(self, name: str, array: np.ndarray, dtype: str | None = None) -> None:
        """Write one tensor; ``dtype`` names what the bits are when numpy has no such type
        (``"bfloat16"``: 16-bit integers holding bf16 bits)."""
        array = np.ascontiguousarray(array)
        np.save(self.tmp / f"{name}.npy", array, allow_pickle=False)
        self.tensors[name] = {"shape": list(array.shape), "dtype": dtype or str(array.dtype)}

    def add_blocks(self, name: str, raw: np.ndarray, shape: tuple[int, ...],
                   type_name: str) -> None:
        """Write a quantized GGUF tensor as its blocks ``raw`` (uint8 ``[rows, bytes]``)."""
        np.save(self.tmp / f"{name}.npy", np.ascontiguousarray(raw), allow_pickle=False)
        self.tensors[name] = {"shape": [int(d) for d in shape], "dtype": "uint8",
                              "gguf_type": type_name}

    def add_in_place(self, name: str, entry: dict) -> None:
        """A tensor read in place from a file of the manifest's ``"files"`` (an index store:
        ``entry`` holds shape, dtype, file, offset, bytes; see the module doc)."""
        self.tensors[name] = dict(entry)

    def add_text(self, name: str, text: str) -> None:
        """A small text file stored beside the tensors (a chat template, say)."""
        (self.tmp / name).write_text(text, encoding="utf-8")

    def add_tokenizer_json(self, text: str) -> None:
        (self.tmp / "tokenizer.json").write_text(text, encoding="utf-8")
        self.tokenizer_file = "tokenizer.json"

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        in_place = any("file" in info for info in self.tensors.values())
        manifest = {"format": FORMAT_VERSION if in_place else COPY_FORMAT,
                    "config": self.config.to_dict(),
                    "tensors": self.tensors, "tokenizer": self.tokenizer_file,
                    "source": self.source, **self.extra}
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if self.dest.exists():
            shutil.rmtree(self.dest)
        os.replace(self.tmp, self.dest)


def rebuild_hint(path: str | os.PathLike) -> str:
    """How to get a good store back at ``path``: a store in the cache is converted again by
    the next run (once the damaged one is gone); another was made by ``convert``."""
    from ..config import default_cache_dir

    path = Path(path)
    try:
        cached = path.resolve().is_relative_to(default_cache_dir().resolve())
    except OSError:
        cached = False
    if cached:
        return (f"re-run the conversion: delete the folder (rm -r '{path}'); the next run "
                "whose --model names its source re-converts it")
    return (f"re-run the conversion: delete the folder and re-convert the weights into it "
            f"(python -m flexgen_infinigen.convert --checkpoint FOLDER or --gguf FILE --out "
            f"'{path}')")


class WeightStore:
    """Read access to a finished store; tensors come back memory-mapped."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise ConfigError(
                f"{self.path} is not a weight store (no {MANIFEST}); convert weights with "
                "`python -m flexgen_infinigen.convert` or use --dummy")
        try:
            self.manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            if self.manifest.get("format", 1) > FORMAT_VERSION:
                raise ConfigError(f"weight store {self.path} has format "
                                  f"{self.manifest['format']}, newer than this version "
                                  "reads; upgrade or re-convert it")
            self.config = ModelConfig.from_dict(self.manifest["config"])
            self.tensors: dict[str, dict] = dict(self.manifest["tensors"])
        except ConfigError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"weight store {self.path} is damaged (its {MANIFEST} cannot be "
                              f"read: {type(e).__name__}); {rebuild_hint(self.path)}"
                              ) from None
        self._half: dict[str, bool] = {}  # quantized tensors whose factors are float16s
        self._in_place = InPlaceFiles(self.manifest.get("files") or [])  # an index's GGUFs

    def _fault(self, name: str) -> str | None:
        """What is wrong with one tensor's file, against the manifest (None: nothing). Reads
        the ``.npy`` header (or the GGUF file's size and time) only, no tensor data."""
        info = self.tensors.get(name)
        if isinstance(info, dict) and "file" in info:
            return self._in_place.fault(name, info)
        file = self.path / f"{name}.npy"
        if not isinstance(info, dict) or not file.is_file():
            return f"it lacks tensor {name!r}"
        try:  # a file cut short or with a broken header cannot be mapped
            actual = tuple(self.load(name).shape)
            kind = info.get("gguf_type")
            if kind is not None:  # blocks: [rows, blocks a row * bytes a block]
                size, per = gguf_codes.BLOCKS[kind][:2]
                blocks = (math.prod(info["shape"][:-1]), info["shape"][-1] // per * size)
                if actual != blocks or info["shape"][-1] % per:
                    return f"{file} holds {actual}, not the {kind} blocks of {info['shape']}"
            elif actual != tuple(info["shape"]):
                return f"{file} holds {actual}, its manifest says {tuple(info['shape'])}"
        except (ValueError, OSError, KeyError, TypeError, IndexError) as e:
            return f"{file} is damaged ({type(e).__name__}: {str(e)[:80]})"
        return None

    def _hint(self, name: str) -> str:
        info = self.tensors.get(name)
        if isinstance(info, dict) and "file" in info:
            try:
                file = self._in_place.path(info)
            except (ValueError, KeyError, TypeError, IndexError):
                return rebuild_hint(self.path)
            return (f"the store reads {file} in place: put the file back as it was, or run "
                    f"with --model '{file}' to index it again")
        return rebuild_hint(self.path)

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """One clear error when a tensor is missing, its file is gone or damaged, or its
        shape is off; the error says how to rebuild the store."""
        for name, shape in expected.items():
            fault = self._fault(name)
            if fault is not None:
                raise ConfigError(f"weight store {self.path} is damaged: {fault}; "
                                  f"{self._hint(name)}")
            found = tuple(self.tensors[name]["shape"])
            if found != tuple(shape):
                raise ConfigError(
                    f"tensor {name!r} in {self.path} has shape {found}, the model config "
                    f"wants {tuple(shape)}; the store does not match --model, re-convert it")

    def format(self, name: str) -> str:
        """What a tensor is stored as: its GGUF type (``Q4_1``), or ``F32``/``F16``/``BF16``."""
        info = self.tensors[name]
        floats = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
        return info.get("gguf_type") or floats.get(info["dtype"], info["dtype"])

    def layout(self, name: str) -> CodeLayout | None:
        """(code bits, group, float16 scales) of a tensor kept as codes; None for floats.
        Its scales and minima are held as float16 when every one is a float16 exactly
        (:func:`.gguf_codes.half_exact`, read from its blocks once and remembered)."""
        info = self.tensors[name]
        kind = info.get("gguf_type")
        if kind is None:
            return None
        if name not in self._half:  # in stored row order: the same factors
            self._half[name] = gguf_codes.half_exact(self._raw(name), kind,
                                                     tuple(info["shape"]))
        return CodeLayout(*gguf_codes.layout(kind), self._half[name])

    def packed(self, name: str) -> Packed:
        """A quantized tensor's codes, scales and minima (built from its blocks now: the
        codes reordered, the scales decoded to float16 where :meth:`layout` says they are
        exact, else float32; nothing expanded to floats)."""
        info = self.tensors[name]
        parts = gguf_codes.to_parts(self.load(name), info["gguf_type"], tuple(info["shape"]),
                                    half=self.layout(name).half)
        return Packed(*(torch.from_numpy(np.require(p, requirements=["C", "W"])) for p in parts),
                      tuple(info["shape"]))

    def _raw(self, name: str) -> np.ndarray:
        """The tensor's array as stored, memory-mapped: its ``.npy``, or its bytes in the
        GGUF file (rows in the file's order)."""
        info = self.tensors[name]
        if "file" not in info:
            return np.load(self.path / f"{name}.npy", mmap_mode="r", allow_pickle=False)
        return self._in_place.array(info)

    def load(self, name: str) -> np.ndarray:
        """The raw array, memory-mapped (bf16 tensors come back as their int16 bits); from an
        index store, a read-only map of the tensor's bytes in the GGUF file, except a llama
        q/k tensor, whose rows are un-permuted into a copy."""
        raw = self._raw(name)
        heads = self.tensors[name].get("heads")
        return raw if not heads else np.asarray(raw)[rotary_order(raw.shape[0], heads)]

    def blocks(self, name: str) -> Blocks:
        """A quantized tensor as the file stores it, nothing copied: ``raw`` shares the
        memory map (read-only: do not write); ``order`` says which stored row is each
        un-permuted row where llama.cpp interleaved them, else None."""
        info = self.tensors[name]
        kind = info.get("gguf_type")
        if kind is None:
            raise ValueError(f"tensor {name!r} is {self.format(name)}, not GGUF blocks")
        raw = self._raw(name)
        with warnings.catch_warnings():  # torch warns that the map is not writable
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(np.asarray(raw))
        heads = info.get("heads")
        order = None if not heads else torch.from_numpy(
            rotary_order(raw.shape[0], heads).astype(np.int32))
        return Blocks(t, kind, tuple(info["shape"]), order)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor in its stored dtype, sharing the memory map (read-only: do not write)."""
        with warnings.catch_warnings():  # torch warns that the map is not writable
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(np.asarray(self.load(name)))
        return t.view(torch.bfloat16) if self.tensors[name]["dtype"] == "bfloat16" else t

    @property
    def tokenizer_path(self) -> Path | None:
        tok = self.manifest.get("tokenizer")
        return self.path / tok if tok else None


def damage(path: str | os.PathLike) -> str | None:
    """Why the store at ``path`` cannot be used (None: it can): a manifest that cannot be
    read, a tensor file missing, cut short, or not the manifest's shape, or a GGUF file that
    an index reads gone or changed. Reads headers only; a conversion (or index) into the
    cache runs again over a damaged store."""
    try:
        store = WeightStore(path)
    except ConfigError as e:
        return str(e).split(";")[0]
    for name in store.tensors:
        fault = store._fault(name)
        if fault is not None:
            return fault
    return None
