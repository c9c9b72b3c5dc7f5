"""What every command line shares about failing well: one line per error, a clean exit on
Ctrl-C and SIGTERM (cleanup runs: ``finally`` blocks and context managers unwind), and
output paths checked before any long work starts."""
from __future__ import annotations

import errno
import os
import signal
import sys
from pathlib import Path

from .config import ConfigError


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM, so that the same cleanup as Ctrl-C runs."""


_stopping: list[type[BaseException]] = []  # the interruption received, if any


def _on_signal(signum, frame):
    stop = KeyboardInterrupt if signum == signal.SIGINT else Terminated
    _stopping[:] = [stop]
    raise stop()


def raise_if_interrupted() -> None:
    """Raise the Ctrl-C or SIGTERM received earlier again: Python drops an exception that a
    signal handler raises while a finalizer (garbage collection) runs, so long loops call
    this once per step and a signal is never lost."""
    if _stopping:
        raise _stopping[0]()


def check_output_path(path: str | None, flag: str) -> None:
    """One error now, not after the generation, when ``path`` cannot be written."""
    if not path:
        return
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file name")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ConfigError(f"{flag} {path} is not writable; pick another path")


def run_command(main, argv=None) -> int:
    """Run a command's ``main`` with the shared handling of errors and interruptions."""
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    _stopping.clear()
    try:
        return main(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C); temporary files removed", file=sys.stderr)
        return 130
    except Terminated:
        print("terminated (SIGTERM); temporary files removed", file=sys.stderr)
        return 143
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            where = f" ({e.filename})" if e.filename else ""
            print(f"error: the disk is full{where}; free space or point --offload-dir at "
                  "another disk", file=sys.stderr)
            return 2
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stopping.clear()
