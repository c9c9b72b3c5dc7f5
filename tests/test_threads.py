"""``--threads N`` (llama.cpp's ``-t``): the run computes on N threads and says so in its
report, greedy tokens do not depend on the count (every kernel computes a row whole on one
thread; MKL runs in its reproducible mode), and a bad count is one error before loading."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _run(args: list[str], tmp_path, name: str):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "flexgen_infinigen.run", "--model",
                           "smollm2-135m", "--dummy", "--prompt-len", "16", "--gen-len", "6",
                           "--no-stop", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=600)
    return proc, (json.loads(out.read_text()) if out.is_file() else None)


def test_threads_set_the_count_and_keep_the_tokens(tmp_path):
    one, report_one = _run(["--threads", "1"], tmp_path, "one")
    two, report_two = _run(["--threads", "2"], tmp_path, "two")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert report_one["threads"] == 1 and report_two["threads"] == 2
    assert "(1 thread)" in one.stdout and "(2 threads)" in two.stdout
    assert report_one["token_ids"] == report_two["token_ids"]


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_bad_thread_count_is_one_error_before_loading(tmp_path, value):
    proc, report = _run(["--threads", value], tmp_path, "bad")
    assert proc.returncode == 2 and report is None
    last = proc.stderr.strip().splitlines()[-1]
    assert "--threads" in last and "Traceback" not in proc.stderr, proc.stderr
