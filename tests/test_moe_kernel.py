"""A decode step's routed experts in one compiled call (``kernels/moe_experts.c``, called
by ``cpu_layers.moe_experts`` from ``models/moe.py``): against the experts computed in
float64 from the expanded codes, against the per-expert path it replaces, in the portable
build (no AVX2), and end to end, where a Qwen3-MoE GGUF with Q4_0 experts decodes
transformers' tokens, one sequence and two, with the call taking every MoE layer of every
decode step."""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F
from conftest import portable_kernels
from test_half_scales import _weights

from flexgen_infinigen.kernels import cpu_kernels, layers as cpu_layers
from flexgen_infinigen.engine import fused_moe

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


def _routing(tokens: int, experts: int, k: int, seed: int):
    """Each token's k distinct experts and softmax weights; the call's arguments from them:
    the experts used (ascending), where each one's tokens start, the tokens, their weights."""
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
    used = torch.unique(chosen).tolist()
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    first = [0] + torch.cumsum(torch.bincount(flat)[used], 0).tolist()
    return chosen, weights, used, first, order // k, weights.reshape(-1)[order]


def _reference(x, dense, chosen, weights):
    """float64: each token's experts, weighted."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, wt in zip(chosen[t].tolist(), weights[t]):
            g, u, d = dense[3 * e:3 * e + 3]
            xt = x[t:t + 1].double()
            out[t] += wt.double() * F.linear(F.silu(F.linear(xt, g)) * F.linear(xt, u), d)[0]
    return out


def _per_expert(x, half, chosen, weights, used):
    """The path the call replaces: a linear call a matrix over each expert's rows, torch's
    silu, index_add_ in expert order."""
    out = torch.zeros(x.shape[0], H)
    for e in used:
        rows, slot = torch.where(chosen == e)
        g, u, d = half[3 * e:3 * e + 3]
        y = cpu_layers.linear(F.silu(cpu_layers.linear(x[rows], g)) *
                              cpu_layers.linear(x[rows], u), d)
        out.index_add_(0, rows, y * weights[rows, slot, None])
    return out


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("tokens,experts,k", [(1, 1, 1), (1, 8, 8), (3, 6, 2), (9, 4, 3),
                                              (16, 8, 2)])
def test_matches_the_experts_in_float64(kind, tokens, experts, k):
    """Within 1e-3 of the largest output of what the expanded codes give (x and the
    activations are rounded to 16 bits per 64 values, as every 4-bit kernel here does), and
    within 1e-4 of what the per-expert path gives (silu rounded otherwise can move an
    activation's 16-bit step). Experts taking one token, several (up to 9: a full and a
    partial block of 8 rows) and shared by most tokens."""
    half, dense = _experts(kind, experts, seed=10 * tokens + experts)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(tokens))
    chosen, weights, used, first, tok, wt = _routing(tokens, experts, k, seed=experts)
    mats = [m for e in used for m in half[3 * e:3 * e + 3]]
    ours = cpu_layers.moe_experts(x, mats, first, tok, wt)
    assert ours is not None and ours.shape == (tokens, H)
    ref = _reference(x, dense, chosen, weights)
    assert (ours.double() - ref).abs().max() < 1e-3 * ref.abs().max()
    per_expert = _per_expert(x, half, chosen, weights, used)
    assert (ours - per_expert).abs().max() < 1e-4 * per_expert.abs().max()


def test_refuses_what_it_does_not_compute():
    """None (the caller multiplies expert by expert) for 8-bit codes, float32 factors,
    widths off the 64-value blocks, a weight that is not codes, more tokens for an expert
    than the call takes, offsets that do not match the experts."""
    half, _ = _experts("Q4_0", 2, seed=1)
    x = torch.randn(1, H)
    tok, w = torch.tensor([0, 0]), torch.tensor([0.6, 0.4])
    assert cpu_layers.moe_experts(x, half, [0, 1, 2], tok, w) is not None
    q8, _ = _weights("Q8_0", (FF, H), seed=3)
    assert cpu_layers.moe_experts(x, [q8] + half[1:], [0, 1, 2], tok, w) is None
    _, wide = _weights("Q4_0", (FF, H), seed=3)  # float32 factors
    assert cpu_layers.moe_experts(x, [wide] + half[1:], [0, 1, 2], tok, w) is None
    odd, _ = _weights("Q4_0", (96, H), seed=4)  # an expert width of 96: not whole blocks
    odd_down, _ = _weights("Q4_0", (H, 96), seed=5)
    assert cpu_layers.moe_experts(x, [odd, odd, odd_down] + half[3:], [0, 1, 2], tok, w) is None
    assert cpu_layers.moe_experts(x, [half[0].dense()] + half[1:], [0, 1, 2], tok, w) is None
    many = cpu_layers.MOE_MAX_ROWS + 1
    xs = torch.randn(many, H)
    assert cpu_layers.moe_experts(xs, half[:3], [0, many], torch.arange(many),
                                  torch.ones(many)) is None
    assert cpu_layers.moe_experts(x, half, [0, 2], tok, w) is None  # 2 experts, 1 range


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """``moe_experts.c`` built for a plain x86-64 (no AVX2): its float-loop rows."""
    lib = portable_kernels(tmp_path_factory, "moe_experts.c")
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.moe_q4_h16.argtypes = [ptr, i64, i64] + [ptr] * 7 + [i64] * 4
    lib.moe_q4_h16.restype = ctypes.c_int
    return lib


def test_portable_build(portable):
    half, dense = _experts("Q4_1", 4, seed=7)
    x = torch.randn(3, H)
    chosen, weights, used, first, tok, wt = _routing(3, 4, 2, seed=3)
    mats = [m for e in used for m in half[3 * e:3 * e + 3]]
    ptrs = [(ctypes.c_void_p * len(mats))(*(getattr(p.packed, part).data_ptr() for p in mats))
            for part in ("codes", "scale", "minimum")]
    starts, tok, wt = torch.tensor(first), tok.contiguous(), wt.contiguous()
    out = torch.empty(3, H)
    assert portable.moe_q4_h16(x.data_ptr(), 3, len(used), starts.data_ptr(), tok.data_ptr(),
                               wt.data_ptr(), *ptrs, out.data_ptr(), H, FF,
                               half[0].packed.group, 2)
    ref = _reference(x, dense, chosen, weights)
    assert (out.double() - ref).abs().max() < 1e-5 * ref.abs().max()


@pytest.mark.parametrize("per_batch,batches", [(1, 1), (2, 1), (1, 2)])
def test_decode_matches_transformers(tmp_path, monkeypatch, per_batch, batches):
    """A Qwen3-MoE GGUF with Q4_0 experts of width 64; one sequence, two in one GPU batch,
    two as two GPU batches of one: greedy tokens and logits equal transformers' on the
    dequantized weights, and every MoE layer of every decode step went through the one
    call, once for the whole block (two GPU batches' tokens together, equal to each GPU
    batch through its own call); a prompt as well wherever no expert takes more of its
    rows than the call can."""
    import test_moe_gguf as moe_files
    from conftest import hf_greedy

    from flexgen_infinigen import OffloadedLM, Placement
    from flexgen_infinigen.models import moe
    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    monkeypatch.setitem(moe_files.FAMILIES, "qwen3moe-64", (
        "qwen3moe", "Qwen3Moe", dict(moe_files.QWEN3, moe_intermediate_size=64,
                                     norm_topk_prob=True, mlp_only_layers=[1]), {}))
    model = moe_files._tiny("qwen3moe-64")
    path = tmp_path / "q4_0.gguf"
    moe_files.write_moe_gguf(model, "qwen3moe-64", path, "Q4_0")
    store = convert_gguf(path, tmp_path / "store", progress=False)
    taken, whole = [], []

    def counted(*args):
        out = cpu_layers.moe_experts(*args)
        taken.append((out is not None, args[0].shape[0]))
        return out
    monkeypatch.setattr(moe, "moe_experts", counted)
    stage_call = fused_moe.MoePlan.__call__

    def counted_stage(plan, h):  # a decode step's whole MoE stage in one call
        out = stage_call(plan, h)
        whole.append((out is not None, h.numel() // h.shape[-1]))
        return out
    monkeypatch.setattr(fused_moe.MoePlan, "__call__", counted_stage)
    prompts = moe_files.PROMPTS[:per_batch * batches]
    steps = moe_files.STEPS
    policy = Placement.from_percent([100, 0, 100, 0, 100, 0], gpu_batch_size=per_batch,
                                 num_gpu_batches=batches, expert_gpu_percent=0,
                                 expert_cpu_percent=100)

    def run(block: bool):
        with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
            for stage in lm.engine.stages:  # off: each GPU batch through its own call
                stage.moe = stage.moe and block
            return lm.generate(prompts, steps, stop_token_id=None, keep_logits=True)
    if batches > 1:
        apart = run(False)
        taken.clear()
        whole.clear()
    out = run(True)
    if batches > 1:  # the block's call changes no token, and no logit beyond rounding
        assert apart.token_ids == out.token_ids
        for a, b in zip(apart.logits, out.logits):
            assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()
    for row, prompt in enumerate(prompts):
        tokens, logits = hf_greedy(model, prompt, steps)
        assert out.token_ids[row] == tokens
        assert (out.logits[row] - logits).abs().max().item() < 2e-3 * logits.abs().max().item()
    moe_layers = model.config.num_hidden_layers - 1
    assert all(ok for ok, _ in taken + whole)
    # one call per MoE layer and decode step, with every sequence's token (the whole stage:
    # engine/fused_moe.py); the experts calls are prompt passes (a GPU batch's prompts,
    # padded to the longest: more rows)
    assert [rows for _, rows in whole] == [len(prompts)] * (moe_layers * (steps - 1))
    assert not [rows for _, rows in taken if rows <= len(prompts)]
    assert all(rows >= per_batch * max(map(len, prompts)) for _, rows in taken
               if rows > len(prompts))
