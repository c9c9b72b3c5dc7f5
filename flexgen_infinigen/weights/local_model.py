"""``--model`` given as a path: a GGUF file or a Hugging Face checkpoint folder.

The first use converts the source into a weight store in the cache
(``$FLEXGEN_INFINIGEN_CACHE/stores/<name>-<hash of the source's absolute path>``); later
uses find that store and skip the conversion while the source's identity is unchanged.
The identity is every source file's name, size and modification time (nanoseconds), plus
the converter's version: cheap to read, so a 100 GB checkpoint is not hashed at every
start, and any rewrite of a file (a new download, an edit) changes it. A changed source is
converted again, over the old store. Stores are written atomically (:class:`.StoreWriter`),
so an interrupted conversion leaves nothing that later looks complete.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

from ..config import KNOWN_MODELS, ConfigError, ModelConfig
from .store import MANIFEST

# bump when a conversion would now write something different (a tokenizer fix, say)
CONVERTER_VERSION = 3  # 3: GGUF tensors kept as the file's codes (store format 2)
_CHECKPOINT_FILES = ("*.safetensors", "*.bin", "*.json", "merges.txt", "tokenizer.model")


def is_model_path(model: str | None) -> bool:
    """True when ``--model`` names a file or folder rather than a registry name."""
    if not model or model.lower() in KNOWN_MODELS:
        return False
    return model.endswith(".gguf") or Path(model).expanduser().exists()


def _source(model: str) -> tuple[Path, str]:
    """(absolute source path, "gguf" or "hf"), or one error saying what a path must be."""
    path = Path(model).expanduser().resolve()
    if path.is_file() and path.suffix == ".gguf":
        return path, "gguf"
    if path.is_dir() and (path / "config.json").is_file():
        return path, "hf"
    if not path.exists():
        raise ConfigError(f"--model {model}: no such file or folder; give a .gguf file, a "
                          "Hugging Face checkpoint folder, or a registry name")
    raise ConfigError(f"--model {model} is neither a .gguf file nor a Hugging Face checkpoint "
                      "folder (config.json + weights); point it at one of those")


def identity(path: Path, kind: str) -> dict:
    """What decides whether a converted store is still this source's (see the module doc)."""
    from .gguf_shards import shard_paths

    files = shard_paths(path) if kind == "gguf" else sorted(
        {f for pattern in _CHECKPOINT_FILES for f in path.glob(pattern) if f.is_file()})
    stats = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    return {"path": str(path), "files": stats, "converter": CONVERTER_VERSION}


def cache_store_path(path: Path, cache_dir: Path | None = None) -> Path:
    from .embedded import default_cache_dir

    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem if path.is_file() else path.name)
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:10]
    # a GGUF's store holds its codes (store format 2): its own folder, so that a version
    # reading only format 1 (floats) never finds it, nor converts over it
    codes = "-codes" if path.suffix == ".gguf" else ""
    return default_cache_dir(cache_dir) / "stores" / f"{stem}-{digest}{codes}"


def _stored_identity(store: Path) -> dict | None:
    try:
        return json.loads((store / MANIFEST).read_text()).get("source_identity")
    except (OSError, ValueError):
        return None


def source_config(model: str) -> ModelConfig:
    """The model's config read from the source's metadata, converting nothing."""
    path, kind = _source(model)
    if kind == "gguf":
        from .gguf_convert import config_from_gguf, open_model
        return config_from_gguf(open_model(path), None, str(path))
    from .hf_config import config_from_hf
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path / 'config.json'} ({e}); fix the folder") from None
    return config_from_hf(hf, path.name)


def store_for(model: str, progress: bool = True, cache_dir: Path | None = None,
              pre_tokenizer: str | None = None) -> Path:
    """The weight store of ``--model PATH``: found in the cache, or converted now."""
    path, kind = _source(model)
    ident = identity(path, kind)
    store = cache_store_path(path, cache_dir)
    if _stored_identity(store) == ident:
        return store
    why = "first use" if not store.exists() else "the source changed"
    print(f"converting {path} into {store} ({why})", file=sys.stderr, flush=True)
    extra = {"source_identity": ident}
    store.parent.mkdir(parents=True, exist_ok=True)
    if kind == "gguf":
        from .gguf_convert import convert_gguf
        return convert_gguf(path, store, progress=progress, pre_tokenizer=pre_tokenizer,
                            extra=extra)
    from .hf_convert import convert_hf
    return convert_hf(path, store, None, progress=progress, extra=extra)

