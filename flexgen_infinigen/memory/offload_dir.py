"""The disk tier's folders: each run writes under its own ``flexgen_infinigen-*`` folder with
its pid in it, so that a later run can remove what a killed one left behind."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..config import ConfigError

DIR_PREFIX = "flexgen_infinigen-"
OWNER_FILE = "owner.pid"  # the pid of the run that owns an offload folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_folders(root: str | os.PathLike) -> None:
    """Delete offload folders under ``root`` whose run is gone (killed, or crashed before its
    cleanup); folders of live runs, and folders that are not ours, are left alone."""
    for folder in Path(root).glob(DIR_PREFIX + "*"):
        try:
            pid = int((folder / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not _alive(pid):
            shutil.rmtree(folder, ignore_errors=True)


def offload_root(offload_dir: str | None) -> str:
    """The folder offload files go under, created when missing and checked writable."""
    root = offload_dir or tempfile.gettempdir()
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--offload-dir {root} cannot be created ({e.strerror}); pick a "
                          "writable folder") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"--offload-dir {root} is not writable; pick a writable folder")
    return root
