"""benchmarks/artifacts.py: a rerun appends to its JSON's runs, and each table cell is the
median, min and max over those runs, checked against the statistics module by hand."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import artifacts  # noqa: E402


def _run(value, policy="full", context=4096):
    return {"meta": {"date": "d", "commit": "c", "cpu": "cpu", "cores": 2},
            "rows": [{"policy": policy, "context": context, "tokens_per_s": value}]}


def test_a_rerun_appends_and_fresh_starts_again(tmp_path):
    stem = tmp_path / "bench"
    artifacts.append_run(stem, _run(1.0), benchmark="b")
    doc = artifacts.append_run(stem, _run(3.0), benchmark="b", settings={"steps": 4})
    on_disk = json.loads(stem.with_suffix(".json").read_text())
    assert on_disk == doc and [r["rows"][0]["tokens_per_s"] for r in doc["runs"]] == [1.0, 3.0]
    assert doc["settings"] == {"steps": 4} and doc["benchmark"] == "b"
    assert len(artifacts.append_run(stem, _run(5.0), fresh=True)["runs"]) == 1
    assert not list(tmp_path.glob("*.tmp"))  # written whole, through a temporary file


def test_a_run_without_meta_gets_this_machines(tmp_path):
    doc = artifacts.append_run(tmp_path / "b", {"rows": []})
    meta = doc["runs"][0]["meta"]
    assert meta["cores"] >= 1 and len(meta["date"]) == 10 and meta["cpu"]


def test_bad_inputs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="rows"):
        artifacts.append_run(tmp_path / "b", {"meta": {}})
    (tmp_path / "old.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="no 'runs' list"):
        artifacts.append_run(tmp_path / "old", _run(1.0))


def test_cells_are_the_median_and_range_over_runs():
    values = [12.0, 9.5, 14.25, 10.0]
    med = statistics.median(values)  # 11.0: the mean of the middle two
    assert artifacts.spread(values, "{:.2f}") == f"{med:.2f} (9.50–14.25, 4 runs)"
    assert artifacts.spread([2.0]) == "2 (1 run)"
    assert artifacts.spread([None, None]) == ""
    runs = [_run(v) for v in values] + [_run(7.0, policy="infinigen")]
    runs[0]["rows"].append({"policy": "infinigen", "context": 4096, "tokens_per_s": 9.0})
    text = artifacts.table(runs, ["policy", "context"], [("tok/s", "tokens_per_s")],
                           fmt="{:.2f}")
    lines = text.splitlines()
    assert lines[0] == "| policy | context | tok/s |"
    assert lines[2] == "| full | 4096 | 11.00 (9.50–14.25, 4 runs) |"
    assert lines[3] == "| infinigen | 4096 | 8.00 (7.00–9.00, 2 runs) |"
    assert len(lines) == 4
    assert artifacts.meta_line(runs[:2]).startswith("2 runs; machine: cpu, 2 cores")
