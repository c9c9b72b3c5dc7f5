"""Chunked prefill: a prompt goes through each layer in chunks (attention by query rows with
per-chunk masks and only the keys a chunk may see, the MLP by tokens), and gives what one
pass gives: the same tokens, logits to rounding, and the same cache contents (K/V, InfiniGen's
speculation keys, H2O's accumulated scores and survivors), with padding and GQA."""
from __future__ import annotations

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.kernels.attention import attend, attend_prompt, mask_bias, prompt_key_mass

PROMPTS = [[1, 5, 17, 99, 45, 8, 200, 31, 7, 300, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 3, 9],
           [1, 40, 41, 42, 43, 44, 45, 46, 400, 2, 77]]
STEPS = 6


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("prefix", [0, 5])
def test_attend_prompt_equals_one_masked_pass(window, prefix):
    torch.manual_seed(0)
    b, s, heads, kv, d = 3, 13, 6, 2, 8
    t = prefix + s
    q, k, v = torch.randn(b, s, heads, d), torch.randn(b, t, kv, d), torch.randn(b, t, kv, d)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[0, :4] = False  # left padding
    valid[2, :prefix + 2] = False
    real = valid[:, prefix:]
    ref_out = attend(q, k, v, mask_bias(valid, s, q.dtype, window))
    whole = attend_prompt(q, k, v, valid, window, rows=s), prompt_key_mass(q, k, valid, window, s)
    for rows in (1, 3, 5, s):
        out = attend_prompt(q, k, v, valid, window, rows=rows)
        mass = prompt_key_mass(q, k, valid, window, rows=rows)
        # real query rows equal the masked reference; padding rows are zero, add no mass
        assert torch.allclose(out * real[..., None], ref_out * real[..., None], atol=1e-6)
        assert torch.allclose(out, whole[0], atol=1e-6)
        assert torch.allclose(mass, whole[1], atol=1e-5)
        assert (out[~real] == 0).all()
    # the key mass is the real queries' only, each with its own one-row mask
    assert torch.allclose(whole[1], _real_query_mass(q, k, v, valid, window, prefix), atol=1e-5)


@pytest.mark.parametrize("b,heads,kv,d", [(1, 6, 2, 8), (2, 4, 4, 64)])
def test_key_mass_of_an_unpadded_prompt(b, heads, kv, d):
    """No padding, prefix or window: the fused path, against the same sums by hand."""
    torch.manual_seed(1)
    s = 37
    q, k = torch.randn(b, s, heads, d) * 2, torch.randn(b, s, kv, d) * 2
    valid = torch.ones(b, s, dtype=torch.bool)
    mass = prompt_key_mass(q, k, valid, 0)
    expected = _real_query_mass(q, k, None, valid, 0, 0)
    assert torch.allclose(mass, expected, rtol=1e-5, atol=1e-6)
    # every query hands out one unit a head: the masses sum to heads x queries
    assert torch.allclose(mass.sum((1, 2)), torch.full((b,), float(heads * s)), rtol=1e-6)


def _real_query_mass(q, k, v, valid, window, prefix):
    """Key mass of the real queries only, one query row and head at a time, by hand."""
    b, s, heads, d = q.shape
    kv = k.shape[2]
    mass = torch.zeros(b, kv, k.shape[1])
    for n in range(b):
        for i in range(s):
            if not valid[n, prefix + i]:
                continue
            seen = [j for j in range(prefix + i + 1)
                    if valid[n, j] and (not window or prefix + i - j < window)]
            for h in range(heads):
                g = h // (heads // kv)
                p = torch.softmax(k[n, seen, g] @ q[n, i, h] / d ** 0.5, 0)
                mass[n, g, seen] += p
    return mass


def _snapshot(cache, length: int) -> dict:
    """What a cache holds for the prompt's ``length`` positions, as plain tensors."""
    snap = {"k": cache.k.read(slice(0, length), to="device").clone(),
            "v": cache.v.read(slice(0, length), to="device").clone()}
    keys = getattr(cache, "keys", None)
    if keys is not None:
        snap["spec_keys"] = keys.keys(length).clone()
    for name in ("score", "alive"):
        if hasattr(cache, name):
            snap[name] = getattr(cache, name)[:, :length].clone()
    return snap


def _run(store, kv, chunk, **kw):
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=2,
                                 prefill_chunk=chunk)
    with OffloadedLM.load(path=store, policy=policy, kv_policy=kv, kv_options=kw or None,
                          progress=False) as lm:
        blocks = lm.engine.generate_block
        snaps = {}

        def spy(*args, **kwargs):  # the caches as the prefill left them
            gen = blocks(*args, **kwargs)
            first = next(gen)
            length = max(map(len, PROMPTS))
            snaps.update({key: _snapshot(c, length) for key, c in lm.engine.caches.items()})
            yield first
            yield from gen

        lm.engine.generate_block = spy
        out = lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)
        return out, snaps, lm.engine.kv_policy.report()


@pytest.mark.parametrize("kv,kw", [("full", {}),
                                   ("infinigen", {"max_kv_fraction": 0.3, "min_num_kv": 4}),
                                   ("h2o", {"hh_ratio": 0.3, "recent_ratio": 0.2})])
def test_chunked_prefill_equals_one_pass(tiny_llama, kv, kw):
    one, one_caches, one_report = _run(tiny_llama[1], kv, None, **kw)
    for chunk in (1, 4):
        out, caches, report = _run(tiny_llama[1], kv, chunk, **kw)
        assert out.token_ids == one.token_ids
        for a, b in zip(out.logits, one.logits):
            assert (a - b).abs().max().item() < 1e-4
        assert caches.keys() == one_caches.keys()
        for key, snap in caches.items():
            for name, x in snap.items():
                ref = one_caches[key][name]
                if x.dtype == torch.bool:
                    assert torch.equal(x, ref), (kv, key, name)
                else:
                    assert torch.allclose(x.float(), ref.float(), atol=1e-4), (kv, key, name)
        if kv != "full":
            assert report["kv_fetch_fraction"] == pytest.approx(one_report["kv_fetch_fraction"])


def test_prefill_chunk_flag_is_checked(capsys):
    from flexgen_infinigen import run

    assert run.main(["--model", "smollm2-135m", "--dummy", "--prompt-len", "8",
                     "--prefill-chunk", "0"]) == 2
    assert "--prefill-chunk must be at least 1" in capsys.readouterr().err


def test_plan_holds_nothing_prompt_by_prompt():
    """The device working set grows linearly with the prompt: doubling a 16K prompt adds
    about as much as the first 16K did (a [q, k] mask would quadruple)."""
    from flexgen_infinigen.config import get_config
    from flexgen_infinigen.engine import memory_plan

    cfg, policy = get_config("qwen2.5-7b"), Placement()
    work = [memory_plan.plan(cfg, policy, torch.float32, p, 1)["working_set_device"]
            for p in (8192, 16384, 32768)]
    assert work[2] - work[1] < 2.2 * (work[1] - work[0])
