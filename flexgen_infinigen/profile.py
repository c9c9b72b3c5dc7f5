"""Command line: ``python -m flexgen_infinigen.profile --out hw.json``: measure this machine."""
from __future__ import annotations

import argparse
import sys

from .cli.args import write_json
from .planner.hardware import BUILTIN, GB, OPTIONAL_RATES, RATES, HardwareProfile
from .planner.measure import cache_path, measure_hardware, save_to_cache
from .guards import check_output_path, run_command
from .engine.loading import resolve_device


def _size(n: int) -> str:
    return f"{n / (1 << 20):g}M" if n >= 1 << 20 else f"{n >> 10}K"


def describe(p: HardwareProfile) -> str:
    """The profile in a few lines: memory, disk, matmul, rate tables, overheads."""
    mm = p.matmul_flops
    lines = [f"{p.name}: {p.device}", f"  {p.source}",
             f"  memory      device {p.gpu_mem / GB:.1f} GB   host {p.cpu_mem / GB:.1f} GB   "
             f"disk {p.disk_mem / GB:.1f} GB" + ("   (device and host shared)"
                                                  if p.shared_memory else ""),
             f"  disk        read {p.disk_read_bw / GB:.2f} GB/s (not cached), "
             f"write {p.disk_write_bw / GB:.2f} GB/s",
             "  matmul      " + "  ".join(f"m={m}: {f / 1e12:.3g}" for m, f in sorted(mm.items()))
             + " TFLOP/s"]
    lines.append("  rates in GB/s by operation size:")
    for name in RATES + tuple(n for n in OPTIONAL_RATES if n in p.rates):
        table = p.rates.get(name, {})
        lines.append(f"    {name:<14}" + "  ".join(f"{_size(s)}: {v / GB:.2f}"
                                                    for s, v in sorted(table.items())))
    lines.append("  overheads   " + "  ".join(f"{k}: {v * 1e3:.3f} ms" for k, v in
                                              sorted(p.overhead_s.items())))
    return "\n".join(lines)


def main(argv=None) -> int:
    return run_command(_main, argv)


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m flexgen_infinigen.profile",
        description="Measure link bandwidths, disk, compute and memory of this machine for the "
                    "cost model, or print a built-in profile.")
    p.add_argument("--out", default=None,
                   help=f"write the profile here (default: {cache_path()}, which optimize and "
                        "--percent auto use when no --hw is given)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--offload-dir", default=None, help="folder whose disk is measured")
    p.add_argument("--quick", action="store_true", help="smaller transfers (about half the time)")
    p.add_argument("--show", default=None, metavar="NAME_OR_FILE",
                   help=f"print a profile instead of measuring (built-in: {', '.join(BUILTIN)})")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the profile here")
    a = p.parse_args(argv)
    check_output_path(a.json, "--json")
    check_output_path(a.out, "--out")
    if a.show:
        from .planner.hardware import load_profile
        prof = load_profile(a.show)
    else:
        prof = measure_hardware(resolve_device(a.device), a.offload_dir, quick=a.quick)
        if a.out:
            prof.save(a.out)
            out = a.out
        else:
            out = save_to_cache(prof)
        print(f"profile written to {out}")
    print(describe(prof))
    write_json(a.json, prof.to_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
