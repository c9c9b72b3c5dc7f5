"""Every environment variable the package reads, in one place: its name, its type, its default
and what it switches. Nothing else in the package reads the environment (a test checks it).

Each is read when asked for, not at import: a test, or a user between two runs in one
process, may set one and the next call sees it. Flags read ``1 true yes on`` as on and
``0 false no off`` as off (any case); another value, or none, is the default.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch:
    name: str
    kind: type  # bool, int, float, str or Path: what :meth:`get` returns
    default: object  # what an unset (or empty) variable means
    doc: str

    def raw(self) -> str | None:
        """The variable as set, or None when unset or blank."""
        value = os.environ.get(self.name)
        return value if value is not None and value.strip() else None

    def get(self):
        value = self.raw()
        if value is None:
            return self.default
        if self.kind is bool:
            low = value.strip().lower()
            return True if low in _TRUE else False if low in _FALSE else self.default
        if self.kind is Path:
            return Path(value).expanduser()
        return self.kind(value)

    def is_set(self) -> bool:
        return self.name in os.environ

    def set(self, value: str) -> None:
        """Set it for this process and the processes it starts (``--offline``)."""
        os.environ[self.name] = value

    def set_default(self, value: str) -> None:
        """Set it unless the user has: a value the user gave is kept."""
        os.environ.setdefault(self.name, value)


# ---- the package's own --------------------------------------------------------------------
CACHE = Switch("FLEXGEN_INFINIGEN_CACHE", Path, None,
               "the cache folder (weight stores, compiled kernels, hardware profiles); "
               "unset: ~/.cache/flexgen_infinigen")
SMOLLM2_GGUF = Switch("FLEXGEN_INFINIGEN_SMOLLM2_GGUF", Path, None,
                      "a local SmolLM2-135M-Instruct GGUF for the default model (no download)")
KERNELS = Switch("FLEXGEN_INFINIGEN_KERNELS", bool, True,
                 "compile and use the CPU kernels (off: torch operations only)")
GGUF_BLOCKS = Switch("FLEXGEN_INFINIGEN_GGUF_BLOCKS", bool, True,
                     "a CPU multiplies a GGUF's quantized tensors as the file's blocks, read "
                     "where the file lies (off: as codes copied into memory, 8-bit for "
                     "Q5/Q6/Q8 types, the form a GPU takes)")
FUSED = Switch("FLEXGEN_INFINIGEN_FUSED", bool, True,
               "a CPU decode step's layer (and MoE stage) as one compiled call (off: the "
               "per-operation path)")
MAPPED_ROWS = Switch("FLEXGEN_MAPPED_ROWS", bool, True,
                     "a GPU reads chosen KV rows from pinned host memory where they are")
HUGE_PAGES = Switch("FLEXGEN_INFINIGEN_HUGE_PAGES", bool, True,
                    "ask Linux for 2 MB pages under large buffers")
SELECT_FROM_MB = Switch("FLEXGEN_INFINIGEN_SELECT_FROM_MB", float, None,
                        "InfiniGen's default --select-from-mb (unset: by device)")
API_KEY = Switch("FLEXGEN_INFINIGEN_API_KEY", str, None,
                 "the server's default --api-key (unset: open)")

# ---- the tools' own, read as they read them ------------------------------------------------
CC = Switch("CC", str, None, "the C compiler for the CPU kernels (unset: gcc, else cc)")
MKL_CBWR = Switch("MKL_CBWR", str, None,
                  "MKL's reproducibility mode (the package sets AUTO,STRICT unless given)")
HF_HUB_OFFLINE = Switch("HF_HUB_OFFLINE", bool, False,
                        "the Hugging Face cache only, no request (what --offline sets)")
HF_HUB_CACHE = Switch("HF_HUB_CACHE", Path, None, "huggingface_hub's repository cache")
HF_HOME = Switch("HF_HOME", Path, None, "huggingface_hub's home (its cache under hub/)")
XDG_CACHE_HOME = Switch("XDG_CACHE_HOME", Path, None, "the user's cache home")
HF_ENDPOINT = Switch("HF_ENDPOINT", str, "https://huggingface.co", "the Hub's address")
HF_TOKEN = Switch("HF_TOKEN", str, None, "a Hub token (unset: huggingface_hub's login)")
# torchrun's description of a pipeline's processes
RANK = Switch("RANK", int, None, "this process's rank (torchrun)")
WORLD_SIZE = Switch("WORLD_SIZE", int, None, "the number of processes (torchrun)")
LOCAL_RANK = Switch("LOCAL_RANK", int, None, "this process's rank on its machine (torchrun)")
MASTER_ADDR = Switch("MASTER_ADDR", str, None, "the first rank's address (torchrun)")
MASTER_PORT = Switch("MASTER_PORT", str, None, "the first rank's port (torchrun)")

ALL = [CACHE, SMOLLM2_GGUF, KERNELS, GGUF_BLOCKS, FUSED, MAPPED_ROWS, HUGE_PAGES, SELECT_FROM_MB,
       API_KEY, CC, MKL_CBWR, HF_HUB_OFFLINE, HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME, HF_ENDPOINT,
       HF_TOKEN, RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT]


def table() -> str:
    """The switches as a Markdown table (docs/usage/switches.md is this)."""
    rows = ["| variable | type | default | what it does |", "| --- | --- | --- | --- |"]
    for s in ALL:
        rows.append(f"| `{s.name}` | {s.kind.__name__} | {s.default} | {s.doc} |")
    return "\n".join(rows)
