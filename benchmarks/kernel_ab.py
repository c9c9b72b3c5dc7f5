"""Two builds of the CPU kernels side by side in one process: a git revision's and the working
tree's, each call alternating between them on the same inputs, so that the machine's drift
(10-30% between runs here) falls on both alike.

    python benchmarks/kernel_ab.py --base HEAD            # this tree's kernels against HEAD's
    python benchmarks/kernel_ab.py --base 6fbcb01 --rows 1 8 --rounds 12

What it times: one pass of ``linear_q4_h16`` over every 4-bit matrix of the default model's
layers (SmolLM2-135M's GGUF: codes with float16 factors, as a decode step reads them), or
with ``--bits 8`` of ``linear_q8_h16`` over its 8-bit matrices (the output head), with
``rows`` rows of x, on both builds; each round runs A then B or B then A, in turn. It also
checks whether the two builds give the same outputs, bit for bit, and records the largest
change (over each matrix's largest output) where they do not: an optimization that moves
values says by how much. Writes ``benchmarks/results/kernel_ab.json``
and ``.png`` (``--out``).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
KERNELS = "flexgen_infinigen/runtime/kernels"
OUT = ROOT / "benchmarks" / "results" / "kernel_ab"


def kernels_at(rev: str, dest: Path) -> Path:
    """The kernel sources of git revision ``rev`` unpacked under ``dest``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, KERNELS],
                             check=True, capture_output=True).stdout
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / "archive.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(dest, filter="data")
    return dest / KERNELS


def build(folder: Path, out: Path) -> ctypes.CDLL:
    """The kernels in ``folder`` compiled as the runtime compiles them, loaded."""
    from flexgen_infinigen.runtime import cpu_kernels
    sources = [str(p) for p in sorted(folder.glob("*.c"))]
    subprocess.run(["gcc", *cpu_kernels._FLAGS, "-I", str(folder), *sources, "-o", str(out),
                    "-lm"], check=True, capture_output=True, timeout=300)
    lib = ctypes.CDLL(str(out))
    for name in ("linear_q4_h16", "linear_q8_h16"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5
        getattr(lib, name).restype = ctypes.c_int
    return lib


def one_pass(lib, mats, xs, outs, rows: int, threads: int) -> None:
    for p in mats:
        n, k = p.shape
        kernel = lib.linear_q8_h16 if p.bits == 8 else lib.linear_q4_h16
        kernel(xs[k].data_ptr(), p.codes.data_ptr(), p.scale.data_ptr(), p.minimum.data_ptr(),
               None, outs[n].data_ptr(), rows, n, k, p.group, threads)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision whose kernels are build A")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows of x (batch)")
    p.add_argument("--bits", type=int, default=4, choices=[4, 8],
                   help="the 4-bit layer matrices, or the 8-bit ones (the output head)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--passes", type=int, default=5, help="passes over the matrices a timing")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    from machine import machine_info

    from flexgen_infinigen import OffloadedLM, Policy
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        libs = {"base": build(kernels_at(a.base, tmp / "a"), tmp / "a.so"),
                "tree": build(ROOT / KERNELS, tmp / "b.so")}
        policy = Policy.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=1)
        with OffloadedLM.load(model="smollm2-135m", policy=policy, progress=False,
                              max_len_hint=(64, 8)) as lm:
            weights = lm.engine.weights
            mats = [weights[n].read_for_compute() for n in weights if n.endswith(".weight")]
            mats = [m.packed for m in mats if getattr(m, "packed", None) is not None
                    and m.packed.bits == a.bits and m.packed.scale.dtype == torch.float16]
            if not mats:
                raise SystemExit(f"the default model has no {a.bits}-bit matrices with "
                                 "float16 factors here")
            nbytes = sum(m.codes.nbytes + m.scale.nbytes + m.minimum.nbytes for m in mats)
            cases = []
            gen = torch.Generator().manual_seed(0)
            for rows in a.rows:
                xs = {k: torch.randn(rows, k, generator=gen) for k in {m.shape[1] for m in mats}}
                outs = {name: {n: torch.empty(rows, n) for n in {m.shape[0] for m in mats}}
                        for name in libs}
                for name, lib in libs.items():
                    one_pass(lib, mats, xs, outs[name], rows, threads)  # warm, and outputs
                same = all(torch.equal(outs["base"][n], outs["tree"][n]) for n in outs["base"])
                moved = max(((outs["tree"][n] - outs["base"][n]).abs().max()
                             / outs["base"][n].abs().max()).item() for n in outs["base"])
                times = {name: [] for name in libs}
                for r in range(a.rounds):
                    for name in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                        start = time.perf_counter()
                        for _ in range(a.passes):
                            one_pass(libs[name], mats, xs, outs[name], rows, threads)
                        times[name].append((time.perf_counter() - start) / a.passes)
                med = {name: statistics.median(t) for name, t in times.items()}
                cases.append({"rows": rows, "same_outputs": same,
                              "largest_change": moved, "matrices": len(mats),
                              "bytes": nbytes, "base_s": med["base"], "tree_s": med["tree"],
                              "tree_over_base": med["tree"] / med["base"],
                              "base_range": [min(times["base"]), max(times["base"])],
                              "tree_range": [min(times["tree"]), max(times["tree"])]})
                print(f"rows {rows}: base {1e3 * med['base']:.2f} ms, tree "
                      f"{1e3 * med['tree']:.2f} ms a pass ({nbytes / 1e6:.0f} MB), tree/base "
                      f"{med['tree'] / med['base']:.3f}, same outputs: {same} (largest change "
                      f"{moved:.1e} of the largest output)", flush=True)
    result = {"machine": machine_info(), "base": a.base,
              "command": "python benchmarks/kernel_ab.py " + " ".join(argv or sys.argv[1:]),
              "threads": threads, "kernel": f"linear_q{a.bits}_h16", "cases": cases}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs_ = range(len(cases))
    ax.bar([x - 0.2 for x in xs_], [1e3 * c["base_s"] for c in cases], 0.4, label=a.base)
    ax.bar([x + 0.2 for x in xs_], [1e3 * c["tree_s"] for c in cases], 0.4, label="tree")
    ax.set_xticks(list(xs_), [f"{c['rows']} rows" for c in cases])
    ax.set_ylabel(f"ms a pass over the {a.bits}-bit matrices")
    ax.set_title(f"linear_q{a.bits}_h16, two builds alternating")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
