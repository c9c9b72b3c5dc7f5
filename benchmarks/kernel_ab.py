"""Two builds of the CPU kernels side by side in one process: a git revision's and the working
tree's, each call alternating between them on the same inputs, so that the machine's drift
(10-30% between runs here) falls on both alike.

    python benchmarks/kernel_ab.py --base HEAD            # this tree's kernels against HEAD's
    python benchmarks/kernel_ab.py --base 6fbcb01 --rows 1 8 --rounds 24 --passes 3
    python benchmarks/kernel_ab.py --base 6fbcb01 --kernel moe --gguf q3-4layers.gguf
    python benchmarks/kernel_ab.py --base 5415ce6 --kernel attention --shapes 4,8,128,16384
    python benchmarks/kernel_ab.py --base HEAD~1 --kernel gguf --gguf model.gguf --rows 1 8

Both builds are compiled as the runtime compiles its kernels and loaded by its own loader;
the runtime's calls (``cpu_layers``) go to one build or the other as the benchmark swaps the
loaded library, so what is timed is what a decode step calls. Kernels:

- ``linear`` (default): one pass over every 4-bit matrix of the default model's layers in
  the runtime's own packed form (codes with float16 factors), or with ``--bits 8`` over its
  8-bit matrices, with ``rows`` rows of x; a model read from a GGUF file's blocks has none
  (say ``gguf``);
- ``gguf``: one pass over every block matrix of ``--gguf`` as the file stores it (read in
  place, through an index in a temporary folder; ``--match`` keeps the tensors whose names
  contain it), with ``rows`` rows of x: the GGUF linear layer (``gguf_dot.c``);
- ``moe``: a decode step's routed experts (``cpu_layers.moe_experts``) of every MoE layer
  of ``--gguf`` (e.g. a few layers of Qwen3-30B-A3B written by
  ``benchmarks/random_gguf.py``), ``rows`` tokens routed to the first experts in turn;
- ``speculation``: InfiniGen's speculation over 4-bit packed keys, scored and chosen by
  the mass rule in one call (``cpu_kernels.speculate_mass``), for each ``--shapes C,G,D,T``
  (the cap: the default budget's, 4% of the rows but at least 256);
- ``attention``: decode attention (``cpu_kernels.attend_rows``) over every row of a float32
  head-major cache, and over a fifth of its rows chosen at random (``attend_indexed``,
  InfiniGen's read), for each ``--shapes C,G,D,T``: C columns (batch x KV heads), G query
  heads a KV head, head width D, T rows (e.g. 4,8,128,16384: Qwen3-30B-A3B at 16K).

Each round runs A then B or B then A, in turn. The benchmark also checks whether the two
builds give the same outputs, bit for bit, and records the largest change (over the largest
output) where they do not: an optimization that moves values says by how much. Writes
``kernel_ab.json`` and ``.png`` in the temporary folder's ``flexgen_infinigen_investigations``
(``--out``): an A/B run is an investigation, not a result kept under ``benchmarks/results/``;
what one showed about a kernel goes to ``docs/design/cpu_kernels.md``.
"""
from __future__ import annotations

import argparse
import contextlib
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
KERNELS = "flexgen_infinigen/kernels/c"
OUT = Path(tempfile.gettempdir()) / "flexgen_infinigen_investigations" / "kernel_ab"


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


def load(folder: Path, out: Path):
    """The kernels in ``folder`` compiled with the runtime's flags and loaded by its loader
    (which declares every function's arguments)."""
    from flexgen_infinigen.kernels import cpu_kernels
    sources = [str(p) for p in sorted(folder.glob("*.c"))]
    subprocess.run(["gcc", *cpu_kernels._FLAGS, "-I", str(folder), *sources, "-o", str(out),
                    "-lm"], check=True, capture_output=True, timeout=300)
    saved = cpu_kernels._build
    cpu_kernels._build = lambda _folder: out
    cpu_kernels._tried, cpu_kernels._lib = False, None
    try:
        lib = cpu_kernels.library()
    finally:
        cpu_kernels._build = saved
    if lib is None:
        raise SystemExit(f"the kernels in {folder} did not load")
    return lib


def use(lib) -> None:
    from flexgen_infinigen.kernels import cpu_kernels
    cpu_kernels._tried, cpu_kernels._lib = True, lib


def linear_work(lm, bits: int, rows: int):
    """(one pass, its bytes): the model's ``bits``-bit float16-factor matrices at ``rows``."""
    from flexgen_infinigen.kernels import layers as cpu_layers
    weights = lm.engine.weights
    mats = [weights[n].read_for_compute() for n in weights if n.endswith(".weight")]
    mats = [m for m in mats if getattr(m, "packed", None) is not None
            and getattr(m.packed, "bits", None) == bits
            and m.packed.scale.dtype == torch.float16]
    if not mats:
        raise SystemExit(f"the model has no {bits}-bit matrices with float16 factors here "
                         "(a GGUF file's blocks: --kernel gguf --gguf FILE)")
    gen = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=gen) for k in {m.packed.shape[1] for m in mats}}

    def one_pass():
        return [cpu_layers.linear_q4(xs[m.packed.shape[1]], m) for m in mats]
    return one_pass, sum(m.packed.codes.nbytes + m.packed.scale.nbytes
                         + m.packed.minimum.nbytes for m in mats)


def gguf_work(store, rows: int, match: str | None):
    """(one pass, its bytes): every block matrix of the GGUF store (names containing
    ``match``) against ``rows`` rows of x."""
    from flexgen_infinigen.kernels.layers import linear
    from flexgen_infinigen.memory.codes import PackedWeight
    names = [n for n in store.tensors if store.tensors[n].get("gguf_type")
             and (match is None or match in n)]
    if not names:
        raise SystemExit("--kernel gguf: no block matrices (of that name) in the file")
    mats = [PackedWeight(store.blocks(n), torch.float32) for n in names]
    gen = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=gen) for k in {m.packed.shape[1] for m in mats}}

    def one_pass():
        return [linear(xs[m.packed.shape[1]], m) for m in mats]
    return one_pass, sum(m.packed.raw.numel() for m in mats)


def moe_work(lm, rows: int):
    """(one pass, its bytes): every MoE layer's routed experts for ``rows`` tokens, each
    token sent to ``top_k`` experts in turn from the first (the bytes: the matrices used)."""
    from flexgen_infinigen.kernels import layers as cpu_layers
    cfg, weights = lm.engine.cfg, lm.engine.weights
    k, layers = cfg.experts_per_token, []
    for layer in range(cfg.num_layers):
        names = [f"layers.{layer}.experts.0.{m}.weight" for m in ("gate_proj", "up_proj")]
        if all(n in weights for n in names):
            layers.append(layer)
    if not layers:
        raise SystemExit("--kernel moe: the model has no routed experts")
    gen = torch.Generator().manual_seed(rows)
    choice = [(t * k + i) % cfg.num_experts for t in range(rows) for i in range(k)]
    used = sorted(set(choice))
    tokens = torch.tensor([t for u in used for t in range(rows) if u in choice[t * k:(t + 1) * k]])
    first = [0]
    for u in used:
        first.append(first[-1] + sum(u in choice[t * k:(t + 1) * k] for t in range(rows)))
    wt = torch.full((len(tokens),), 1.0 / k)
    sets, nbytes = [], 0
    for layer in layers:
        mats = [weights[f"layers.{layer}.experts.{u}.{m}.weight"].read_for_compute()
                for u in used for m in ("gate_proj", "up_proj", "down_proj")]
        sets.append(mats)
        nbytes += sum(m.packed.codes.nbytes + m.packed.scale.nbytes + m.packed.minimum.nbytes
                      for m in mats)
    x = torch.randn(rows, cfg.hidden_size, generator=gen)

    def one_pass():
        out = [cpu_layers.moe_experts(x, mats, first, tokens, wt) for mats in sets]
        if any(o is None for o in out):
            raise SystemExit("--kernel moe: the experts call did not take these matrices")
        return out
    return one_pass, nbytes


def speculation_work(shape: str):
    """(one pass, its bytes): speculate_mass of ``shape`` = "C,G,D,T" over random 4-bit keys
    (D / 2 bytes a row, a float32 minimum and scale), one row of a batch."""
    from flexgen_infinigen.kernels import cpu_kernels
    c, g, d, t = (int(x) for x in shape.split(","))
    gen = torch.Generator().manual_seed(t)
    codes = torch.randint(0, 256, (c, t, d // 2), dtype=torch.uint8, generator=gen)
    scale, lo = torch.rand(c, t, generator=gen) * 0.1, -torch.rand(c, t, generator=gen)
    q = torch.randn(c, g, d, generator=gen)
    visible = torch.ones(1, t, dtype=torch.bool)
    cap = max(int(0.04 * t), 256)
    caps = torch.tensor([cap])
    return (lambda: [cpu_kernels.speculate_mass(codes, scale, lo, q, 4, visible, caps, cap)],
            codes.nbytes + scale.nbytes + lo.nbytes)


def attention_work(shape: str, chosen: bool):
    """(one pass, its bytes): decode attention of ``shape`` = "C,G,D,T" over every row of a
    head-major cache, or (``chosen``) over a fifth of them picked at random."""
    from flexgen_infinigen.kernels import cpu_kernels
    c, g, d, t = (int(x) for x in shape.split(","))
    gen = torch.Generator().manual_seed(t)
    k, v = (torch.randn(c, t, d, generator=gen) for _ in range(2))
    kr, vr = k.transpose(0, 1), v.transpose(0, 1)  # the head-major cache viewed [T, C, D]
    q = torch.randn(c, g, d, generator=gen) / d ** 0.5
    if not chosen:
        bias = torch.zeros(c, t)
        return (lambda: [cpu_kernels.attend_rows(q, kr, vr, bias)]), 2 * k.nbytes
    n = t // 5
    index = torch.stack([torch.randperm(t, generator=gen)[:n].sort().values for _ in range(c)])
    counts = torch.full((c,), n)
    new = torch.randn(c, d, generator=gen)
    return (lambda: [cpu_kernels.attend_indexed(q, kr, vr, index, counts, new, new)],
            2 * c * n * d * 4)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision whose kernels are build A")
    p.add_argument("--kernel", default="linear",
                   choices=["linear", "gguf", "moe", "attention", "speculation"])
    p.add_argument("--bits", type=int, default=4, choices=[4, 8],
                   help="linear: the 4-bit layer matrices, or the 8-bit ones (the output head)")
    p.add_argument("--gguf", default=None, help="moe: a MoE GGUF (random_gguf.py writes one); "
                   "gguf: any GGUF")
    p.add_argument("--match", default=None, help="gguf: only tensors whose names contain this")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8],
                   help="rows of x (batch), or tokens for moe")
    p.add_argument("--shapes", nargs="+", default=["4,8,128,16384", "24,3,64,8192"],
                   help="attention, speculation: C,G,D,T (columns, heads a KV head, head "
                        "width, rows)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--passes", type=int, default=5, help="passes a timing")
    p.add_argument("--out", default=str(OUT), help="output path, without the suffix")
    a = p.parse_args(argv)
    if a.kernel in ("moe", "gguf") and not (a.gguf and Path(a.gguf).is_file()):
        p.error(f"--kernel {a.kernel} needs --gguf PATH, a GGUF file")
    from machine import machine_info

    from flexgen_infinigen import OffloadedLM, Placement
    threads = torch.get_num_threads()
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        libs = {"base": load(kernels_at(a.base, tmp / "a"), tmp / "a.so"),
                "tree": load(ROOT / KERNELS, tmp / "b.so")}
        policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=1)
        store = None
        if a.kernel == "gguf":
            from flexgen_infinigen.weights.gguf_index import index_gguf
            from flexgen_infinigen.weights.store import WeightStore
            store = WeightStore(index_gguf(a.gguf, tmp / "index"))
        with (contextlib.nullcontext() if store is not None else
              OffloadedLM.load(model=a.gguf if a.kernel == "moe" else "smollm2-135m",
                               policy=policy, progress=False, max_len_hint=(64, 8))) as lm:
            cells = [(shape, chosen) for shape in a.shapes for chosen in (False, True)] \
                if a.kernel == "attention" else a.shapes if a.kernel == "speculation" \
                else a.rows
            for rows in cells:
                if a.kernel == "attention":
                    one_pass, nbytes = attention_work(*rows)
                    rows = f"{rows[0]}{' chosen' if rows[1] else ''}"
                elif a.kernel == "speculation":
                    one_pass, nbytes = speculation_work(rows)
                else:
                    one_pass, nbytes = (moe_work(lm, rows) if a.kernel == "moe"
                                        else gguf_work(store, rows, a.match) if store is not None
                                        else linear_work(lm, a.bits, rows))
                outs = {}
                for name, lib in libs.items():  # warm, and each build's outputs
                    use(lib)
                    outs[name] = one_pass()
                same = all(torch.equal(x, y) for x, y in zip(outs["base"], outs["tree"]))
                moved = max(((y - x).abs().max() / x.abs().max()).item()
                            for x, y in zip(outs["base"], outs["tree"]))
                times = {name: [] for name in libs}
                for r in range(a.rounds):
                    for name in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                        use(libs[name])
                        start = time.perf_counter()
                        for _ in range(a.passes):
                            one_pass()
                        times[name].append((time.perf_counter() - start) / a.passes)
                med = {name: statistics.median(t) for name, t in times.items()}
                cases.append({"rows": rows, "same_outputs": same, "largest_change": moved,
                              "bytes": nbytes, "base_s": med["base"], "tree_s": med["tree"],
                              "tree_over_base": med["tree"] / med["base"],
                              "base_range": [min(times["base"]), max(times["base"])],
                              "tree_range": [min(times["tree"]), max(times["tree"])]})
                print(f"rows {rows}: base {1e3 * med['base']:.2f} ms, tree "
                      f"{1e3 * med['tree']:.2f} ms a pass ({nbytes / 1e6:.0f} MB), tree/base "
                      f"{med['tree'] / med['base']:.3f}, same outputs: {same} (largest change "
                      f"{moved:.1e} of the largest output)", flush=True)
        use(None)
    what = {"moe": "moe_q4_h16", "attention": "attend_rows, attend_indexed",
            "speculation": "speculate_mass", "gguf": "gguf_linear"}.get(
        a.kernel, f"linear_q{a.bits}_h16")
    result = {"machine": machine_info(), "base": a.base,
              "command": "python benchmarks/kernel_ab.py " + " ".join(argv or sys.argv[1:]),
              "threads": threads, "kernel": what, "cases": cases}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    at = range(len(cases))
    ax.bar([x - 0.2 for x in at], [1e3 * c["base_s"] for c in cases], 0.4, label=a.base)
    ax.bar([x + 0.2 for x in at], [1e3 * c["tree_s"] for c in cases], 0.4, label="tree")
    ax.set_xticks(list(at), [f"{c['rows']} rows" if isinstance(c["rows"], int)
                             else c["rows"].replace(" ", "\n") for c in cases])
    ax.set_ylabel("ms a pass")
    ax.set_title(f"{what}, two builds alternating")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
