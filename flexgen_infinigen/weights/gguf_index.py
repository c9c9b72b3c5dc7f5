"""Index a GGUF model in place: a store whose tensors are the GGUF file's own bytes.

``--model FILE.gguf`` (or a Hub GGUF, once downloaded) gets a store folder in the cache that
holds what a converted store holds (config, tokenizer.json, chat template, special ids, the
source's identity) but no tensor files: each tensor entry says which GGUF file holds it, at
which byte offset, how many bytes, its GGUF type and shape (:mod:`.in_place` reads them).
Indexing reads the file's header and metadata only, never a tensor's data, so the first run
takes no longer than later ones and the model's bytes exist once on disk.

The same checks as converting run first (:func:`.gguf_convert.prepare`: every tensor's type,
name and shape; the tokenizer), and each tensor must lie whole inside its file (a download
cut short is one error naming the tensor). A fused MoE expert tensor becomes one entry per
expert matrix, at its offset plus ``e`` times the bytes of one (a quantized row is whole
blocks, so every expert's run of rows is too). A llama q/k projection, whose rows llama.cpp
interleaved, records its head count: the store un-permutes it when asked for its values and
says the order of its rows when asked for its blocks. A tensor whose rows hold two of ours
that interleave (a hybrid's doubled ``attn_q``, :mod:`.gguf_hybrid`) gives each one entry
with its ``rows`` (runs of the stored rows) and ``stored_rows``: reading it copies those rows
(whole rows: blocks stay codes). A sharded model's entries point into
each shard. The store is written atomically (:class:`.StoreWriter`).
"""
from __future__ import annotations

import os
from pathlib import Path

from . import gguf_codes, gguf_hybrid
from .gguf_convert import finish, held_bytes, prepare
from .gguf_shards import JoinedReader, shard_paths
from .store import StoreWriter


def index_gguf(gguf_path: str | os.PathLike, dest: str | os.PathLike,
               name: str | None = None, pre_tokenizer: str | None = None,
               extra: dict | None = None) -> Path:
    """Write an index store of the GGUF model ``gguf_path`` (any shard of a split one) at
    ``dest``; ``extra`` goes into its manifest (the source identity). One error before
    anything is written for a file that cannot be read in place."""
    src, dest = Path(gguf_path), Path(dest)
    paths = [p.absolute() for p in shard_paths(src)]
    prep = prepare(src, name, pre_tokenizer, extra)
    readers = prep.reader.readers if isinstance(prep.reader, JoinedReader) else [prep.reader]
    files = []
    for p in paths:
        st = p.stat()
        files.append({"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    shard_of = {t.name: i for i, r in enumerate(readers) for t in r.tensors}
    entries = {}
    for t, keys, shape in prep.plan:  # every entry checked before the store is written
        kind, i, start = t.tensor_type.name, shard_of[t.name], int(t.data_offset)
        whole = (len(keys), *shape) if len(keys) > 1 else shape
        have = max(0, min(int(t.n_bytes), files[i]["size"] - start))
        per = held_bytes(t.name, have, kind, whole, src) // len(keys)
        entry = {"shape": [int(d) for d in shape], "file": i, "bytes": per}
        if kind in gguf_codes.BLOCKS:
            entry.update(dtype="uint8", gguf_type=kind)
        else:
            entry["dtype"] = gguf_codes.FLOATS[kind]
        heads = prep.rotary_heads.get(keys[0])
        if heads:
            entry["heads"] = heads
        picks = gguf_hybrid.row_picks(keys, prep.cfg)
        for e, key in enumerate(keys):  # a fused tensor: matrix e is its e-th run of rows
            entries[key] = {**entry, "offset": start + e * per}
            if picks is not None:  # rows that interleave: each key's picked from the whole
                entries[key].update(offset=start, rows=[list(r) for r in picks[e]],
                                    stored_rows=sum(c for runs in picks for _, c in runs))
    with StoreWriter(dest, prep.cfg, source=f"gguf:{src.name}",
                     extra={**prep.info, "files": files}) as writer:
        for key, entry in entries.items():
            writer.add_in_place(key, entry)
        finish(writer, prep)
    return dest
