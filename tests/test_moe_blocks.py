"""A decode step's routed experts over a GGUF file's blocks in one compiled call
(``kernels/c/moe_blocks.c``, ``kernels.gguf.moe_blocks``, taken by ``models/moe.py`` when
the experts are blocks as they lie): against the experts in float64 from gguf's own
dequantization (x rounded to 8 bits as the kernels round it), against the per-expert path it
replaces (each product ``linear_blocks``'s), a token's result alone equal to its result
beside others, and what it refuses."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_gguf_kernels import quantized, random_blocks, reference

from flexgen_infinigen.kernels.gguf import linear_blocks, moe_blocks
from flexgen_infinigen.memory.codes import BLOCK_FORMS, Blocks, PackedWeight
from flexgen_infinigen.models import moe

gguf = pytest.importorskip("gguf")
H, FF = 512, 256  # whole K-quant blocks, unequal (a swapped shape fails)


def _experts(kinds: tuple[str, str], n: int, seed: int):
    """n experts' (gate, up, down) as blocks (gate and up of kinds[0], down of kinds[1])."""
    rng = np.random.default_rng(seed)
    mats, raws = [], []
    for _ in range(n):
        for kind, shape in ((kinds[0], (FF, H)), (kinds[0], (FF, H)), (kinds[1], (H, FF))):
            raw = random_blocks(kind, *shape, rng)
            mats.append(PackedWeight(Blocks(torch.from_numpy(raw), kind, shape)))
            raws.append((raw, kind, shape))
    return mats, raws


def _routing(tokens: int, experts: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    return weights, chosen, sorted(set(chosen.reshape(-1).tolist()))


def _per_expert(x, mats, chosen, weights, used):
    out = torch.zeros_like(x)
    for e in used:
        rows, slot = torch.where(chosen == e)
        g, u, d = mats[3 * e:3 * e + 3]
        y = linear_blocks(F.silu(linear_blocks(x[rows], g)) * linear_blocks(x[rows], u), d)
        out.index_add_(0, rows, y * weights[rows, slot, None])
    return out


@pytest.mark.parametrize("kinds", [("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"), ("Q4_0", "Q5_K")])
@pytest.mark.parametrize("tokens", [1, 3])
def test_matches_the_per_expert_path_and_the_float64_experts(kinds, tokens):
    experts, k = 6, 2
    mats, raws = _experts(kinds, experts, seed=tokens)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(7))
    weights, chosen, used = _routing(tokens, experts, k, seed=3)
    got = moe.apply_experts(x, weights, chosen, used, lambda e: mats[3 * e:3 * e + 3])
    first, toks, wts = moe._by_expert(weights, chosen, used, False)
    direct = moe_blocks(x, [m for e in used for m in mats[3 * e:3 * e + 3]], first, toks, wts)
    assert direct is not None and torch.equal(got, direct)  # the layer took the call
    want = _per_expert(x, mats, chosen, weights, used)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    dense = [torch.from_numpy(reference(*r).astype(np.float64)) for r in raws]
    exact = torch.zeros(tokens, H, dtype=torch.float64)
    for t in range(tokens):
        xt = torch.from_numpy(quantized(x[t:t + 1].double().numpy(), BLOCK_FORMS[kinds[0]][1]))
        for slot, e in enumerate(chosen[t].tolist()):
            g, u, d = dense[3 * e:3 * e + 3]
            act = (F.silu(xt @ g.T) * (xt @ u.T)).numpy()
            act = torch.from_numpy(quantized(act, BLOCK_FORMS[kinds[1]][1]))
            exact[t] += weights[t, slot].double() * (act @ d.T)[0]
    assert (got.double() - exact).abs().max() <= 1e-4 * exact.abs().max()


def test_a_tokens_result_does_not_depend_on_its_neighbours():
    mats, _ = _experts(("Q4_K", "Q6_K"), 5, seed=9)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(1))
    weights, chosen, used = _routing(4, 5, 2, seed=5)
    together = moe.apply_experts(x, weights, chosen, used, lambda e: mats[3 * e:3 * e + 3])
    for t in range(4):
        alone = moe.apply_experts(x[t:t + 1], weights[t:t + 1], chosen[t:t + 1],
                                  sorted(chosen[t].tolist()), lambda e: mats[3 * e:3 * e + 3])
        assert torch.equal(alone[0], together[t])


def test_refuses_what_it_does_not_compute():
    mats, _ = _experts(("Q4_K", "Q6_K"), 2, seed=2)
    x = torch.randn(1, H)
    args = ([0, 1, 2], [0, 0], [0.5, 0.5])
    assert moe_blocks(x, mats, *args) is not None
    mixed = list(mats)
    mixed[1] = _experts(("Q8_0", "Q8_0"), 1, seed=3)[0][1]  # up of another type than gate
    assert moe_blocks(x, mixed, *args) is None
    assert moe_blocks(x.double(), mats, *args) is None
    swapped = [mats[2], mats[1], mats[0], *mats[3:]]  # a down where a gate goes
    assert moe_blocks(x, swapped, *args) is None
    assert moe_blocks(x.expand(17, H).contiguous(), mats[:3], [0, 17], list(range(17)),
                      [1.0] * 17) is None  # more tokens for an expert than the call takes
