"""The GPU check's numbers as one artifact set: ``scripts/gpu_check.sh`` writes a JSON per
step into a folder (one per device call); this reads those folders (a later folder's variant
replaces an earlier one's of the same label), adds what the optimizer predicts for each of the
paper setting's steps (a built-in hardware profile: published figures, not this run's), and
writes ``STEM.json``, ``STEM.md`` and ``STEM.png``.

    python benchmarks/gpu_report.py --from run1/ run2/ --out benchmarks/results/gpu_h200
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GB = 1e9


def _steps(folders: list[str]) -> dict:
    """Each step's record, the model steps' variants merged over the folders by label."""
    steps: dict = {}
    for folder in folders:
        for path in sorted(Path(folder).glob("*.json")):
            if path.name.endswith(".partial.json"):
                continue
            record = json.loads(path.read_text())
            name, old = record["step"], steps.get(record["step"])
            runs = record.get("result", {}).get("runs")
            if old is not None and isinstance(runs, list) and old["result"].get("runs"):
                merged = {r["label"]: r for r in old["result"]["runs"] if "label" in r}
                merged.update({r["label"]: r for r in runs if "label" in r})
                record["result"]["runs"] = list(merged.values())
            steps[name] = record
    return steps


def _tests(steps: dict) -> list[dict]:
    """Each test shard's pytest summary line and its failures."""
    rows = []
    for name, record in steps.items():
        if not name.startswith("tests-"):
            continue
        out = record["result"].get("stdout_tail", "")
        summary = [ln.strip("= ") for ln in out.splitlines()
                   if re.search(r"\d+ (passed|failed)", ln)]
        failed = re.findall(r"^FAILED (\S+)", out, flags=re.M)
        rows.append({"shard": name, "status": record["status"],
                     "summary": summary[-1] if summary else None, "failed": failed})
    return rows


def _predicted(result: dict, row: dict) -> float | None:
    """The optimizer's decode step for a paper-setting variant at the measured contexts."""
    from flexgen_infinigen.config import get_config
    from flexgen_infinigen.placement import Placement
    from flexgen_infinigen.planner.cost import predict
    from flexgen_infinigen.planner.hardware import BUILTIN
    from flexgen_infinigen.planner.workload import Workload
    if row.get("kv_policy") not in ("full", "infinigen", "h2o") or "error" in row:
        return None
    changes = row.get("placement_changes") or {}
    percent = [100, 0, changes.get("cache_gpu_percent", 0),
               changes.get("cache_cpu_percent", 100), 100, 0]
    policy = Placement.from_percent(percent, gpu_batch_size=result["batch"],
                                    overlap=changes.get("overlap", True),
                                    compress_cache=changes.get("compress_cache", False))
    fraction = row.get("kv_fetch_fraction") or 1.0
    work = Workload(get_config(result["model"]), result["prompt_len"],
                    result["cut_gen_len"] + 1, kv_policy=row["kv_policy"],
                    kv_fraction=fraction)
    return predict(work, policy, BUILTIN["h200-pcie5"])["decode_step_s"]


def _row(row: dict, base: float | None, pinned: float | None) -> dict:
    step = row.get("decode_step_median_s")
    moved = row.get("host_to_device_bytes_per_step")
    if row.get("link_bound_s") is None and pinned and moved and step:
        # a later call's step ran without the bandwidth step in its folder: the first's rate
        row = {**row, "link_bound_s": moved / (pinned * GB)}
        row["step_over_link_bound"] = step / row["link_bound_s"]
    return {"label": row["label"], "error": row.get("error"),
            "step_s": step, "step_range_s": row.get("decode_step_range_s"),
            "steps": row.get("decode_steps_run"), "tokens_per_s": row.get("decode_tokens_per_s"),
            "speedup_vs_full": base / step if base and step else None,
            "prefill_s": row.get("prefill_s"),
            "host_to_device_gb_per_step": (row["host_to_device_bytes_per_step"] / GB
                                           if row.get("host_to_device_bytes_per_step")
                                           is not None else None),
            "link_bound_s": row.get("link_bound_s"),
            "step_over_link_bound": row.get("step_over_link_bound"),
            "kv_fetch_fraction": row.get("kv_fetch_fraction"),
            "peak_device_gb": (row["peak_device_bytes"] / GB
                               if row.get("peak_device_bytes") else None),
            "planned_device_gb": (row["planned_device_bytes"] / GB
                                  if row.get("planned_device_bytes") else None)}


def collect(folders: list[str]) -> dict:
    steps = _steps(folders)
    doc: dict = {"machine": next(iter(steps.values()))["machine"] if steps else None,
                 "tests": _tests(steps)}
    if "bandwidth" in steps:
        doc["bandwidth_gb_per_s"] = {k: v["gb_per_s"]
                                     for k, v in steps["bandwidth"]["result"].items()}
    for name in ("paper", "long", "moe"):
        if name not in steps:
            continue
        result = steps[name]["result"]
        runs = result.get("runs", [])
        base = {}
        for r in runs:  # each batch's full cache (or experts on the GPU) is the baseline
            if r.get("label", "").startswith(("full", "experts gpu")) and "overlap" not in \
                    r["label"] and r.get("decode_step_median_s"):
                base[r.get("batch", result.get("batch"))] = r["decode_step_median_s"]
        rows = []
        for r in runs:
            row = _row(r, base.get(r.get("batch", result.get("batch"))),
                       doc.get("bandwidth_gb_per_s", {}).get("pinned"))
            if name == "paper":
                row["predicted_step_s"] = _predicted(result, r)
                if row["predicted_step_s"] and row["step_s"]:
                    row["predicted_over_measured"] = row["predicted_step_s"] / row["step_s"]
            rows.append(row)
        doc[name] = {k: v for k, v in result.items() if k != "runs"} | {"rows": rows}
    for name in ("memory", "overlap"):
        if name in steps and steps[name]["status"] == "ok":
            doc[name] = steps[name]["result"]
    return doc


def _fmt(v, digits=3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def markdown(doc: dict) -> str:
    m = doc["machine"] or {}
    bw = doc.get("bandwidth_gb_per_s", {})
    out = [f"{m.get('device')}, driver {m.get('driver')}, torch {m.get('torch')}; pinned "
           f"host-to-device {_fmt(bw.get('pinned'))} GB/s, pageable {_fmt(bw.get('pageable'))}"
           " GB/s (1 GiB copies, median of 7)", ""]
    cols = ["label", "step s (min-max)", "tok/s", "vs full", "H2D GB/step", "link bound s",
            "step / bound", "fetched", "peak / planned GPU GB"]
    for name, title in (("paper", "OPT-13B, batch 20, prompt 1920, KV in CPU memory"),
                        ("long", "Llama-3.1-8B, bf16, 32K, KV in CPU memory"),
                        ("moe", "Qwen3-30B-A3B, 6 of 48 layers, bf16, prompt 4096")):
        if name not in doc:
            continue
        extra = ["predicted s", "predicted / measured"] if name == "paper" else []
        out += [f"**{title}** (median of each run's decode steps, one run)", "",
                "| " + " | ".join(cols + extra) + " |", "|" + "---|" * len(cols + extra)]
        for r in doc[name]["rows"]:
            if r.get("error"):
                out.append(f"| {r['label']} | error: {r['error'][:80]} |")
                continue
            lo, hi = r["step_range_s"] or (None, None)
            cells = [r["label"], f"{_fmt(r['step_s'])} ({_fmt(lo)}-{_fmt(hi)})",
                     _fmt(r["tokens_per_s"]), _fmt(r["speedup_vs_full"]),
                     _fmt(r["host_to_device_gb_per_step"]), _fmt(r["link_bound_s"]),
                     _fmt(r["step_over_link_bound"]), _fmt(r["kv_fetch_fraction"]),
                     f"{_fmt(r['peak_device_gb'])} / {_fmt(r['planned_device_gb'])}"]
            if name == "paper":
                cells += [_fmt(r.get("predicted_step_s")), _fmt(r.get("predicted_over_measured"))]
            out.append("| " + " | ".join(cells) + " |")
        skipped = doc[name].get("skipped_for_time") or []
        done = {r["label"] for r in doc[name]["rows"]}
        missing = [s for s in skipped if s not in done]
        if missing:
            out.append(f"\nNot measured (the lease ran out): {', '.join(missing)}.")
        out.append("")
    out += ["**CUDA tests**", "", "| shard | result | failed |", "|---|---|---|"]
    for t in doc["tests"]:
        out.append(f"| {t['shard']} | {t['summary']} | {', '.join(t['failed']) or '-'} |")
    return "\n".join(out) + "\n"


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [n for n in ("paper", "long") if n in doc]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, name in zip(axes[0], panels):
        rows = [r for r in doc[name]["rows"] if r.get("step_s")]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["step_s"] for r in rows], 0.4, label="measured step")
        ax.bar([i + 0.2 for i in x], [r["link_bound_s"] or 0 for r in rows], 0.4,
               label="bytes over pinned link")
        ax.set_xticks(list(x), [r["label"] for r in rows], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("decode step, s")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="folders", nargs="+", required=True,
                   help="gpu_check.sh --out folders, earliest first")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_h200"))
    p.add_argument("--date", default=None, help="the day the GPU run was made")
    p.add_argument("--commit", default=None, help="the commit the GPU run was made from")
    p.add_argument("--command", action="append", default=[],
                   help="a gpu_check.sh command that made a folder (once for each)")
    a = p.parse_args(argv)
    missing = [f for f in a.folders if not Path(f).is_dir()]
    if missing:
        p.error(f"no such folder: {', '.join(missing)} (pass gpu_check.sh's --out folders)")
    doc = collect(a.folders)
    doc["meta"] = {"date": a.date, "commit": a.commit,
                   "commands": a.command,
                   "report": " ".join(["python", *sys.argv])}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    plot(doc, out.with_suffix(".png"))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
