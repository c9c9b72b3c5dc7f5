"""Each KV cache on its own, driven through the tensors-only interface the engine uses
(``store_prompt``, ``speculate``, ``load``, ``attend``, ``store_token``) and checked against
plain attention over every key; and the policy registry every command reads."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from flexgen_infinigen.kv import POLICIES, FullPolicy, H2OPolicy, InfiniGenPolicy, OraclePolicy
from flexgen_infinigen.kv.base import CacheSpec
from flexgen_infinigen.kv import InfiniGenOptions, SelectionOptions
from flexgen_infinigen.kernels.attention import attend, mask_bias, visible
from flexgen_infinigen.memory.codes import compress, decompress
from flexgen_infinigen.memory.tiers import Tiers

B, KV, H, D, PROMPT, STEPS = 2, 2, 4, 64, 12, 4
PAD = 3  # left padding of the second sequence
DTYPE = torch.float32
PLACEMENTS = {"device": (1.0, 0.0, 0.0), "host": (0.0, 1.0, 0.0), "split": (0.5, 0.5, 0.0),
              "disk": (0.0, 0.5, 0.5)}


@pytest.fixture
def tiers(tmp_path):
    t = Tiers(torch.device("cpu"), str(tmp_path))
    yield t
    t.close()


def _spec(tiers, fractions=(1.0, 0.0, 0.0), compress=False, window=0, layer=3,
          values_are_keys=False) -> CacheSpec:
    return CacheSpec(tiers, layer, 0, B, PROMPT + STEPS, KV, D, DTYPE, fractions, compress,
                     False, window, values_are_keys)


def _tensors(seed: int = 0, values_are_keys=False):
    """Prompt q/k/v, the decode steps' q/k/v and the validity of every position (``v`` is
    ``k`` itself with ``values_are_keys``, as MLA hands its latent rows)."""
    g = torch.Generator().manual_seed(seed)
    n = PROMPT + STEPS
    q = torch.randn(B, n, H, D, generator=g)
    k = torch.randn(B, n, KV, D, generator=g) * 2  # peaked attention: selection matters
    v = k if values_are_keys else torch.randn(B, n, KV, D, generator=g)
    valid = torch.ones(B, n, dtype=torch.bool)
    valid[1, :PAD] = False
    return q, k, v, valid


def _drive(cache, window=0, seed=0, speculate=False, stored=lambda x: x, same=False):
    """Prompt then ``STEPS`` decode steps; returns the cache's attention outputs and the
    reference: plain attention of each new token over every key it may see (the cached ones
    as ``stored`` keeps them, the new token's as computed); ``same``: the values are the keys
    (two copies of them unless the cache keeps one)."""
    q, k, v, valid = _tensors(seed, same or cache.spec.values_are_keys)
    cache.store_prompt(q[:, :PROMPT], k[:, :PROMPT], v[:, :PROMPT], valid[:, :PROMPT])
    got, want = [], []
    for t in range(PROMPT, PROMPT + STEPS):
        now = valid[:, :t + 1]
        sees, bias = visible(now, window), mask_bias(now, 1, DTYPE, window)
        qt, kt, vt = q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]
        if speculate:  # the exact rehearsal below takes the query itself as its input
            cache.speculate(qt.reshape(B, 1, H * D), None, now, sees)
        got.append(cache.attend(cache.load(t), qt, kt, vt, sees, bias))
        cache.store_token(kt, vt, t)
        keys = torch.cat([stored(k[:, :t]), kt], dim=1)
        values = torch.cat([stored(v[:, :t]), vt], dim=1)
        want.append(attend(qt, keys, values, bias))
    return got, want


def _close(got, want, tol=1e-5):
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < tol


@pytest.mark.parametrize("where", list(PLACEMENTS))
def test_full_cache_equals_attention_over_every_key(tiers, where):
    cache = FullPolicy().make_cache(_spec(tiers, PLACEMENTS[where]))
    # a cache the compute device addresses moves nothing: on the device, or (this CPU) in
    # host memory; split or on disk it is copied
    assert cache.inline == (where in ("device", "host"))
    _close(*_drive(cache))
    if where == "host":  # the copying path, as over a GPU's link
        tiers.host_in_place = False
        cache = FullPolicy().make_cache(_spec(tiers, PLACEMENTS[where]))
        assert not cache.inline
        _close(*_drive(cache))


def test_full_cache_sliding_window_and_compression(tiers):
    windowed, _ = _drive(FullPolicy().make_cache(_spec(tiers, window=5)), window=5)
    _close(windowed, _drive(FullPolicy().make_cache(_spec(tiers, window=5)), window=5)[1])
    with pytest.raises(AssertionError):  # the window really hides keys
        _close(windowed, _drive(FullPolicy().make_cache(_spec(tiers)))[1])
    def four_bit(x):  # what a compressed cache holds: 4-bit groups along head_dim
        return decompress(compress(x))

    cache = FullPolicy().make_cache(_spec(tiers, (0.0, 1.0, 0.0), compress=True))
    _close(*_drive(cache, stored=four_bit))
    exact = _drive(FullPolicy().make_cache(_spec(tiers, (0.0, 1.0, 0.0), compress=True)))
    with pytest.raises(AssertionError):  # and the compression is really there
        _close(*exact)


@pytest.mark.parametrize("where", ["device", "host"])
def test_h2o_full_budget_is_exact_and_small_budget_keeps_its_share(tiers, where):
    policy = H2OPolicy(0.5, 0.5)
    _close(*_drive(policy.make_cache(_spec(tiers, PLACEMENTS[where]))))
    small = H2OPolicy(0.25, 0.25)
    cache = small.make_cache(_spec(tiers, PLACEMENTS[where]))
    _drive(cache)
    n_valid = torch.tensor([PROMPT + STEPS, PROMPT + STEPS - PAD]).repeat_interleave(KV)
    # after the last step each KV head column keeps ceil(0.5 x its context) tokens
    assert cache.alive.sum(-1).tolist() == [math.ceil(n * 0.5) for n in n_valid.tolist()]
    report = small.report()
    assert 0.4 < report["kv_fetch_fraction"] < 0.65


def test_oracle_keeping_everything_is_exact_and_reads_the_whole_cache(tiers):
    policy = OraclePolicy(SelectionOptions(alpha=math.inf, max_kv_fraction=1.0, first_layer=1))
    policy.options = policy.options.with_defaults("opt", policy.default_rule)
    _close(*_drive(policy.make_cache(_spec(tiers, (0.0, 1.0, 0.0)))))
    report = policy.report()
    cached = [2 * t for t in range(PROMPT, PROMPT + STEPS)]  # per KV head, both sequences
    used = [2 * t - PAD for t in range(PROMPT, PROMPT + STEPS)]  # all but the padding
    assert report["kv_fetch_fraction"] == 1.0
    assert report["relative_kv_size"] == pytest.approx(sum(used) / sum(cached))


class ExactRehearsal:
    """A rehearsal whose projection is the identity: speculation scores are the exact ones."""

    columns = D

    def meta(self):
        return {"source": "identity (exact scores)"}

    def prompt_projection(self, layer, kv_heads, q, valid):
        return torch.eye(D).expand(q.shape[0], kv_heads, D, D)

    def query_projection(self, projection):  # the query comes out times 1/sqrt(d)
        return projection * D ** -0.5

    def projected_query(self, layer, x, pos_enc, kv_heads, projection):
        qg = x.view(x.shape[0], kv_heads, H // kv_heads, D)
        return torch.einsum("bkgd,bkdr->bkgr", qg, projection)


def _policies():
    """Every policy that keeps a float cache, at a budget that drops rows where it selects."""
    budget = dict(alpha=math.inf, max_kv_fraction=0.3, min_num_kv=4, first_layer=1)
    ig = InfiniGenPolicy(InfiniGenOptions(speculation_keys="partial", partial_weight_ratio=1.0,
                                          **budget))
    ig.options = ig.options.with_defaults("opt", ig.default_rule)
    ig.rehearsal = ExactRehearsal()
    oracle = OraclePolicy(SelectionOptions(**budget))
    oracle.options = oracle.options.with_defaults("opt", oracle.default_rule)
    return {"full": FullPolicy(), "h2o": H2OPolicy(0.25, 0.25), "oracle": oracle,
            "infinigen": ig}


@pytest.mark.parametrize("where", ["device", "host", "split"])
def test_infinigen_with_exact_scores_selects_what_the_oracle_selects(tiers, where):
    """The same rule and budget over exact scores: InfiniGen (speculate, then fetch only the
    chosen rows) must attend exactly as the oracle (score the whole cache, then choose)."""
    policies = _policies()
    ig, oracle = policies["infinigen"], policies["oracle"]
    got, want = _drive(ig.make_cache(_spec(tiers, PLACEMENTS[where])), speculate=True)
    chosen, _ = _drive(oracle.make_cache(_spec(tiers, PLACEMENTS[where])))
    _close(got, chosen)
    with pytest.raises(AssertionError):  # and the budget really dropped keys
        _close(got, want)
    report = ig.report()
    assert report["kv_fetch_fraction"] < 0.5
    assert report["kv_fetch_fraction"] == pytest.approx(report["kv_selected_fraction"])


@pytest.mark.parametrize("name", ["full", "h2o", "oracle", "infinigen"])
@pytest.mark.parametrize("where", ["device", "host", "split", "disk", "4-bit"])
def test_where_the_values_are_the_keys_one_copy_is_kept_and_attends_alike(tiers, name, where):
    """MLA's cache (``values_are_keys``): the same outputs as a cache that keeps the same rows
    as separate keys and values, in half the bytes, and half the bytes moved."""
    fractions = (0.0, 1.0, 0.0) if where == "4-bit" else PLACEMENTS[where]
    outs = {}
    for shared in (False, True):
        before = sum(n for link in tiers.bytes_moved.values() for n in link.values())
        cache = _policies()[name].make_cache(_spec(tiers, fractions, where == "4-bit",
                                                   values_are_keys=shared))
        got, _ = _drive(cache, speculate=name == "infinigen", same=True)
        moved = sum(n for link in tiers.bytes_moved.values() for n in link.values()) - before
        outs[shared] = got, sum(cache.bytes_by_tier().values()), moved
    _close(outs[True][0], outs[False][0], tol=1e-6)
    assert outs[True][1] * 2 == outs[False][1]
    assert outs[True][2] * 2 == outs[False][2]
    assert (outs[True][2] > 0) == (where != "device")


def test_infinigen_load_without_speculation_fails_once_aborted(tiers):
    ig = InfiniGenPolicy(InfiniGenOptions(speculation_keys="partial", first_layer=1))
    ig.rehearsal = ExactRehearsal()
    cache = ig.make_cache(_spec(tiers, (0.0, 1.0, 0.0)))
    assert not cache.inline  # its load waits for the speculation: never run inline
    q, k, v, valid = _tensors()
    cache.store_prompt(q[:, :PROMPT], k[:, :PROMPT], v[:, :PROMPT], valid[:, :PROMPT])
    cache.abort()
    with pytest.raises(RuntimeError, match="stopped by an error"):
        cache.load(PROMPT)


# ---- the registry ---------------------------------------------------------------------------
def test_every_registered_policy_parses_its_own_flags_and_reports_its_name():
    from flexgen_infinigen.kv import kv_policy_from_args
    from flexgen_infinigen.run import build_parser

    for name, cls in POLICIES.items():
        policy = kv_policy_from_args(build_parser().parse_args(["--kv-policy", name]))
        assert type(policy) is cls and policy.report()["kv_policy"] == name
    h2o = kv_policy_from_args(build_parser().parse_args(
        ["--kv-policy", "h2o", "--hh-ratio", "0.3", "--recent-ratio", "0.05"]))
    assert (h2o.hh_ratio, h2o.recent_ratio) == (0.3, 0.05)


@pytest.mark.parametrize("name", [n for n, c in POLICIES.items() if c.plannable])
def test_planned_policies_read_the_fraction_they_are_planned_at(name):
    cfg = SimpleNamespace(num_layers=40)
    policy = POLICIES[name].planned(0.2)
    expected = {"full": 1.0, "h2o": 0.2, "infinigen": (2 + 38 * 0.2) / 40}[name]
    assert policy.fetch_fraction(cfg) == pytest.approx(expected)


class NewestOnlyPolicy(FullPolicy):
    """A toy policy as a newcomer would add one: a class with its own flag, plus one line in
    the registry. It reads the full cache, so it must generate exactly what ``full`` does."""

    name = "toy"
    summary = "the full cache under another name (a test of the registry)"

    def __init__(self, label: str = "x"):
        self.label = label

    @classmethod
    def add_args(cls, parser):
        parser.add_argument("--toy-label", default="x")

    @classmethod
    def from_args(cls, args):
        return cls(args.toy_label)

    def report(self):
        return {"kv_policy": self.name, "label": self.label}


def test_a_new_policy_is_one_class_and_one_registry_line(tiny_opt, monkeypatch):
    from flexgen_infinigen import OffloadedLM, Placement
    from flexgen_infinigen.kv import kv_policy_from_args
    from flexgen_infinigen.run import build_parser

    monkeypatch.setitem(POLICIES, "toy", NewestOnlyPolicy)
    policy = kv_policy_from_args(build_parser().parse_args(
        ["--kv-policy", "toy", "--toy-label", "mine"]))
    outs = []
    for kv in (policy, "full"):
        with OffloadedLM.load(path=tiny_opt[1], policy=Placement(), kv_policy=kv,
                              progress=False) as lm:
            outs.append(lm.generate([[2, 5, 17, 99, 45]], 6, stop_token_id=None).token_ids)
            if kv is policy:
                assert lm.engine.kv_policy.report() == {"kv_policy": "toy", "label": "mine"}
    assert outs[0] == outs[1]


def test_planning_an_unplannable_policy_is_refused_before_profiling(capsys):
    """The oracle runs, but the optimizer does not plan for it: one line saying so, before a
    minute of profiling this machine."""
    from flexgen_infinigen import run

    code = run.main(["--kv-policy", "oracle", "--percent", "auto", "--dummy",
                     "--model", "opt-125m", "--gen-len", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "optimizer does not plan for --kv-policy oracle" in err[0]
