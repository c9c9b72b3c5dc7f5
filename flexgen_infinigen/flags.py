"""Argument types shared by every command line and by the KV policies' own flags (a policy
adds its flags itself, so these live below the policies, not in a command)."""
from __future__ import annotations

import argparse


def str2bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


def int_or_auto(v: str) -> int | str:
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or auto, got {v!r}") from None
