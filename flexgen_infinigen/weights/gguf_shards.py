"""A split GGUF (llama.cpp's ``<name>-00001-of-0000N.gguf``) joined into one file that the
single-file GGUF converter reads.

The shards are checked first: each must be a GGUF whose ``split.no`` is its place and whose
``split.count`` is the number of shards, so a missing or foreign shard is one error before
anything is written. The join copies the metadata of the first shard (less the ``split.*``
keys) and every tensor's bytes as stored (its quantization kept), shard after shard, into a
temporary file that is renamed into place once complete: a joined file that exists is whole.
It lives in the cache next to the converted stores, named by the shards' folder (the Hub
snapshot, so one per commit) and is reused while it exists.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import sys
import uuid
from pathlib import Path

from ..config import ConfigError, default_cache_dir

_SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def _reader(label: str, path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {label}: shard {path.name} is not a readable GGUF ({e}); "
                          "download it again") from None


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def joined_path(shards: list[Path]) -> Path:
    first = shards[0]
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", first.stem)
    digest = hashlib.sha256(str(first.parent.absolute()).encode()).hexdigest()[:10]
    return default_cache_dir() / "gguf-joined" / f"{stem}-{digest}.gguf"


def check_shards(label: str, shards: list[Path]) -> list:
    """The shards' readers, each checked to be the shard its place says, or one error."""
    readers = []
    for i, path in enumerate(shards):
        if not path.is_file():
            raise ConfigError(f"--model {label}: shard {i + 1} of {len(shards)} ({path.name}) "
                              "is missing; download it again")
        r = _reader(label, path)
        no, count = _field(r, "split.no"), _field(r, "split.count")
        if count is not None and (count != len(shards) or no != i):
            raise ConfigError(f"--model {label}: {path.name} says it is shard {no + 1} of "
                              f"{count}, but it is file {i + 1} of {len(shards)}; the shards "
                              "do not belong together, download them again")
        readers.append(r)
    return readers


def joined_gguf(label: str, shards: list[Path], progress: bool = True) -> Path:
    """One GGUF holding every shard's tensors (made once, atomically)."""
    dest = joined_path(shards)
    if dest.is_file():
        return dest
    import gguf

    readers = check_shards(label, shards)
    first = readers[0]
    arch = _field(first, "general.architecture") or "llama"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        w = gguf.GGUFWriter(str(tmp), arch)
        for key, field in first.fields.items():
            if key.startswith("GGUF.") or key in _SPLIT_KEYS or key == "general.architecture":
                continue
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
            if key == "general.alignment":
                w.data_alignment = field.contents()
        for r in readers:
            for t in r.tensors:
                w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file(progress=progress)
        w.close()
        os.replace(tmp, dest)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        raise ConfigError(f"--model {label}: no room to join its {len(shards)} shards in "
                          f"{dest.parent} ({os.strerror(e.errno)}); free space or set "
                          "FLEXGEN_INFINIGEN_CACHE to a bigger disk") from None
    finally:
        tmp.unlink(missing_ok=True)
    print(f"joined {len(shards)} GGUF shards into {dest}", file=sys.stderr, flush=True)
    return dest
