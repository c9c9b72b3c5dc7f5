"""What a kind of speculation keys costs a decode step: InfiniGen's scoring and selection of
one layer (the fused ``mass`` kernel the runtime calls), timed for 4- and 8-bit keys side by
side, alternating, at a context length and shape of a model's layer.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/speculation_keys_cost.py   # Qwen2.5-0.5B at 16K

A decode step pays this once per selecting layer (22 of Qwen2.5's 24), so the difference
between kinds times the layers, over a measured decode step (``--step-ms``, from the
long-context results), is the share of decode time a kind adds. Random keys: the kernel's
work does not depend on their values.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from flexgen_infinigen.kv.infinigen.spec_keys import SpeculationKeys
from flexgen_infinigen.memory.tiers import Tiers

OUT = (Path(tempfile.gettempdir()) / "flexgen_infinigen_investigations"
       / "speculation_keys_cost")


def time_kind(kind: str, length: int, kv: int, group: int, width: int, fraction: float,
              repeats: int) -> list[float]:
    keys = SpeculationKeys(kind, length + 1, kv, width, torch.float32, Tiers("cpu"))
    g = torch.Generator().manual_seed(0)
    keys.write(torch.randn(length, kv, width, generator=g), 0)
    pq = torch.randn(1, kv, group, width, generator=g)
    visible = torch.ones(1, length, dtype=torch.bool)
    cap = max(1, int(fraction * length))
    caps = torch.full((1,), cap, dtype=torch.int64)
    if keys.select_mass(pq, visible, caps, cap) is None:
        raise SystemExit(f"error: the CPU kernels are not available for {kind} keys; this "
                         "benchmark times the kernel path")
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        keys.select_mass(pq, visible, caps, cap)
        out.append(time.perf_counter() - start)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--kv-heads", type=int, default=2, help="Qwen2.5-0.5B: 2")
    p.add_argument("--group", type=int, default=7, help="query heads per KV head (Qwen: 7)")
    p.add_argument("--width", type=int, default=64, help="speculated columns (head size)")
    p.add_argument("--layers", type=int, default=22, help="selecting layers a step")
    p.add_argument("--fraction", type=float, default=0.04)
    p.add_argument("--rounds", type=int, default=5, help="alternations of the kinds")
    p.add_argument("--repeats", type=int, default=20, help="calls timed a round")
    p.add_argument("--step-ms", type=float, default=None,
                   help="a measured decode step at this length, to express the cost as a share")
    p.add_argument("--kinds", nargs="+", default=["int4", "int8"])
    a = p.parse_args(argv)
    times: dict[str, list[float]] = {k: [] for k in a.kinds}
    for _ in range(a.rounds):  # A, B, A, B: the machine's load hits both alike
        for kind in a.kinds:
            t = time_kind(kind, a.length, a.kv_heads, a.group, a.width, a.fraction, a.repeats)
            times[kind].append(statistics.median(t))
    result = {"settings": vars(a), "threads": torch.get_num_threads(), "kinds": {}}
    base = times[a.kinds[0]]
    for kind, ts in times.items():
        per_step = [t * a.layers * 1e3 for t in ts]
        row = {"layer_ms_median_per_round": [t * 1e3 for t in ts],
               "step_ms_range": [min(per_step), max(per_step)],
               "ratio_to_first_range": [min(x / y for x, y in zip(ts, base)),
                                        max(x / y for x, y in zip(ts, base))]}
        if a.step_ms:
            extra = [(x - y) * a.layers * 1e3 / a.step_ms for x, y in zip(ts, base)]
            row["added_share_of_step_range"] = [min(extra), max(extra)]
        result["kinds"][kind] = row
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"# Speculation keys: scoring and selection cost at {a.length} tokens",
             "", f"{a.kv_heads} KV heads x {a.group} query heads, {a.width} columns, budget "
             f"{a.fraction}, {a.layers} selecting layers; medians of {a.repeats} calls, "
             f"{a.rounds} alternating rounds (ranges over rounds).", "",
             "| kind | one layer (ms) | a step's layers (ms) | ratio to " + a.kinds[0] + " |"
             + (" added share of a step |" if a.step_ms else ""),
             "|---|---|---|---|" + ("---|" if a.step_ms else "")]
    for kind, row in result["kinds"].items():
        ms = row["layer_ms_median_per_round"]
        lo, hi = row["ratio_to_first_range"]
        line = (f"| {kind} | {min(ms):.3f}-{max(ms):.3f} | {row['step_ms_range'][0]:.1f}-"
                f"{row['step_ms_range'][1]:.1f} | {lo:.2f}-{hi:.2f} |")
        if a.step_ms:
            s0, s1 = row["added_share_of_step_range"]
            line += f" {100 * s0:.1f}%-{100 * s1:.1f}% |"
        lines.append(line)
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(result, OUT.with_suffix(".png"))
    return 0


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    kinds = list(result["kinds"])
    for i, kind in enumerate(kinds):
        ms = result["kinds"][kind]["layer_ms_median_per_round"]
        ax.plot([i] * len(ms), ms, "o", alpha=0.6)
    ax.set(xticks=range(len(kinds)), xticklabels=kinds, ylabel="ms a layer (median a round)",
           title=f"speculation at {result['settings']['length']} tokens")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
