"""Page summaries for InfiniGen's speculation (kv/infinigen/spec_pages.py): the bounds hold
for every key of a page, padding widens no page, the compiled selection equals the torch one,
and a run that keeps every page equals the full cache."""
from __future__ import annotations

import math

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.kv import InfiniGenOptions
from flexgen_infinigen.kv.infinigen.spec_pages import SpeculationPages
from flexgen_infinigen.kernels import cpu_kernels
from flexgen_infinigen.memory.tiers import Tiers


def _pages(length=700, b=2, kv=3, w=64, pad=40, written_in=(300, 1, 399)):
    torch.manual_seed(length)
    pages = SpeculationPages("pages16", length + 10, b * kv, w, torch.float32, Tiers("cpu"))
    rows = torch.randn(length, b * kv, w)
    valid = torch.ones(length, b * kv, dtype=torch.bool)
    valid[:pad, :kv] = False  # the first sequence is left-padded
    start = 0
    for n in written_in:  # a prompt, then tokens one at a time, then the rest
        pages.write(rows[start:start + n], start, valid[start:start + n])
        start += n
    visible = valid[:, ::kv].t().contiguous()  # [b, length]
    return pages, rows, visible


def test_a_page_bound_holds_for_every_key_it_covers_and_padding_widens_none():
    pages, rows, visible = _pages()
    b, kv, g, w = 2, 3, 3, 64
    pq = torch.randn(b, kv, g, w)
    exact = torch.einsum("bkgw,tbkw->bkgt", pq, rows.view(-1, b, kv, w))
    bounds = pages.scores(pq, rows.shape[0])
    assert ((exact <= bounds + 1e-4) | ~visible[:, None, None, :]).all()
    # the padded sequence's first pages hold only its visible keys
    lo = pages.lo[:kv, :3]  # pages 0-2 of sequence 0 (tokens 0-47, 40 of them padding)
    assert torch.isinf(lo[:, :2]).all()  # tokens 0-31: all padding, still empty
    assert torch.allclose(lo[:, 2], rows[40:48, :kv].amin(0))


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: torch only")
@pytest.mark.parametrize("cap", [1, 37, 100, 1000])
def test_the_compiled_page_selection_chooses_what_torch_chooses(cap):
    pages, rows, visible = _pages()
    pq = torch.randn(2, 3, 3, 64) * 0.3
    caps = torch.tensor([cap, cap])
    fast, fast_counts = pages.select_mass(pq, visible, caps, cap)
    pages.use_kernel = False
    slow, slow_counts = pages.select_mass(pq, visible, caps, cap)
    assert torch.equal(fast_counts, slow_counts)
    for i in range(2):
        for h in range(3):
            n = int(fast_counts[i, h])
            chosen = fast[i, h, :n].tolist()
            assert chosen == sorted(chosen) and len(set(chosen)) == n
            assert set(chosen) == set(slow[i, h, :n].tolist())
            assert all(visible[i, t] for t in chosen)
            # whole pages: every chosen page's visible tokens, enough for ``cap`` of them
            pages_of = {t // 16 for t in chosen}
            assert n == sum(int(visible[i, p * 16:(p + 1) * 16].sum()) for p in pages_of)
            assert min(cap, int(visible[i].sum())) <= n < min(cap, int(visible[i].sum())) + 16


def test_keeping_every_page_equals_the_full_cache(tiny_llama):
    prompts = [[1] + list(range(7, 90)), [1] + list(range(100, 140))]
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=2)
    outs = []
    for kv, options in (("full", None), ("infinigen", {"options": InfiniGenOptions(
            speculation_keys="pages16", max_kv_fraction=1.0, alpha=math.inf,
            first_layer=1)})):
        with OffloadedLM.load(path=tiny_llama[1], policy=policy, kv_policy=kv,
                              kv_options=options, progress=False) as lm:
            outs.append(lm.generate(prompts, 6, stop_token_id=None, keep_logits=True))
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logits, outs[1].logits):
        assert (a - b).abs().max().item() < 1e-4


def test_pages_select_and_read_fewer_rows(tiny_llama):
    prompts = [[1] + list(range(7, 200))]
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0])
    options = InfiniGenOptions(speculation_keys="pages16", max_kv_fraction=0.25, min_num_kv=4,
                               first_layer=1)
    with OffloadedLM.load(path=tiny_llama[1], policy=policy, kv_policy="infinigen",
                          kv_options={"options": options}, progress=False) as lm:
        lm.generate(prompts, 4, stop_token_id=None)
        report = lm.engine.kv_policy.report()
    per_layer = report["kv_fetch_fraction_per_layer"]
    assert per_layer[0] == 1.0 and all(0.15 < f < 0.4 for f in per_layer[1:]), per_layer
