"""Selection rules on hand-made scores, the variable-count fetch, and the oracle."""
from __future__ import annotations

import math

import pytest
import torch

from flexgen_infinigen.kv.selection_rules import Budget, select

# one KV head whose group has two query heads, six cached tokens:
# head 0 likes tokens 0, 2, 3 (close together); head 1 likes token 1 strongly, then token 4
HEAD0 = [5.0, 0.0, 4.8, 4.6, 0.0, 0.0]
HEAD1 = [0.0, 6.0, 0.0, 0.0, 3.0, 0.0]


def _chosen(order, counts):
    return [[sorted(order[b, k, :counts[b, k]].tolist()) for k in range(order.shape[1])]
            for b in range(order.shape[0])]


def _scores(*heads):
    return torch.tensor([[heads]])  # [1, 1, G, t]


@pytest.mark.parametrize("rule, alpha, expected", [
    ("cap", math.inf, [0, 1, 2, 3]),  # best margin over the group: 0 and 1 (0), 2, 3
    ("margin", 0.3, [0, 1, 2]),  # only three tokens are within 0.3 of a head's best
    ("margin", math.inf, [0, 1, 2, 3]),
    ("head-union", math.inf, [0, 1, 2, 4]),  # every head's first, then every head's second
    ("mass", math.inf, [0, 1, 2, 3]),  # softmax mass summed over the two heads
    ("artifact", 1.0, [0, 1, 2, 4]),  # counts 3 and 1 -> k = 2; top 2 of each head, union
])
def test_rules_on_a_group_of_two_heads(rule, alpha, expected):
    valid = torch.ones(1, 6, dtype=torch.bool)
    order, counts = select(_scores(HEAD0, HEAD1), valid, rule, alpha,
                           Budget(fraction=0.7, min_num=1))  # cap floor(6 * 0.7) = 4
    assert _chosen(order, counts) == [[expected]]


def test_left_padding_is_never_chosen_and_caps_follow_each_row():
    scores = torch.tensor([[[HEAD0, HEAD1]]] * 2)  # [2, 1, 2, 6]
    valid = torch.tensor([[True] * 6, [False, False] + [True] * 4])
    order, counts = select(scores, valid, "cap", math.inf, Budget(fraction=0.7, min_num=1))
    # row 0: cap 4 of 6; row 1: cap floor(4 * 0.7) = 2 among tokens 2..5, where head 0's
    # best is token 2 and head 1's is token 4
    assert _chosen(order, counts) == [[[0, 1, 2, 3]], [[2, 4]]]


def test_each_kv_head_selects_on_its_own():
    scores = torch.tensor([[[HEAD0, HEAD1], [HEAD0[::-1], HEAD1[::-1]]]])  # [1, 2, 2, 6]
    order, counts = select(scores, torch.ones(1, 6, dtype=torch.bool), "cap", math.inf,
                           Budget(fraction=0.7, min_num=1))
    assert _chosen(order, counts) == [[[0, 1, 2, 3], [2, 3, 4, 5]]]


def test_sink_and_recent_are_kept_inside_the_budget():
    scores = torch.zeros(1, 1, 1, 10)
    scores[0, 0, 0, 5] = 9.0
    valid = torch.ones(1, 10, dtype=torch.bool)
    order, counts = select(scores, valid, "cap", math.inf,
                           Budget(fraction=0.3, min_num=1, keep_sink=1, keep_recent=1))
    assert _chosen(order, counts) == [[[0, 5, 9]]]
    # the sink is the first *valid* token of a padded row
    valid[0, :3] = False
    order, counts = select(scores, valid, "cap", math.inf,
                           Budget(fraction=0.3, min_num=1, keep_sink=1, keep_recent=1))
    assert _chosen(order, counts) == [[[3, 9]]]  # cap floor(7 * 0.3) = 2: sink and recent


def test_floor_and_absolute_cap():
    scores = torch.arange(100.0).view(1, 1, 1, 100)
    valid = torch.ones(1, 100, dtype=torch.bool)
    order, counts = select(scores, valid, "margin", 0.5, Budget(fraction=0.2, min_num=4))
    assert counts.item() == 4 and sorted(order[0, 0, :4].tolist()) == [96, 97, 98, 99]
    order, counts = select(scores, valid, "cap", math.inf, Budget(fraction=0.5, max_num=7))
    assert counts.item() == 7


def test_fetch_moves_exactly_the_selected_rows(tmp_path):
    """Cache split over device, host and disk: rows arrive per KV head in rank order, and
    the ledger counts one row per selected (token, head) pair."""
    from flexgen_infinigen.kv.base import CacheSpec
    from flexgen_infinigen.kv.full import FullCache
    from flexgen_infinigen.kv.chosen_rows import fetch_selected
    from flexgen_infinigen.memory.tiers import Tiers

    tiers = Tiers(torch.device("cpu"), str(tmp_path))
    b, kv, d, max_len = 2, 3, 4, 10
    spec = CacheSpec(tiers, 2, 0, b, max_len, kv, d, torch.float32, (0.34, 0.33, 0.33), False,
                     False)
    cache = FullCache(spec)
    k = torch.randn(max_len, b * kv, d)
    v = torch.randn(max_len, b * kv, d)
    cache.k.write(k)
    cache.v.write(v)
    tiers.reset_counters()
    order = torch.randint(0, max_len, (b, kv, 5))
    counts = torch.tensor([[5, 1, 3], [0, 2, 4]])
    k_sel, v_sel, moved = fetch_selected(cache, order, counts)
    assert moved == counts.sum().item() and k_sel.shape == (6, b * kv, d)  # + new token row
    for col in range(b * kv):
        n = counts.view(-1)[col].item()
        rows = order.view(b * kv, -1)[col, :n]
        assert torch.equal(k_sel[:n, col], k[rows, col])
        assert torch.equal(v_sel[:n, col], v[rows, col])
        assert not k_sel[n:, col].any()
    # columns 0-1 live on the device (nothing moves), 2-3 in host memory, 4-5 on disk
    host_rows = counts.view(-1)[2:].sum().item()
    disk_rows = counts.view(-1)[4:].sum().item()
    assert tiers.bytes_moved["host->device"]["kv_cache"] == 2 * host_rows * d * 4
    assert tiers.bytes_moved["disk->host"]["kv_cache"] == 2 * disk_rows * d * 4
    tiers.close()


@pytest.mark.parametrize("kind, width", [("int4", 64), ("int4", 19), ("int2", 19),
                                         ("int8", 64), ("partial", 19)])
def test_speculation_keys_score_like_their_dequantized_keys(kind, width):
    """Scores from packed codes equal q . (codes * scale + min), and every dequantized value
    is within half a quantization step of the key written."""
    from flexgen_infinigen.kv.infinigen.spec_keys import KINDS, SpeculationKeys
    from flexgen_infinigen.memory.tiers import Tiers

    torch.manual_seed(0)
    keys = SpeculationKeys(kind, 50, 6, width, torch.float32, Tiers(torch.device("cpu")))
    rows = torch.randn(40, 6, width)
    keys.write(rows[:30], 0)
    keys.write(rows[30:], 30)
    back = keys.keys(40)
    if KINDS[kind] is None:
        assert torch.equal(back, rows)
    else:
        step = (rows.amax(-1, keepdim=True) - rows.amin(-1, keepdim=True)) / (2 ** KINDS[kind] - 1)
        assert ((back - rows).abs() <= step / 2 + 1e-5).all()
    pq = torch.randn(2, 3, 3, width)
    keys.use_kernel = False  # the format itself (the CPU kernel: tests/test_cpu_kernels.py)
    expected = torch.matmul(pq, back.view(40, 2, 3, width).permute(1, 2, 3, 0))
    assert torch.allclose(keys.scores(pq, 40), expected, atol=1e-4)


def test_default_budget_reads_a_share_with_a_floor_in_rows():
    """The default: 4% of a long context, but at least 256 rows (all of a shorter one); an
    explicit ``--max-num-kv`` below the floor wins; the cost model's share follows the same
    counts (``fetch_fraction`` at a context)."""
    from flexgen_infinigen.config import get_config
    from flexgen_infinigen.kv import InfiniGenOptions
    from flexgen_infinigen.kv.infinigen.policy import InfiniGenPolicy

    n = torch.tensor([100, 1000, 6400, 32000])
    caps = InfiniGenOptions().budget.caps(n).tolist()
    assert caps == [100, 256, 256, 1280]  # all of 100; the floor; 4% of 6,400 = 256; 4%
    assert InfiniGenOptions(max_num_kv=64).budget.caps(n).tolist() == [64, 64, 64, 64]
    assert InfiniGenOptions(min_num_kv=4, max_kv_fraction=0.04).budget.caps(n).tolist() == \
        [4, 40, 256, 1280]
    cfg = get_config("smollm2-135m")  # 30 layers, the first two read whole
    policy = InfiniGenPolicy()
    for context, share in [(1000, 0.256), (32000, 0.04), (100, 1.0)]:
        want = (2 + 28 * share) / 30
        assert policy.fetch_fraction(cfg, context) == pytest.approx(want)
    assert policy.fetch_fraction(cfg) == pytest.approx((2 + 28 * 0.04) / 30)
