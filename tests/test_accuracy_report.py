"""The long-context accuracy report (benchmarks/long_context_accuracy_report.py): its bootstrap
intervals against the normal approximation they should approach, its paired differences
against the full cache, and its one-command rebuild from a JSONL."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import long_context_accuracy_report as report  # noqa: E402


def test_bootstrap_interval_is_near_the_normal_one_for_many_prompts():
    scores = [100.0] * 30 + [0.0] * 10  # mean 75, sd of the mean sqrt(.75 * .25 / 40)
    lo, hi = report.interval(scores)
    half = 1.96 * 100 * math.sqrt(0.75 * 0.25 / len(scores))
    assert lo < 75 < hi
    assert abs((hi - lo) / 2 - half) < 0.15 * half
    assert report.interval([50.0]) == (50.0, 50.0)  # one prompt: no spread to resample


def _row(policy, sample, score, task="single"):
    return {"policy": policy, "sample": sample, "task": task, "length": 8192, "depth": 0.5,
            "seed": 0, "score": score, "seconds": 1.0, "relative_kv_size": 0.1,
            "tokens": [1], "answers": ["1"], "output": "1"}


def test_paired_difference_counts_only_the_prompts_both_ran():
    rows = [_row("full", f"p{i}", 1.0) for i in range(6)]
    rows += [_row("infinigen", f"p{i}", 1.0 if i else 0.0) for i in range(3)]  # one lost of 3
    cell = report.summarize(rows)[8192]["infinigen"]
    assert cell["n"] == 3 and cell["minus_full"]["prompts"] == 3
    assert cell["minus_full"]["mean"] == -100 / 3
    lo, hi = cell["minus_full"]["interval95"]
    assert lo == -100 and hi == 0


def test_the_report_is_rebuilt_from_the_jsonl_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    lines = [_row("full", "a", 1.0), _row("kivi", "a", 0.5), _row("full", "a", 1.0)]
    (tmp_path / "long_context_accuracy_t.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in lines))
    assert report.main(["--tag", "t", "--model-name", "m"]) == 0
    summary = json.loads((tmp_path / "long_context_accuracy_t.json").read_text())
    assert summary["summary"]["8192"]["full"]["n"] == 1  # a repeated line counts once
    assert summary["settings"]["model"] == "m"
    assert "| kivi | 1 | 50.0" in (tmp_path / "long_context_accuracy_t.md").read_text()
    assert (tmp_path / "long_context_accuracy_t.png").is_file()
    assert report.main(["--tag", "absent"]) == 2
    assert capsys.readouterr().err.startswith("error:")
