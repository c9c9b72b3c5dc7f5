"""Faults a user meets: interruptions and signals clean up after themselves, a missing offload
folder is created, a full disk is one clear line, leftovers of killed runs are removed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ON_DISK = ["--percent", "0", "0", "0", "0", "100", "0"]  # weights and cache on disk


def _cli(args, **kw):
    return subprocess.Popen([sys.executable, "-m", "flexgen_infinigen.run", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _ours(folder: Path) -> list[Path]:
    return sorted(folder.glob("flexgen_infinigen-*")) if folder.is_dir() else []


def test_missing_offload_dir_is_created_and_emptied(tiny_opt, tmp_path):
    target = tmp_path / "not" / "yet" / "there"
    proc = _cli(["--path", tiny_opt[1], "--prompt-len", "8", "--gen-len", "3",
                 "--offload-dir", target, *ON_DISK])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert target.is_dir() and _ours(target) == []  # created, and the run's files removed


def _wait_for_folder(root: Path, proc, timeout=120.0) -> Path:
    start = time.time()
    while time.time() - start < timeout:
        found = _ours(root)
        if found and any(found[0].glob("*.bin")):
            return found[0]
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.05)
    raise AssertionError("the run never created its offload files")


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_cleans_up_with_one_line(smollm2_store, tmp_path, sig, code):
    proc = _cli(["--path", smollm2_store, "--prompt-len", "16", "--gen-len", "200", "--no-stop",
                 "--offload-dir", tmp_path, *ON_DISK])
    _wait_for_folder(tmp_path, proc)
    time.sleep(1.0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "Traceback" not in err
    assert _ours(tmp_path) == []


def test_killed_run_leftovers_are_removed_by_the_next_run(smollm2_store, tiny_opt, tmp_path):
    proc = _cli(["--path", smollm2_store, "--prompt-len", "16", "--gen-len", "200", "--no-stop",
                 "--offload-dir", tmp_path, *ON_DISK])
    left = _wait_for_folder(tmp_path, proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert left.is_dir()  # SIGKILL: nothing could clean up
    again = _cli(["--path", tiny_opt[1], "--prompt-len", "8", "--gen-len", "2",
                  "--offload-dir", tmp_path, *ON_DISK])
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert _ours(tmp_path) == []


def test_full_disk_is_one_clear_error_not_a_bus_error(tmp_path):
    """On a 1 MiB filesystem made for the test (needs the right to mount one): the disk tier
    reserves a file's blocks when it creates it, so running out is a ConfigError naming the
    folder, not a SIGBUS when a page of a sparse file is first written."""
    import torch

    from flexgen_infinigen.config import ConfigError
    from flexgen_infinigen.memory.tiers import Tiers

    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {made.stderr.strip()}")
    try:
        tiers = Tiers(torch.device("cpu"), offload_dir=str(mount))
        small = tiers.empty("disk", (1000,), torch.float32)  # fits
        small[:] = 1.0
        with pytest.raises(ConfigError, match="no room") as e:
            tiers.empty("disk", (1 << 20,), torch.float32)  # 4 MiB does not
        assert str(mount) in str(e.value)
        del small
        tiers.close()
        assert _ours(mount) == []
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_signal_dropped_inside_a_finalizer_still_stops_the_command(capsys):
    """Python drops what a signal handler raises while a finalizer runs (CI once saw a run
    ignore Ctrl-C this way); the command still stops, at its next step, with its one line."""
    import gc
    import weakref

    from flexgen_infinigen.guards import raise_if_interrupted, run_command

    def main(argv):
        class Held:
            pass

        def finalizer():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10000):  # the handler runs here, inside the finalizer
                pass

        held = Held()
        weakref.finalize(held, finalizer)
        del held
        gc.collect()
        raise_if_interrupted()  # what every generation step does
        return 0

    assert run_command(main) == 130
    assert "interrupted" in capsys.readouterr().err
