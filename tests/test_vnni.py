"""The integer dot products of the 4-bit kernels with VNNI (``common.h``: ``vpdpbusd`` and
``vpdpwssd`` where the compiler targets AVX512-VNNI or AVX-VNNI) compute the same exact
integer sums as the AVX2 instructions they replace. Checked by building the kernels twice
on this machine, with VNNI and with it switched off, and running both on the same inputs:
the 4-bit linear layers (float32 and float16 factors, one row and several), the routed
experts' one call, and InfiniGen's speculation scores and choice, equal bit for bit.

Both test builds add ``-fno-associative-math -ffp-contract=off`` to the runtime's flags:
under ``-ffast-math`` alone the compiler may fuse a product and a sum of the float steps
around the integers (scaling and summing the blocks) into one instruction, or reorder them,
differently in each build, which moves an output in its last bit (as built by the runtime,
the float32-factor product at 8 rows differs in a few outputs by one unit in the last
place); with the float steps fixed, any difference left would be the integers'."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_half_scales import _weights
from test_moe_kernel import _routing

from flexgen_infinigen.memory import codes as compression
from flexgen_infinigen.kernels import cpu_kernels, layers as cpu_layers


def _has_vnni() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx_vnni" in flags or ("avx512_vnni" in flags and "avx512vl" in flags)


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """{"vnni": the kernels as the runtime builds them, "avx2": the same without VNNI}, both
    with the float order fixed (see above), each loaded by the runtime's own loader (which
    declares every function's arguments)."""
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler: the kernels are not built here")
    if not _has_vnni():
        pytest.skip("this CPU has no VNNI: the runtime's build is the AVX2 one already")
    cc = shutil.which("gcc") or shutil.which("cc")
    folder = Path(cpu_kernels.__file__).with_name("c")
    libs = {}
    for name, extra in (("vnni", []), ("avx2", ["-mno-avx512vnni", "-mno-avxvnni"])):
        out = tmp_path_factory.mktemp(name) / "kernels.so"
        fixed = ["-fno-associative-math", "-ffp-contract=off"]
        subprocess.run([cc, *cpu_kernels._FLAGS, *fixed, *extra, "-I", str(folder),
                        *map(str, sorted(folder.glob("*.c"))), "-o", str(out), "-lm"],
                       check=True, capture_output=True, timeout=300)
        saved = (cpu_kernels._build, cpu_kernels._tried, cpu_kernels._lib)
        cpu_kernels._build = lambda _folder, out=out: out
        cpu_kernels._tried, cpu_kernels._lib = False, None
        try:
            libs[name] = cpu_kernels.library()
        finally:
            cpu_kernels._build, cpu_kernels._tried, cpu_kernels._lib = saved
        assert libs[name] is not None
    return libs


def _both(builds, fn):
    """fn() under each build, the runtime's build restored after."""
    saved = (cpu_kernels._tried, cpu_kernels._lib)
    out = {}
    try:
        for name, lib in builds.items():
            cpu_kernels._tried, cpu_kernels._lib = True, lib
            out[name] = fn()
    finally:
        cpu_kernels._tried, cpu_kernels._lib = saved
    return out["vnni"], out["avx2"]


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_4bit_linear_with_float32_factors(builds, rows):
    gen = torch.Generator().manual_seed(rows)
    w = compression.PackedWeight(compression.compress(torch.randn(130, 576, generator=gen)))
    x = torch.randn(rows, 576, generator=gen)
    x[0, 5] = 40.0  # an outlier: small entries of its block round to few levels
    a, b = _both(builds, lambda: cpu_layers.linear_q4(x, w))
    assert a is not None and torch.equal(a, b)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("rows", [1, 5])
def test_4bit_linear_with_float16_factors(builds, kind, rows):
    half, _ = _weights(kind, (96, 512), seed=3)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    a, b = _both(builds, lambda: cpu_layers.linear_q4(x, half))
    assert a is not None and torch.equal(a, b)


@pytest.mark.parametrize("tokens", [1, 3])
def test_routed_experts_in_one_call(builds, tokens):
    from test_moe_kernel import _experts
    mats, _ = _experts("Q4_0", 6, seed=11)
    chosen, _, used, first, tok, wt = _routing(tokens, 6, 2, seed=tokens)
    x = torch.randn(tokens, 512, generator=torch.Generator().manual_seed(5))
    picked = [m for u in used for m in mats[3 * u:3 * u + 3]]
    a, b = _both(builds, lambda: cpu_layers.moe_experts(x, picked, first, tok, wt))
    assert a is not None and torch.equal(a, b)


@pytest.mark.parametrize("width", [128, 64])
def test_speculation_scores_and_choice(builds, width):
    """Packed 4-bit speculation keys of a head of ``width`` (rows of 64 or 32 bytes)."""
    gen = torch.Generator().manual_seed(width)
    c, g, t = 4, 8, 3000
    p = width // 2
    codes = torch.randint(0, 256, (c, t, p), dtype=torch.uint8, generator=gen)
    scale, lo = torch.rand(c, t, generator=gen) * 0.1, -torch.rand(c, t, generator=gen)
    q = torch.randn(c, g, width, generator=gen)
    visible = torch.ones(1, t, dtype=torch.bool)
    visible[0, 7] = False
    caps = torch.tensor([300])
    a, b = _both(builds, lambda: cpu_kernels.score_packed(codes, scale, lo, q, 4, t))
    assert a is not None and torch.equal(a, b)
    a, b = _both(builds, lambda: cpu_kernels.speculate_mass(codes, scale, lo, q, 4, visible,
                                                           caps, 300))
    assert a is not None and torch.equal(a, b)
