"""One artifact set per results section: a JSON whose ``runs`` list grows by one entry each
time the benchmark runs again, a markdown table of medians over those runs, and a plot.

A run is ``{"meta": {...}, "rows": [{...}, ...], ...}``: ``meta`` says when, where and how it
ran (``run_meta``); each row is one measured configuration, a flat dict of key fields (model,
context, policy, ...) and numbers. ``append_run`` adds a run to ``STEM.json``; ``table``
groups the rows of every run by their key fields and writes each number as
``median (min-max, N runs)``, the form the results page uses for every cell.

Repeats are never separate files or rows: a benchmark run again with the same ``--out``
appends, and ``--fresh`` (where a script offers it) starts the list anew.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable

RESULTS = Path(__file__).resolve().parent / "results"
# where investigations write by default: a step towards a change, not a result the results page
# shows, so nothing of theirs lands in RESULTS unless asked for with --out
INVESTIGATIONS = Path(tempfile.gettempdir()) / "flexgen_infinigen_investigations"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parent, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run_meta(argv: list[str] | None = None, **extra) -> dict:
    """When, where and how this run was made: UTC date, commit, CPU, cores, the command."""
    argv = sys.argv if argv is None else argv
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "commit": _commit(), "cpu": cpu_name(), "cores": os.cpu_count(),
            "command": shlex.join(["python", *argv]) if argv else None}
    meta.update(extra)
    return meta


def load(stem: Path) -> dict:
    """``STEM.json`` as ``{"runs": [...], ...}``; an absent file is an empty list of runs."""
    path = Path(stem).with_suffix(".json")
    if not path.is_file():
        return {"runs": []}
    doc = json.loads(path.read_text())
    if not isinstance(doc.get("runs"), list):
        raise ValueError(f"{path} has no 'runs' list: it was written before runs were "
                         "appended; move it away or pass a new --out")
    return doc


def save(stem: Path, doc: dict) -> None:
    """Write ``STEM.json`` whole or not at all (a crash leaves the previous runs)."""
    path = Path(stem).with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def append_run(stem: Path, run: dict, fresh: bool = False, **about) -> dict:
    """Add ``run`` (given a ``meta`` from ``run_meta`` if it has none) to ``STEM.json``'s runs;
    ``about`` fields (what the benchmark measures, its settings) replace the file's own.
    Returns the whole document."""
    if not isinstance(run.get("rows"), list):
        raise ValueError("a run needs a 'rows' list of measured configurations")
    doc = {"runs": []} if fresh else load(stem)
    doc.update(about)
    run = dict(run)
    run.setdefault("meta", run_meta())
    doc["runs"] = [*doc["runs"], run]
    save(stem, doc)
    return doc


def write_report(stem: Path, doc: dict, settings: dict, markdown: Callable[[dict], str],
                 plot: Callable[[dict, Path], None]) -> None:
    """``STEM.md`` and ``STEM.png`` from every run of ``doc`` (its ``settings`` where the file
    had none), and the table on stdout; no runs is one error naming the file."""
    stem = Path(stem)
    if not doc["runs"]:
        raise SystemExit(f"no runs in {stem.with_suffix('.json')}")
    doc.setdefault("settings", settings)
    stem.with_suffix(".md").write_text(markdown(doc))
    plot(doc, stem.with_suffix(".png"))
    print(markdown(doc))


def spread(values: Iterable[float], fmt: str = "{:.3g}") -> str:
    """``median (min-max, N runs)``; one run is ``value (1 run)``; none is empty."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return ""
    med = fmt.format(statistics.median(xs))
    if len(xs) == 1:
        return f"{med} (1 run)"
    return f"{med} ({fmt.format(min(xs))}–{fmt.format(max(xs))}, {len(xs)} runs)"


def grouped(runs: list[dict], keys: list[str],
            where: Callable[[dict], bool] | None = None) -> dict[tuple, list[dict]]:
    """Every run's rows grouped by their ``keys`` fields, in the order keys first appear."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        for row in run["rows"]:
            if where is None or where(row):
                groups.setdefault(tuple(row.get(k) for k in keys), []).append(row)
    return groups


def table(runs: list[dict], keys: list[str], columns: list[tuple],
          where: Callable[[dict], bool] | None = None, fmt: str = "{:.3g}") -> str:
    """A markdown table: one line per distinct ``keys`` tuple, one cell per ``(header, field)``
    or ``(header, field, format)`` in ``columns`` (``fmt`` where a column names none), each
    ``median (min-max, N runs)`` over the rows that have the field."""
    columns = [(c[0], c[1], c[2] if len(c) > 2 else fmt) for c in columns]
    lines = ["| " + " | ".join([*keys, *(c[0] for c in columns)]) + " |",
             "|" + "---|" * (len(keys) + len(columns))]
    for key, rows in grouped(runs, keys, where).items():
        cells = ["" if k is None else str(k) for k in key]
        cells += [spread((r.get(f) for r in rows), form) for _, f, form in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def meta_line(runs: list[dict]) -> str:
    """One line naming the machines, dates and commits of ``runs``."""
    def each(field):
        return ", ".join(dict.fromkeys(str(r["meta"].get(field)) for r in runs if "meta" in r))
    return (f"{len(runs)} run{'s' if len(runs) != 1 else ''}; machine: {each('cpu')}, "
            f"{each('cores')} cores; dates: {each('date')}; commits: {each('commit')}")


def pyplot():
    """matplotlib's pyplot drawing to files (the Agg backend), or None where matplotlib is not
    installed: a benchmark's plot is optional, its JSON and table are not."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
