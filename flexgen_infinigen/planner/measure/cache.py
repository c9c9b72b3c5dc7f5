"""This machine's profile saved in the cache folder: where it lives, reading it without
measuring, and measuring (quick) when none is saved."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from ..hardware import HardwareProfile
from .machine import measure_hardware


def cache_path() -> Path:
    """``hw.json`` in the cache folder, which optimize and ``--percent auto`` use by default."""
    from ...weights.embedded import default_cache_dir
    return default_cache_dir() / "hw.json"


def saved_profile() -> HardwareProfile | None:
    """This machine's saved profile; None when there is none or it cannot be read (an older
    version's). Never measures."""
    try:
        with open(cache_path()) as f:
            return HardwareProfile.from_dict(json.load(f))
    except (OSError, ValueError):
        return None


def save_to_cache(prof: HardwareProfile) -> Path:
    """Write ``prof`` as this machine's saved profile, whole or not at all; returns the path."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        json.dump(prof.to_dict(), tmp, indent=1)
    os.replace(tmp.name, path)
    return path


def cached_profile(progress: bool = True) -> HardwareProfile:
    """This machine's saved profile, measured (quick) and saved first if there is none."""
    from ...engine.loading import resolve_device

    prof = saved_profile()
    if prof is None:
        prof = measure_hardware(resolve_device("auto"), quick=True, progress=progress)
        try:
            save_to_cache(prof)
        except OSError as e:  # a read-only cache costs a measurement a run, not the run
            print(f"warning: this machine's profile could not be saved to {cache_path()} "
                  f"({e.strerror or type(e).__name__}); the next run measures it again",
                  file=sys.stderr)
    return prof
