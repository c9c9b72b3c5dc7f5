"""scripts/gpu_check.py fails when a step fails, keeps what the step wrote to stderr, and runs
every step in its own process under a time limit."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402


def _stand_in(code: str):
    """A step whose command is ``python -c code``, run as gpu_check runs a test shard."""
    def step(a):
        return gpu_check.run_command(a, "stand-in", [sys.executable, "-c", code])
    return step


def _check(monkeypatch, tmp_path, code, *flags):
    monkeypatch.setitem(gpu_check.STEPS, "stand-in", _stand_in(code))
    rc = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--steps", "stand-in", *flags])
    return rc, json.loads((tmp_path / "stand-in.json").read_text())


def test_a_failing_step_fails_the_check_and_keeps_its_stderr(monkeypatch, tmp_path, capsys):
    rc, record = _check(monkeypatch, tmp_path, "import sys; print('some output'); "
                        "sys.stderr.write('the reason it failed\\n'); sys.exit(3)")
    assert rc != 0
    assert record["status"] == "failed"
    assert record["result"]["returncode"] == 3
    assert "the reason it failed" in record["result"]["stderr_tail"]
    assert "some output" in record["result"]["stdout_tail"]
    assert "the reason it failed" in (tmp_path / "stand-in.stderr.txt").read_text()
    assert "error: step stand-in failed" in capsys.readouterr().err


def test_a_passing_step_passes(monkeypatch, tmp_path):
    rc, record = _check(monkeypatch, tmp_path, "print('fine')")
    assert rc == 0 and record["status"] == "ok"


def test_a_step_past_its_limit_fails_with_what_it_wrote(monkeypatch, tmp_path):
    rc, record = _check(monkeypatch, tmp_path, "import sys, time; sys.stderr.write('started\\n');"
                        " sys.stderr.flush(); time.sleep(60)", "--step-limit", "2")
    assert rc != 0 and record["status"] == "failed" and record["result"]["timed_out"]
    assert "started" in record["result"]["stderr_tail"]
    assert record["result"]["seconds"] < 30


def test_a_failing_test_shard_fails_the_check(monkeypatch, tmp_path):
    """A shard whose tests cannot even be collected (a dry run collects only) fails, with
    pytest's report kept."""
    bad = tmp_path / "test_stand_in.py"
    bad.write_text("raise RuntimeError('broken test module')\n")
    monkeypatch.setitem(gpu_check.TEST_SHARDS, "stand-in", [str(bad)])
    monkeypatch.setitem(gpu_check.STEPS, "stand-in", gpu_check.test_step("stand-in"))
    out = tmp_path / "out"
    rc = gpu_check.main(["--dry-run", "--out", str(out), "--steps", "stand-in"])
    record = json.loads((out / "stand-in.json").read_text())
    assert rc != 0 and record["status"] == "failed"
    assert "broken test module" in record["result"]["stdout_tail"] + \
        record["result"]["stderr_tail"]


def test_every_step_has_its_own_command_and_the_matrix_is_split():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--list"],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert {line.split()[-1] for line in out if line} == set(gpu_check.STEPS)
    shards = [s for s in gpu_check.TEST_SHARDS.values() if gpu_check.MATRIX in " ".join(s)]
    assert len(shards) >= 4


@pytest.mark.parametrize("shard", [s for s in gpu_check.TEST_SHARDS if "matrix" in s])
def test_the_matrix_shards_cover_the_matrix_once(shard):
    """The four matrix shards collect 18 of its 72 cases each, and the core shard none."""
    def collected(args):
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only",
                              "-p", "no:cacheprovider", *args], cwd=ROOT, capture_output=True,
                             text=True)
        return [line for line in out.stdout.splitlines() if "::" in line]
    cases = collected(gpu_check.TEST_SHARDS[shard])
    assert len(cases) == 18 and all(gpu_check.MATRIX in c for c in cases)


def test_a_short_budget_runs_what_fits_and_the_report_merges_two_calls(tmp_path):
    """Two dry-run calls as a lease makes them: the first's paper step under a budget, the
    second ``--only`` one variant; the report merges them by label, with the optimizer's
    prediction for each paper row and the link bound from the first call's bandwidth."""
    first, second = tmp_path / "one", tmp_path / "two"
    script = str(ROOT / "scripts" / "gpu_check.py")
    subprocess.run([sys.executable, script, "--dry-run", "--out", str(first), "--budget", "120",
                    "--steps", "bandwidth", "paper", "--warm-once"], check=True)
    label = "full, no overlap"
    subprocess.run([sys.executable, script, "--dry-run", "--out", str(second), "--steps",
                    "paper", "--only", label], check=True)
    again = json.loads((second / "paper.json").read_text())["result"]["runs"]
    assert [r["label"] for r in again] == [label]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_report
    doc = gpu_report.collect([str(first), str(second)])
    rows = {r["label"]: r for r in doc["paper"]["rows"]}
    first_rows = json.loads((first / "paper.json").read_text())["result"]["runs"]
    assert set(rows) == {r["label"] for r in first_rows}  # one row a label, none twice
    assert rows[label]["step_s"] == again[0]["decode_step_median_s"]  # the later call's
    assert all(r["predicted_step_s"] > 0 for r in rows.values())
    assert rows["full"]["speedup_vs_full"] == 1
