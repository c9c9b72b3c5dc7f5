"""A GGUF model split into shards (``name-00001-of-00003.gguf`` ...), read as one file.

llama.cpp's ``gguf-split`` writes the model's metadata into the first shard and spreads the
tensors over all of them (each shard says how many there are in ``split.count``). Naming
any shard names the model; every shard must be there, or one error names the first one
missing before anything is converted.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..config import ConfigError

SHARD_RE = re.compile(r"(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf")


def shard_paths(path: Path) -> list[Path]:
    """Every shard of the model ``path`` belongs to, in order (``[path]`` for a whole file);
    one error naming a missing shard."""
    m = SHARD_RE.fullmatch(path.name)
    if m is None:
        return [path]
    count = int(m.group("count"))
    width = len(m.group("index"))
    paths = [path.with_name(f"{m.group('stem')}-{i:0{width}d}-of-{m.group('count')}.gguf")
             for i in range(1, count + 1)]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise ConfigError(f"GGUF shard {missing[0]} is missing ({len(missing)} of {count} "
                          f"shards of {m.group('stem')} are absent); download every shard "
                          "into the same folder")
    return paths


class JoinedReader:
    """The shards' readers seen as one: the first shard's metadata, every shard's tensors
    (``owner[name]``: the reader holding it)."""

    def __init__(self, readers: list, source: str):
        self.readers = readers
        self.fields = readers[0].fields
        self.tensors = [t for r in readers for t in r.tensors]
        self.owner = {t.name: r for r in readers for t in r.tensors}
        count = readers[0].fields.get("split.count")
        if count is not None and int(count.contents()) != len(readers):
            raise ConfigError(f"GGUF {source} says it has {int(count.contents())} shards, "
                              f"{len(readers)} were found; download every shard")
        if len(self.owner) != len(self.tensors):
            raise ConfigError(f"GGUF {source}: a tensor appears in two shards; the shards "
                              "are not from one model")
