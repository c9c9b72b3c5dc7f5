"""A token's routed experts in one compiled call (``kernels/moe_experts.c``, called by
``cpu_layers.moe_token`` from ``models/moe.py`` for a one-token step): against the experts
computed in float64 from the expanded codes, against the per-expert path it replaces, in the
portable build (no AVX2), and end to end, where a Qwen3-MoE GGUF with Q4_0 experts decodes
transformers' tokens with the call taking every MoE layer of every step."""
from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_half_scales import _weights

from flexgen_infinigen.runtime import cpu_kernels, cpu_layers

H, FF = 512, 256  # hidden and expert widths: whole K-quant blocks, unequal (a swapped shape fails)


def _experts(kind: str, n: int, seed: int):
    """n experts' (gate, up, down) as float16-factor PackedWeights, and the same expanded."""
    half, dense = [], []
    for e in range(n):
        for i, shape in enumerate(((FF, H), (FF, H), (H, FF))):
            h, wide = _weights(kind, shape, seed=seed + 3 * e + i)
            half.append(h)
            dense.append(wide.dense().double())
    return half, dense


def _reference(x, dense, weights):
    out = torch.zeros(1, H, dtype=torch.float64)
    for e in range(len(dense) // 3):
        g, u, d = dense[3 * e:3 * e + 3]
        out += weights[e].double() * F.linear(F.silu(F.linear(x.double(), g)) *
                                              F.linear(x.double(), u), d)
    return out


@pytest.fixture(autouse=True)
def _kernels():
    if cpu_kernels.library() is None:
        pytest.skip("no C compiler: the per-expert path runs instead (tests/test_moe_gguf.py)")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_matches_the_experts_in_float64(kind, n):
    """Within 1e-3 of the largest output of what the expanded codes give (x and the
    activations are rounded to 16 bits per 64 values, as every 4-bit kernel here does), and
    within 1e-4 of what the per-expert path gives (three linear calls an expert, torch's
    silu, index_add_ in order; silu rounded otherwise can move an activation's 16-bit step)."""
    half, dense = _experts(kind, n, seed=10 * n)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(1, H, generator=gen)
    weights = torch.softmax(torch.randn(n, generator=gen), 0)
    ours = cpu_layers.moe_token(x, half, weights)
    assert ours is not None and ours.shape == (1, H)
    ref = _reference(x, dense, weights)
    assert (ours.double() - ref).abs().max() < 1e-3 * ref.abs().max()
    per_expert = torch.zeros(1, H)
    for e in range(n):
        g, u, d = half[3 * e:3 * e + 3]
        y = cpu_layers.linear(F.silu(cpu_layers.linear(x, g)) * cpu_layers.linear(x, u), d)
        per_expert.index_add_(0, torch.tensor([0]), y * weights[e])
    assert (ours - per_expert).abs().max() < 1e-4 * per_expert.abs().max()


def test_refuses_what_it_does_not_compute():
    """None (the caller multiplies expert by expert) for 8-bit codes, float32 factors,
    widths off the 64-value blocks, a weight that is not codes, two tokens."""
    half, _ = _experts("Q4_0", 2, seed=1)
    x, w = torch.randn(1, H), torch.tensor([0.6, 0.4])
    assert cpu_layers.moe_token(x, half, w) is not None
    q8, _ = _weights("Q8_0", (FF, H), seed=3)
    assert cpu_layers.moe_token(x, [q8] + half[1:], w) is None
    _, wide = _weights("Q4_0", (FF, H), seed=3)  # float32 factors
    assert cpu_layers.moe_token(x, [wide] + half[1:], w) is None
    odd, _ = _weights("Q4_0", (96, H), seed=4)  # an expert width of 96: not whole blocks
    odd_down, _ = _weights("Q4_0", (H, 128), seed=5)
    assert cpu_layers.moe_token(x, [odd, odd, odd_down] + half[3:], w) is None
    assert cpu_layers.moe_token(x, [half[0].dense()] + half[1:], w) is None
    assert cpu_layers.moe_token(torch.randn(2, H), half, w) is None


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """``moe_experts.c`` built for a plain x86-64 (no AVX2): its float-loop rows."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None or platform.machine() != "x86_64":
        pytest.skip("the portable build is tested on x86-64 with a C compiler")
    folder = Path(cpu_kernels.__file__).with_name("kernels")
    out = tmp_path_factory.mktemp("portable") / "moe.so"
    subprocess.run([cc, "-O2", "-march=x86-64", "-mno-avx", "-fopenmp", "-fPIC", "-shared",
                    "-Wno-psabi", "-I", str(folder), str(folder / "moe_experts.c"), "-o",
                    str(out), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.moe_token_q4_h16.argtypes = [ptr, i64] + [ptr] * 5 + [i64] * 4
    lib.moe_token_q4_h16.restype = ctypes.c_int
    return lib


def test_portable_build(portable):
    half, dense = _experts("Q4_1", 3, seed=7)
    x = torch.randn(1, H)
    weights = torch.tensor([0.5, 0.3, 0.2])
    ptrs = [(ctypes.c_void_p * 9)(*(getattr(p.packed, part).data_ptr() for p in half))
            for part in ("codes", "scale", "minimum")]
    out = torch.empty(1, H)
    assert portable.moe_token_q4_h16(x.data_ptr(), 3, *ptrs, weights.data_ptr(), out.data_ptr(),
                                     H, FF, half[0].packed.group, 2)
    ref = _reference(x, dense, weights)
    assert (out.double() - ref).abs().max() < 1e-5 * ref.abs().max()


def test_one_token_decode_matches_transformers(tmp_path, monkeypatch):
    """A Qwen3-MoE GGUF with Q4_0 experts of width 64, one sequence: greedy tokens and logits
    equal transformers' on the dequantized weights, and every MoE layer of every decode step
    went through the one call."""
    import test_moe_gguf as moe_files
    from conftest import hf_greedy

    from flexgen_infinigen import OffloadedLM
    from flexgen_infinigen.models import moe
    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    monkeypatch.setitem(moe_files.FAMILIES, "qwen3moe-64", (
        "qwen3moe", "Qwen3Moe", dict(moe_files.QWEN3, moe_intermediate_size=64,
                                     norm_topk_prob=True, mlp_only_layers=[1]), {}))
    model = moe_files._tiny("qwen3moe-64")
    path = tmp_path / "q4_0.gguf"
    moe_files.write_moe_gguf(model, "qwen3moe-64", path, "Q4_0")
    store = convert_gguf(path, tmp_path / "store", progress=False)
    taken = []

    def counted(*args):
        out = cpu_layers.moe_token(*args)
        taken.append(out is not None)
        return out
    monkeypatch.setattr(moe, "moe_token", counted)
    prompt = moe_files.PROMPTS[0]
    steps = moe_files.STEPS
    with OffloadedLM.load(path=store, policy=moe_files.CPU_MEMORY, progress=False) as lm:
        out = lm.generate([prompt], steps, stop_token_id=None, keep_logits=True)
    tokens, logits = hf_greedy(model, prompt, steps)
    assert out.token_ids[0] == tokens
    assert (out.logits[0] - logits).abs().max().item() < 2e-3 * logits.abs().max().item()
    moe_layers = model.config.num_hidden_layers - 1
    # the prompt's tokens and the first token come from the prefill; each later step is one
    assert taken.count(True) == moe_layers * (steps - 1) and all(taken)
