"""``--model`` given as a path (a GGUF file or a Hugging Face checkpoint folder) or as a
Hub name (``org/name``, ``org/name:QUANT``, ``org/name/FILE.gguf``), which :mod:`.hub`
first turns into such a path in the Hugging Face cache.

Precedence: a registry name (``opt-13b``) is the registry's; an existing file or folder is
local; any other ``org/name`` is the Hub's, except that a registry alias such as
``facebook/opt-13b`` keeps naming the registry's shapes where only shapes are wanted
(``--dummy``, ``--path``).

The first use converts the source into a weight store in the cache
(``$FLEXGEN_INFINIGEN_CACHE/stores/<name>-<hash of the source's absolute path>``); later
uses find that store and skip the conversion while the source's identity is unchanged. A
GGUF is not converted but indexed (:mod:`.gguf_index`): its store holds the config,
tokenizer and where each tensor lies in the file, which is then read in place.
The identity is every source file's name, size and modification time (nanoseconds), plus
the converter's version: cheap to read, so a 100 GB checkpoint is not hashed at every
start, and any rewrite of a file (a new download, an edit) changes it. A changed source is
converted again, over the old store, and so is a damaged store (a tensor file missing or cut
short, a manifest that cannot be read, an indexed GGUF gone or changed). Stores are written
atomically (:class:`.StoreWriter`), so an interrupted conversion leaves nothing that later
looks complete.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

from ..config import KNOWN_MODELS, ConfigError, ModelConfig, writable_folder
from .hub_files import parse_hub_name
from .store import MANIFEST, damage

# bump when a conversion would now write something different (a tokenizer fix, say)
# 3: GGUF tensors kept as the file's codes (store format 2); 4: a GGUF indexed in place
# (store format 3), which replaces a store copied by 3
CONVERTER_VERSION = 4
_CHECKPOINT_FILES = ("*.safetensors", "*.bin", "*.json", "merges.txt", "tokenizer.model")


def is_registry_alias(model: str | None) -> bool:
    """A registry name spelled as its Hub repo (``facebook/opt-13b``)."""
    return bool(model) and model.lower().startswith("facebook/") and \
        model.lower().split("/", 1)[1] in KNOWN_MODELS


def is_model_path(model: str | None, shapes_only: bool = False) -> bool:
    """True when ``--model`` names weights (a file, a folder or a Hub repo) rather than a
    registry name. ``shapes_only``: the command brings its own weights or none (``--path``,
    ``--dummy``), so a registry alias stays the registry's."""
    if not model or model.lower() in KNOWN_MODELS:
        return False
    if model.endswith(".gguf") and parse_hub_name(model) is None:
        return True
    if Path(model).expanduser().exists():
        return True
    if parse_hub_name(model) is not None:
        return not (shapes_only and is_registry_alias(model))
    return model.endswith(".gguf")


def _source(model: str, config_only: bool = False, progress: bool = True
            ) -> tuple[Path, str]:
    """(absolute source path, "gguf" or "hf"), or one error saying what a path must be. A
    Hub name is fetched first (``config_only``: what the config needs)."""
    if not Path(model).expanduser().exists() and parse_hub_name(model) is not None:
        from .hub import resolve
        path = resolve(model, progress, config_only).absolute()  # a snapshot's links kept
        return path, ("gguf" if path.suffix == ".gguf" else "hf")
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


def cache_store_path(path: Path, cache_dir: Path | None = None, model: str | None = None
                     ) -> Path:
    from .embedded import default_cache_dir

    hub = parse_hub_name(model) if model and not Path(model).expanduser().exists() else None
    stem = path.stem if path.is_file() else path.name
    if hub is not None and path.suffix != ".gguf":  # a snapshot folder is named by its commit
        stem = hub.repo.replace("/", "--")
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", stem)
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:10]
    # a GGUF's store holds its codes (an index of them, store format 3): its own folder, so
    # that a version reading only format 1 (floats) never finds it, nor converts over it
    codes = "-codes" if path.suffix == ".gguf" else ""
    return default_cache_dir(cache_dir) / "stores" / f"{stem}-{digest}{codes}"


def _stored_identity(store: Path) -> dict | None:
    try:
        return json.loads((store / MANIFEST).read_text()).get("source_identity")
    except (OSError, ValueError):
        return None


def source_config(model: str) -> ModelConfig:
    """The model's config read from the source's metadata, converting nothing."""
    path, kind = _source(model, config_only=True)
    if kind == "gguf":
        from .gguf_config import config_from_gguf, open_model
        store = cache_store_path(path, None, model)
        if _stored_identity(store) == identity(path, kind):  # read once, when indexed
            try:
                return ModelConfig.from_dict(json.loads((store / MANIFEST).read_text())["config"])
            except (OSError, ValueError, KeyError, TypeError):
                pass  # a damaged store: the file's own metadata below
        return config_from_gguf(open_model(path), None, str(path))
    from .hf_config import config_from_hf
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path / 'config.json'} ({e}); fix the folder") from None
    return config_from_hf(hf, _display_name(model, path))


def store_for(model: str, progress: bool = True, cache_dir: Path | None = None,
              pre_tokenizer: str | None = None) -> Path:
    """The weight store of ``--model PATH``: found in the cache, or made now (a GGUF
    indexed in place, a checkpoint converted)."""
    path, kind = _source(model, progress=progress)
    ident = identity(path, kind)
    store = cache_store_path(path, cache_dir, model)
    fault = None
    if _stored_identity(store) == ident:
        fault = damage(store)  # a damaged store is converted again, over itself
        if fault is None:
            return store
    why = "first use" if not store.exists() else "the source changed" if fault is None \
        else f"the store is damaged: {fault}"
    writable_folder(store.parent)
    verb = "indexing" if kind == "gguf" else "converting"
    print(f"{verb} {path} into {store} ({why})", file=sys.stderr, flush=True)
    extra = {"source_identity": ident}
    if kind == "gguf":  # read in place: the store is an index, no tensor is copied
        from .gguf_index import index_gguf
        return index_gguf(path, store, pre_tokenizer=pre_tokenizer, extra=extra)
    from .hf_convert import convert_hf
    return convert_hf(path, store, _display_name(model, path), progress=progress, extra=extra)


def _display_name(model: str, path: Path) -> str:
    """A checkpoint's name: its folder's, or a Hub repo's (its snapshot folder is a commit)."""
    hub = parse_hub_name(model) if not Path(model).expanduser().exists() else None
    return hub.repo.split("/")[-1] if hub is not None else path.name

