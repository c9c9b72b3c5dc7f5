"""Attention computed in chunks of query rows equals the one-shot computation."""
from __future__ import annotations

import torch

from flexgen_infinigen.kernels import attention
from flexgen_infinigen.kernels.attention import attend, mask_bias


def _inputs(b=2, s=37, heads=6, kv=2, d=16, hole=False):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, s, heads, d, generator=gen)
    k = torch.randn(b, s, kv, d, generator=gen)
    v = torch.randn(b, s, kv, d, generator=gen)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :5] = False  # a left-padded row
    if hole:
        valid[0, 9:12] = False  # masked keys after real ones: not left padding alone
    return q, k, v, mask_bias(valid, s, torch.float32)


def test_chunked_equals_whole_with_key_mass(monkeypatch):
    q, k, v, bias = _inputs()
    whole, whole_mass = attend(q, k, v, bias, return_key_mass=True)
    # independent reference: plain softmax attention with heads repeated per group
    group = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bshd,bthd->bhst", q, kr) / q.shape[-1] ** 0.5 + bias
    probs = scores.softmax(-1)
    ref = torch.einsum("bhst,bthd->bshd", probs, vr).reshape(whole.shape)
    assert (whole - ref).abs().max() < 1e-5
    ref_mass = probs.view(2, 2, group, 37, 37).sum((2, 3))
    assert (whole_mass - ref_mass).abs().max() < 1e-4
    monkeypatch.setattr(attention, "SCORE_CHUNK_BYTES", 4 * 2 * 6 * 37 * 5)  # 5 rows a chunk
    assert attention.score_rows(2, 6, 37) == 5
    chunked, chunked_mass = attend(q, k, v, bias, return_key_mass=True)
    assert (chunked - whole).abs().max() < 1e-6
    assert (chunked_mass - whole_mass).abs().max() < 1e-5


def test_masked_gqa_prompt_chunks_with_k_v_repeated_once_equal_the_broadcast(monkeypatch):
    """Masked prompts of a GQA model (keys masked after real ones): the masked chunks attend
    over K and V repeated once per layer (what CUDA does, so that a fused kernel takes them)
    and give what the GQA broadcast and an independent softmax reference give."""
    from flexgen_infinigen.kernels.attention import attend_prompt

    q, k, v, bias = _inputs(s=45, hole=True)
    valid = bias[:, 0, -1] == 0  # the last query sees every real key
    group = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bshd,bthd->bhst", q, kr) / q.shape[-1] ** 0.5 + bias
    ref = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), vr)
    ref = ref * valid[:, :, None, None]  # padding queries give zeros
    calls = []
    real = attention._sdpa
    monkeypatch.setattr(attention, "_sdpa", lambda q, k, v, *a, **kw: calls.append(
        k.shape[1]) or real(q, k, v, *a, **kw))
    broadcast = attend_prompt(q, k, v, valid, rows=8)
    assert set(calls) == {k.shape[2]}  # KV heads: broadcast
    calls.clear()
    monkeypatch.setattr(attention, "EXPAND_GQA_ON", ("cpu", "cuda"))
    expanded = attend_prompt(q, k, v, valid, rows=8)
    assert set(calls) == {q.shape[2]} and len(calls) == 6  # every chunk, query heads
    assert (expanded - broadcast).abs().max() < 1e-5
    assert (expanded - ref.reshape(expanded.shape)).abs().max() < 1e-5


def test_a_left_padded_prompt_attends_as_it_does_alone():
    """Left-padded rows take the causal call of their real tokens: each row's output, to the
    last bit, is the output of its prompt alone with no padding (what keeps a request's
    answer at temperature 0 independent of the rows beside it), and padding rows are zero."""
    from flexgen_infinigen.kernels.attention import attend_prompt

    gen = torch.Generator().manual_seed(1)
    b, s, heads, kv, d = 4, 70, 6, 2, 32
    q, k, v = (torch.randn(b, s, n, d, generator=gen) for n in (heads, kv, kv))
    pads = [0, 3, 41, s]  # the last row is padding only
    valid = torch.arange(s)[None, :] >= torch.tensor(pads)[:, None]
    out = attend_prompt(q, k, v, valid).view(b, s, heads, d)
    for r, pad in enumerate(pads):
        assert not out[r, :pad].any()
        if pad < s:
            alone = attend_prompt(q[r:r + 1, pad:], k[r:r + 1, pad:], v[r:r + 1, pad:],
                                  valid[r:r + 1, pad:])
            assert torch.equal(out[r, pad:].reshape(1, s - pad, -1), alone), r
