"""KIVI's 4-bit KV cache (``--kv-policy kivi``): its codes against a plain reference of the
layout written here token by token, its attention against attention over those values, and
the tokens of a tiny model against the full cache's when the float window holds everything."""
from __future__ import annotations

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.kv import KiviPolicy
from flexgen_infinigen.kv.base import CacheSpec
from flexgen_infinigen.kernels.attention import attend, mask_bias, visible
from flexgen_infinigen.memory.codes import compress, decompress
from flexgen_infinigen.memory.tiers import Tiers

B, KV, H, D = 2, 2, 4, 64
GROUP, WINDOW, PROMPT, STEPS = 8, 12, 45, 14  # the steps cross two key groups' boundaries


@pytest.fixture
def tiers(tmp_path):
    t = Tiers(torch.device("cpu"), str(tmp_path))
    yield t
    t.close()


def _cache(tiers, group=GROUP, window=WINDOW):
    spec = CacheSpec(tiers, 0, 0, B, PROMPT + STEPS + 1, KV, D, torch.float32, (1.0, 0.0, 0.0),
                     False, False)
    return KiviPolicy(group, window).make_cache(spec)


def _tensors(seed=0):
    """Queries, keys with outlier channels (as real keys have) and values, [b, n, heads, d]."""
    g = torch.Generator().manual_seed(seed)
    n = PROMPT + STEPS
    q = torch.randn(B, n, H, D, generator=g)
    k = torch.randn(B, n, KV, D, generator=g)
    k[..., [3, 17, 40]] = k[..., [3, 17, 40]] * 0.5 + torch.tensor([12.0, -9.0, 15.0])
    v = torch.randn(B, n, KV, D, generator=g)
    return q, k, v


def _round(x, lo, scale):
    """One group's 4-bit round trip, written plainly: float16 minimum and step."""
    lo, step = lo.half().float(), ((x.max() - lo.half().float()) / 15).half().float()
    if step == 0:
        return torch.full_like(x, lo.item())
    return torch.clamp(torch.round((x - lo) / step), 0, 15) * step + lo


def reference(k, v, n, group, window):
    """Rows [n, cols, d] of keys and values as KIVI keeps them after ``n`` tokens: whole
    groups of ``group`` tokens quantized per channel (keys) and per token in ``group``
    channels (values), as long as ``window`` tokens or more stay in float."""
    k, v = k.clone(), v.clone()
    done = max(0, (n - window) // group) * group
    for start in range(0, done, group):
        for c in range(k.shape[1]):
            for ch in range(k.shape[2]):
                x = k[start:start + group, c, ch]
                k[start:start + group, c, ch] = _round(x, x.min(), None)
    for t in range(done):
        for c in range(v.shape[1]):
            for first in range(0, v.shape[2], group):
                x = v[t, c, first:first + group]
                v[t, c, first:first + group] = _round(x, x.min(), None)
    return k[:n], v[:n], done


def _rows(x):  # [b, n, KV, d] -> [n, b*KV, d]
    return x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])


def _batched(x):  # [n, b*KV, d] -> [b, n, KV, d]
    return x.view(x.shape[0], B, KV, D).permute(1, 0, 2, 3)


def test_codes_match_the_reference_after_the_prompt_and_every_step(tiers):
    q, k, v = _tensors()
    cache = _cache(tiers)
    valid = torch.ones(B, PROMPT + STEPS, dtype=torch.bool)
    cache.store_prompt(None, k[:, :PROMPT], v[:, :PROMPT], valid[:, :PROMPT])
    for n in range(PROMPT, PROMPT + STEPS + 1):
        want_k, want_v, done = reference(_rows(k), _rows(v), n, GROUP, WINDOW)
        got_k, got_v = cache.dequantized()
        assert cache.quantized == done and WINDOW <= n - done < WINDOW + GROUP
        assert torch.allclose(got_k, want_k, atol=1e-5) and torch.allclose(got_v, want_v,
                                                                            atol=1e-5)
        if n < PROMPT + STEPS:
            cache.store_token(k[:, n:n + 1], v[:, n:n + 1], n)
    # the round trip is within half a step of each group, and the float rows are exact
    keys = _rows(k)[:done]
    err = (got_k[:done] - keys).abs().view(done // GROUP, GROUP, -1, D)
    step = (keys.view(done // GROUP, GROUP, -1, D).amax(1) -
            keys.view(done // GROUP, GROUP, -1, D).amin(1)) / 15
    assert (err.amax(1) <= step / 2 + 2e-2 * step + 1e-4).all()
    assert torch.equal(got_k[done:], _rows(k)[done:n]) and torch.equal(got_v[done:],
                                                                         _rows(v)[done:n])


def test_per_channel_keys_lose_less_than_per_token_groups_on_outlier_channels(tiers):
    """KIVI's reason to group keys along tokens: a channel that is large for every token
    shares no scale with the others (the runtime's --compress-cache groups 64 channels)."""
    _, k, v = _tensors()
    cache = _cache(tiers, group=32, window=0)
    n = 32
    cache.store_prompt(None, k[:, :n], v[:, :n], None)
    kivi_k, _ = cache.dequantized()
    keys = _rows(k[:, :n])
    runtime_k = decompress(compress(keys)).view_as(keys)
    kivi_err = (kivi_k - keys).pow(2).mean().sqrt()
    runtime_err = (runtime_k - keys).pow(2).mean().sqrt()
    assert kivi_err < runtime_err / 2


def test_attention_reads_the_quantized_rows_and_the_new_token_exactly(tiers):
    q, k, v = _tensors(1)
    cache = _cache(tiers, group=GROUP, window=4)
    valid = torch.ones(B, PROMPT + STEPS, dtype=torch.bool)
    cache.store_prompt(None, k[:, :PROMPT], v[:, :PROMPT], valid[:, :PROMPT])
    for t in range(PROMPT, PROMPT + STEPS):
        now = valid[:, :t + 1]
        bias = mask_bias(now, 1, torch.float32, 0)
        got = cache.attend(cache.load(t), q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                           visible(now, 0), bias)
        want_k, want_v, _ = reference(_rows(k), _rows(v), t, GROUP, 4)
        want = attend(q[:, t:t + 1], torch.cat([_batched(want_k), k[:, t:t + 1]], 1),
                      torch.cat([_batched(want_v), v[:, t:t + 1]], 1), bias)
        assert (got - want).abs().max().item() < 1e-4
        cache.store_token(k[:, t:t + 1], v[:, t:t + 1], t)


PROMPTS = [[2, 5, 17, 99, 45, 8, 200, 31, 7, 300, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
           [2, 40, 41, 42, 43, 44, 45, 46]]


def _generate(store, kv, **options):
    with OffloadedLM.load(path=store, policy=Placement(gpu_batch_size=2), kv_policy=kv,
                          kv_options=options or None, progress=False) as lm:
        out = lm.generate(PROMPTS, 8, stop_token_id=None, keep_logits=True)
        return out, lm.engine.kv_policy.report()


def test_a_window_over_every_token_generates_what_the_full_cache_does(tiny_llama):
    full, _ = _generate(tiny_llama[1], "full")
    kivi, report = _generate(tiny_llama[1], "kivi", group=4, window=32)
    assert kivi.token_ids == full.token_ids
    for a, b in zip(kivi.logits, full.logits):
        assert (a - b).abs().max().item() < 1e-4
    assert report["relative_kv_size"] == pytest.approx(1.0)  # all float16-sized rows
    # without a window most rows are codes: the logits move and the size drops (groups of 4
    # tokens or channels: half a byte a value plus a float16 minimum and scale per 4 values,
    # 1.5 bytes against 2, and the float rows of the last partial group)
    small, report = _generate(tiny_llama[1], "kivi", group=4, window=0)
    assert max((a - b).abs().max().item() for a, b in zip(small.logits, full.logits)) > 1e-4
    assert 0.75 <= report["relative_kv_size"] < 0.8


def test_bad_options_fail_before_loading():
    with pytest.raises(ConfigError, match="--kivi-group"):
        KiviPolicy(group=3)
    with pytest.raises(ConfigError, match="--kivi-window"):
        KiviPolicy(window=-1)
