"""The compiled CPU kernels equal torch: packed speculation keys get the torch path's scores
(to float rounding) and so the same selection, tokens and fetched rows; the decode-step
linear layer equals ``F.linear``."""
from __future__ import annotations

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.kv.infinigen import spec_keys
from flexgen_infinigen.kv.infinigen.spec_keys import SpeculationKeys
from flexgen_infinigen.kernels import cpu_kernels as kernels
from flexgen_infinigen.kernels import layers as layers
from flexgen_infinigen.memory.tiers import Tiers

if kernels.library() is None:
    pytest.skip("no C compiler here: the kernel falls back to torch", allow_module_level=True)


Q16_MAX = 8191  # speculation.c's largest |q| against 8-bit codes


def _rounded_query(pq: torch.Tensor, top: int = 127) -> torch.Tensor:
    """Each query row rounded as the AVX2 kernel rounds it: max |q| to ``top`` (127 against
    4-bit codes, Q16_MAX against 8-bit ones)."""
    scale = pq.abs().amax(-1, keepdim=True) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(pq / scale) * scale


@pytest.mark.parametrize("kind", ["int4", "int2", "int8"])
@pytest.mark.parametrize("length,cols,group,width", [(1, 2, 1, 64), (700, 6, 3, 64),
                                                    (1300, 4, 7, 50), (33, 3, 2, 128),
                                                    (1029, 2, 7, 128), (901, 3, 3, 32),
                                                    (19, 2, 7, 32)])
def test_kernel_scores_equal_torch(kind, length, cols, group, width):
    """The kernel's scores equal the torch path's. Where it multiplies integers (4-bit codes
    of a width of 32, 64 or 128; 8-bit codes of a width a multiple of 16) it rounds each
    query row to 8 bits (16 bits against 8-bit codes) for the product with the codes: its
    scores equal the torch path's computed that way, and the rounding moves them by far
    less than the keys themselves are off (measured here: under a quarter of the keys' own
    error)."""
    torch.manual_seed(length)
    keys = SpeculationKeys(kind, length + 5, cols, width, torch.float32, Tiers("cpu"))
    true_keys = torch.randn(length, cols, width) * 3
    keys.write(true_keys, 0)
    pq = torch.randn(1, cols, group, width)
    fast = keys.scores(pq, length)
    keys.use_kernel = False
    slow = keys.scores(pq, length)
    assert fast.shape == slow.shape == (1, cols, group, length)
    tol = 1e-5 * slow.abs().max().item() + 1e-5
    top = _integer_query(kind, width)
    if top is None:  # codes expanded to floats: the same sums
        assert (fast - slow).abs().max().item() <= tol
        return
    rounded = _rounded_query(pq, top)  # q . codes on the rounded query, the minimum times sum(q)
    lo = keys.lo[:, :length].view(1, cols, 1, length)
    ref = keys.scores(rounded, length) + lo * (pq.sum(-1) - rounded.sum(-1))[..., None]
    assert (fast - ref).abs().max().item() <= 2 * tol
    exact = torch.einsum("bkgw,tkw->bkgt", pq, true_keys)
    query_error = (fast - slow).pow(2).mean().sqrt()
    key_error = (slow - exact).pow(2).mean().sqrt()
    assert query_error < 0.25 * key_error, (query_error, key_error)


@pytest.mark.parametrize("width", [64, 32])
@pytest.mark.parametrize("b,kv,group,length", [(1, 3, 3, 700), (2, 2, 7, 1100), (3, 1, 1, 40)])
def test_fused_speculation_selects_what_scores_and_select_select(b, kv, group, length, width):
    """Scoring and the mass rule in one pass (``speculate_mass``) choose the tokens that the
    kernel's scores followed by :func:`select` choose, padding never chosen."""
    from flexgen_infinigen.kv.selection_rules import Budget, select

    torch.manual_seed(length)
    keys = SpeculationKeys("int4", length + 3, b * kv, width, torch.float32, Tiers("cpu"))
    keys.write(torch.randn(length, b * kv, width) * 2, 0)
    pq = torch.randn(b, kv, group, width) * 0.3
    visible = torch.ones(b, length, dtype=torch.bool)
    visible[0, :length // 4] = False
    budget = Budget(fraction=0.15, min_num=4)
    n_valid = visible.sum(-1)
    caps = torch.minimum(budget.caps(n_valid), n_valid)
    order = keys.select_mass(pq, visible, caps, budget.most(length))
    ref, counts = select(keys.scores(pq, length), visible, "mass", 5.0, budget)
    assert order.shape == ref.shape
    for i in range(b):
        n = int(caps[i])
        assert counts[i].tolist() == [n] * kv
        for h in range(kv):
            assert set(order[i, h, :n].tolist()) == set(ref[i, h, :n].tolist())
            assert all(visible[i, t] for t in order[i, h, :n].tolist())


def _integer_query(kind: str, width: int):
    """The largest |q| the AVX2 kernel rounds a query row to for keys of ``kind`` and
    ``width`` columns (None: it expands the codes to floats)."""
    if kind == "int4" and width // 2 in (16, 32, 64, 96, 128):
        return 127
    if kind == "int8" and width % 16 == 0 and width <= 256:
        return Q16_MAX
    return None


def _scores_rounded_as_the_kernel(real):
    """``SpeculationKeys.scores`` whose torch path sees the query as the AVX2 kernel does
    where it multiplies integers (above): q rounded per row for the product with the codes,
    its exact sum for the minimum's share."""
    def scores(self, pq, length):
        per = 8 // self.bits if self.bits else 0
        top = per and _integer_query(f"int{self.bits}", self.codes.shape[-1] * per)
        if not top:
            return real(self, pq, length)
        rounded = _rounded_query(pq, top)
        lo = self.lo[:, :length].reshape(pq.shape[0], pq.shape[1], 1, length)
        return real(self, rounded, length) + lo * (pq.sum(-1) - rounded.sum(-1))[..., None]
    return scores


def test_generation_with_the_kernel_equals_without(tiny_llama, monkeypatch):
    """The tiny model's head dim of 32 gives 16-byte rows of codes: the kernel's byte products
    apply, so the torch path rounds the query as the kernel does (see test above)."""
    prompts = [[1] + list(range(7, 60)), [1] + list(range(100, 140))]
    runs = []
    for use in (True, False):
        if not use:
            monkeypatch.setattr(spec_keys, "score_packed", lambda *a: None)
            monkeypatch.setattr(spec_keys, "speculate_mass", lambda *a: None)
            monkeypatch.setattr(SpeculationKeys, "scores",
                                _scores_rounded_as_the_kernel(SpeculationKeys.scores))
        policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=2)
        with OffloadedLM.load(path=tiny_llama[1], policy=policy, kv_policy="infinigen",
                              kv_options={"max_kv_fraction": 0.3, "min_num_kv": 4},
                              progress=False) as lm:
            out = lm.generate(prompts, 8, stop_token_id=None, keep_logits=True)
            runs.append((out, lm.engine.kv_policy.report()))
    (a, ra), (b, rb) = runs
    assert a.token_ids == b.token_ids
    assert ra["kv_fetch_fraction_per_layer"] == rb["kv_fetch_fraction_per_layer"]
    for x, y in zip(a.logits, b.logits):
        assert (x - y).abs().max().item() < 1e-4


def test_byte_products_change_few_selections_on_a_real_model(smollm2_store, monkeypatch):
    """SmolLM2 (head dim 64: the 8-bit query products apply), the same tokens teacher-forced
    with and without the kernels: the rows each KV head selects agree (measured: 98.8% on
    average, 95.4% at worst over layers and steps), and the logits barely move (0.17)."""
    from flexgen_infinigen.cli.prompts import synthesize_prompts
    from flexgen_infinigen.kv.infinigen import policy as infinigen

    chosen = []
    real_rank = infinigen.InfiniGenCache._rank

    def record(self, *a):
        order, counts = real_rank(self, *a)
        chosen[-1].append([set(order[i, h, :int(counts[i, h])].tolist())
                           for i in range(order.shape[0]) for h in range(order.shape[1])])
        return order, counts

    monkeypatch.setattr(infinigen.InfiniGenCache, "_rank", record)
    monkeypatch.setenv("FLEXGEN_INFINIGEN_FUSED", "0")  # the path through _rank's kernels
    runs = []
    for use in (True, False):
        if not use:
            monkeypatch.setattr(spec_keys, "score_packed", lambda *a: None)
            monkeypatch.setattr(spec_keys, "speculate_mass", lambda *a: None)
        chosen.append([])
        policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=1)
        with OffloadedLM.load(path=smollm2_store, policy=policy, kv_policy="infinigen",
                              kv_options={"speculation_query": "input"},  # speculation ranks
                              progress=False) as lm:
            prompt = synthesize_prompts(lm, 600, 1, 0)[0]
            forced = runs[0].token_ids if runs else None
            runs.append(lm.generate([prompt], 6, stop_token_id=None, keep_logits=True,
                                    forced=forced))
    fast, slow = chosen
    assert len(fast) == len(slow) > 0
    agree = [len(a & b) / max(1, len(a)) for x, y in zip(fast, slow) for a, b in zip(x, y)]
    assert min(agree) > 0.9 and sum(agree) / len(agree) > 0.97, (min(agree), sum(agree))
    drift = max((x - y).abs().max().item() for x, y in zip(runs[0].logits, runs[1].logits))
    assert drift < 0.5, drift


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("out_f,in_f", [(7, 5), (64, 576), (1030, 97)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_kernel_equals_f_linear(rows, out_f, in_f, with_bias):
    torch.manual_seed(rows * out_f)
    x = torch.randn(1, rows, in_f)
    w = torch.randn(out_f, in_f)
    b = torch.randn(out_f) if with_bias else None
    ours = layers.linear(x, w, b)
    ref = torch.nn.functional.linear(x, w, b)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-5 * (ref.abs().max().item() + 1)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16])
@pytest.mark.parametrize("out_f,in_f", [(7, 64), (130, 576), (33, 896)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_4bit_linear_kernel_equals_expanding_the_weights(rows, out_f, in_f, with_bias):
    """``linear_q4`` (x rounded to 16 bits per group of 64, integer products with the codes)
    against ``F.linear`` on the expanded weights, x holding an outlier 60x its spread (as
    SmolLM2's inputs do): within 1e-3 of the outputs' largest value (rounding x to 8 bits
    was off by several percent here). And each row of x gives, bit for bit, what it gives
    alone: one row goes through byte products, several through 16-bit ones, with the same
    integer sums in the same lanes."""
    from flexgen_infinigen.memory.codes import PackedWeight, compress, decompress

    gen = torch.Generator().manual_seed(rows * out_f + in_f)
    w = PackedWeight(compress(torch.randn(out_f, in_f, generator=gen) * 0.05))
    x = torch.randn(rows, in_f, generator=gen)
    x[:, 5] = 60.0
    b = torch.randn(out_f, generator=gen) if with_bias else None
    ours = layers.linear_q4(x, w, b)
    if ours is None:
        pytest.skip("no AVX2 here: 4-bit weights are expanded")
    ref = torch.nn.functional.linear(x.double(), decompress(w.packed).double(),
                                     None if b is None else b.double())
    assert (ours.double() - ref).abs().max() <= 1e-3 * ref.abs().max()
    for i in range(rows):
        assert torch.equal(layers.linear_q4(x[i:i + 1], w, b)[0], ours[i])


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 1, 896), (1, 300, 13), (3, 700, 64)])
def test_rms_norm_kernel_equals_torch(shape):
    """RMSNorm in one kernel call: torch's expression to float rounding, for one token and
    for prefill-sized inputs (threaded), widths with and without a vector tail."""
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=gen) * 3
    w = torch.randn(shape[-1], generator=gen)
    ours = layers.rms_norm(x, w, 1e-6)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert layers.rms_norm(x.half(), w.half(), 1e-6) is None  # other dtypes: torch's job


@pytest.mark.parametrize("b,s,heads,d", [(1, 1, 14, 64), (8, 1, 3, 64), (2, 5, 3, 20),
                                         (1, 600, 4, 128)])
def test_rotary_kernel_equals_torch(b, s, heads, d):
    """The rotary embedding in one kernel call: x cos + (x2, x1) signed sin, as
    ``models/llama.py`` writes it in torch, to float rounding."""
    from flexgen_infinigen.config import get_config
    from flexgen_infinigen.models import llama

    gen = torch.Generator().manual_seed(b * s + d)
    x = torch.randn(b, s, heads, d, generator=gen)
    positions = torch.randint(0, 30000, (b, s), generator=gen)
    cfg = get_config("smollm2-135m")
    cos, sin = llama.encode_positions(cfg, positions) if d == cfg.head_dim else (
        torch.randn(b, s, 1, d, generator=gen), torch.randn(b, s, 1, d, generator=gen))
    ours = layers.rotary(x, cos, sin)
    ref = x * cos + torch.roll(x, d // 2, -1) * sin
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()
    strided = torch.randn(b, s, d, heads).transpose(2, 3)  # same shape, not contiguous
    assert layers.rotary(strided, cos, sin) is None  # not its layout: torch's job


def test_linear_hands_other_cases_to_torch():
    w = torch.randn(8, 4)
    many = torch.randn(layers.MAX_LINEAR_ROWS + 1, 4)  # a prefill: BLAS's job
    assert torch.equal(layers.linear(many, w), torch.nn.functional.linear(many, w))
    half = torch.randn(2, 4, dtype=torch.bfloat16)
    assert layers.linear(half, w.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("rows,out_f,in_f", [(20, 768, 3072), (60, 576, 1536), (512, 768, 3072)])
def test_prefill_products_do_not_depend_on_the_thread_count(rows, out_f, in_f):
    """The prefill's BLAS products give the same bits on one thread as on several (MKL splits
    these shapes' sums between threads on AVX-512 CPUs unless the package's strict mode is on),
    so that pipeline ranks on one thread each reproduce one process."""
    torch.manual_seed(rows)
    x, w = torch.randn(rows, in_f), torch.randn(out_f, in_f)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layers.linear(x, w)
        torch.set_num_threads(max(threads, 2))
        several = layers.linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, several)


@pytest.mark.parametrize("b,kv,group,length,d", [(1, 3, 3, 4096, 64), (2, 2, 7, 2500, 64),
                                                  (3, 1, 1, 2049, 128), (1, 4, 2, 5000, 32)])
def test_attention_kernel_equals_torch(b, kv, group, length, d):
    """Decode attention over token-major rows, padding masked, against the two torch
    products (``return_key_mass`` keeps the torch path); rows must be contiguous."""
    from flexgen_infinigen.kernels.attention import attend_rows

    torch.manual_seed(length)
    k, v = torch.randn(length, b * kv, d), torch.randn(length, b * kv, d)
    q = torch.randn(b, 1, kv * group, d)
    bias = torch.zeros(b, 1, 1, length)
    bias[0, ..., :700] = torch.finfo(torch.float32).min  # a padded row
    ref = attend_rows(q, k, v, bias, return_key_mass=True)[0]
    assert kernels.attend_rows(q.reshape(b * kv, group, d), k, v,
                               bias.expand(b, kv, 1, length).reshape(b * kv, length)) is not None
    ours = attend_rows(q, k, v, bias)
    assert (ours - ref).abs().max().item() < 1e-5
    per_head = torch.randn(b, kv, 1, length)  # a bias per KV head (selected rows)
    ref = attend_rows(q, k, v, per_head, return_key_mass=True)[0]
    assert (attend_rows(q, k, v, per_head) - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("percent", [[100, 0, 100, 0, 100, 0], [100, 0, 0, 100, 100, 0]])
def test_infinigen_reading_selected_rows_in_place_equals_gathering_them(tiny_llama, percent,
                                                                        monkeypatch):
    """Selected rows attended where the cache lives (``attend_indexed``) give the tokens,
    logits and fetched fractions of gathering them into a buffer first."""
    from flexgen_infinigen.kv.infinigen import policy as infinigen

    prompts = [[1] + list(range(7, 70)), [1] + list(range(100, 130))]
    real_init = infinigen.InfiniGenCache.__init__

    def gathering(self, *a, **kw):
        real_init(self, *a, **kw)
        self.attend_in_place = False

    calls = []
    real_kernel = kernels.attend_indexed

    def counted(*a, **kw):  # counts the calls the kernel took (None: it refused the layout)
        out = real_kernel(*a, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(kernels, "attend_indexed", counted)
    monkeypatch.setenv("FLEXGEN_INFINIGEN_FUSED", "0")  # the policy's own attention
    runs = []
    for in_place in (True, False):
        if not in_place:
            assert calls and all(calls), "the first run did not read the selected rows in place"
            monkeypatch.setattr(infinigen.InfiniGenCache, "__init__", gathering)
        policy = Placement.from_percent(percent, gpu_batch_size=2)
        with OffloadedLM.load(path=tiny_llama[1], policy=policy, kv_policy="infinigen",
                              kv_options={"max_kv_fraction": 0.25, "min_num_kv": 4},
                              progress=False) as lm:
            out = lm.generate(prompts, 8, stop_token_id=None, keep_logits=True)
            runs.append((out, lm.engine.kv_policy.report()))
    (a, ra), (b, rb) = runs
    assert a.token_ids == b.token_ids
    assert ra["kv_fetch_fraction_per_layer"] == rb["kv_fetch_fraction_per_layer"]
    for x, y in zip(a.logits, b.logits):
        assert (x - y).abs().max().item() < 1e-4


@pytest.mark.parametrize("b,kv,group,length", [(1, 3, 3, 500), (4, 2, 7, 1200), (2, 1, 1, 40)])
def test_fused_mass_selection_chooses_what_select_chooses(b, kv, group, length):
    """The compiled ``mass`` rule picks the same tokens per KV head as :func:`select` (order
    within the choice aside), padding never chosen, counts equal to the budget's caps."""
    from flexgen_infinigen.kv.selection_rules import Budget, select

    torch.manual_seed(length)
    scores = torch.randn(b, kv, group, length) * 4
    visible = torch.ones(b, length, dtype=torch.bool)
    visible[0, :length // 5] = False  # left padding
    budget = Budget(fraction=0.2, min_num=4)
    order, counts = select(scores, visible, "mass", 5.0, budget)
    n_valid = visible.sum(-1)
    caps = torch.minimum(budget.caps(n_valid), n_valid)
    fused = kernels.select_mass(scores, visible, caps, order.shape[-1])
    assert fused.shape == order.shape
    for i in range(b):
        assert counts[i].tolist() == [int(caps[i])] * kv
        for h in range(kv):
            n = int(caps[i])
            assert set(fused[i, h, :n].tolist()) == set(order[i, h, :n].tolist())
            assert all(visible[i, t] for t in fused[i, h, :n].tolist())


@pytest.mark.parametrize("kind,width", [("int4", 64), ("int4", 19), ("int2", 64), ("int2", 19),
                                        ("int8", 64)])
def test_kernel_packs_speculation_keys_as_torch_does(kind, width):
    torch.manual_seed(width)
    fast = SpeculationKeys(kind, 50, 6, width, torch.float32, Tiers("cpu"))
    slow = SpeculationKeys(kind, 50, 6, width, torch.float32, Tiers("cpu"))
    slow.use_kernel = False
    prompt, step = torch.randn(30, 6, width) * 2, torch.randn(1, 6, width)
    for keys in (fast, slow):
        keys.write(prompt, 0)
        keys.write(step, 30)  # a decode step's key
    assert torch.equal(fast.codes, slow.codes)
    assert torch.equal(fast.lo, slow.lo)
    assert torch.allclose(fast.scale, slow.scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_4bit_cache_read_in_place_equals_expanding_it(smollm2_store, batch, monkeypatch):
    """A 4-bit KV cache in CPU memory is attended over where it is (``attend_rows_q4``:
    codes expanded a block of rows at a time), head-major: the same tokens and logits (to
    rounding) as expanding the whole cache into floats first, with left padding."""
    from flexgen_infinigen.kernels import cpu_kernels as ck

    # the per-operation path, where this bound was set: with the fused decode call around
    # the policy's attention, expanding differs from reading in place by up to 3.6e-3 at
    # batch 3 (same tokens; not yet explained, see the 2026-11-26 note)
    monkeypatch.setenv("FLEXGEN_INFINIGEN_FUSED", "0")
    prompts = [[1] + list(range(7, 7 + 2100 + 40 * i)) for i in range(batch)]
    calls = []
    real = ck.attend_rows_q4

    def counted(*a, **kw):  # counts the calls the kernel took (None: it refused the layout)
        out = real(*a, **kw)
        calls.append(out is not None)
        return out

    runs = []
    for in_place in (True, False):
        monkeypatch.setattr(ck, "attend_rows_q4", counted if in_place else (lambda *a, **kw: None))
        policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=batch,
                                     compress_cache=True)
        with OffloadedLM.load(path=smollm2_store, policy=policy, progress=False) as lm:
            runs.append(lm.generate(prompts, 4, stop_token_id=None, keep_logits=True))
        if in_place:
            assert calls and all(calls), "the kernel was not used (or refused its inputs)"
    a, b = runs
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logits, b.logits):
        assert (x - y).abs().max().item() < 1e-3


def test_infinigen_reading_a_4bit_layer_whole_reads_it_in_place(smollm2_store, monkeypatch):
    """Under ``select_from_mb`` InfiniGen reads a 4-bit layer whole: over the codes where they
    are (``attend_rows_q4``), never expanding the cache; the full 4-bit cache's tokens and
    logits."""
    from flexgen_infinigen.kv import InfiniGenOptions
    from flexgen_infinigen.kernels import cpu_kernels as ck

    prompts = [[1] + list(range(7, 7 + 1500))]
    calls = []
    real = ck.attend_rows_q4

    def counted(*a, **kw):  # counts the calls the kernel took (None: it refused the layout)
        out = real(*a, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(ck, "attend_rows_q4", counted)
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], compress_cache=True)
    runs = []
    for kv, kw in (("full", None), ("infinigen", {"options": InfiniGenOptions(
            select_from_mb=1e6)})):
        with OffloadedLM.load(path=smollm2_store, policy=policy, kv_policy=kv, kv_options=kw,
                              progress=False) as lm:
            calls.clear()
            runs.append(lm.generate(prompts, 4, stop_token_id=None, keep_logits=True))
            report = lm.engine.kv_policy.report()
        # 3 steps x 30 layers, every call taken
        assert len(calls) == 3 * 30 and all(calls), f"{kv}: {sum(calls)}/{len(calls)} taken"
    assert report["kv_fetch_fraction"] == 1.0 and report["speculation_time_s"] == 0
    a, b = runs
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logits, b.logits):
        assert (x - y).abs().max().item() < 1e-4


@pytest.mark.parametrize("keys", ["int4", "pages16"])
def test_infinigen_reads_its_chosen_4bit_rows_in_place(smollm2_store, keys, monkeypatch):
    """InfiniGen over a 4-bit cache in CPU memory attends over the chosen rows' codes
    (gathered, then ``attend_rows_q4``) instead of expanding them into floats first: the same
    tokens, logits to rounding and rows read, with left padding. Rounding can swap one
    near-tied token of a column's ~250 at a later step (seen at step 3: one token in one
    column of layer 9, the logits then 0.0065 apart), so later steps get a looser bound;
    a wrong kernel moves them by far more."""
    from flexgen_infinigen.kv import InfiniGenOptions
    from flexgen_infinigen.kernels import cpu_kernels as ck

    prompts = [[1] + list(range(7, 7 + 1200 + 70 * i)) for i in range(2)]
    options = InfiniGenOptions(select_from_mb=0.0, max_kv_fraction=0.2, min_num_kv=4,
                               speculation_keys=keys).validate()
    calls, runs = [], []
    real = ck.attend_rows_q4

    def counted(*a, **kw):  # counts the calls the kernel took (None: it refused the layout)
        out = real(*a, **kw)
        calls.append(out is not None)
        return out

    for in_place in (True, False):
        monkeypatch.setattr(ck, "attend_rows_q4", counted if in_place else (lambda *a, **kw: None))
        policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=2,
                                     compress_cache=True)
        with OffloadedLM.load(path=smollm2_store, policy=policy, kv_policy="infinigen",
                              kv_options={"options": options}, progress=False) as lm:
            out = lm.generate(prompts, 4, stop_token_id=None, keep_logits=True)
            runs.append((out, lm.engine.kv_policy.report()))
        if in_place:
            assert len(calls) == 3 * 30 and all(calls), \
                f"the kernel took {sum(calls)} of {len(calls)} layers' calls (90 expected)"
    (a, ra), (b, rb) = runs
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logits, b.logits):  # each sequence's [steps, vocab]
        assert (x[0] - y[0]).abs().max().item() < 1e-3
        assert (x - y).abs().max().item() < 3e-2
    assert ra["kv_selected_fraction"] == rb["kv_selected_fraction"] < 0.5
