"""Bytes counted per link and kind equal what the policy must move (derived independently)."""
from __future__ import annotations

import pytest

from flexgen_infinigen import OffloadedLM, Placement

PROMPT = [2, 11, 12, 13, 14, 15, 16]
STEPS = 5


def _expected(model, prompt_len, steps, batch=1):
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())  # tied head counted once
    embed = cfg.vocab_size * cfg.word_embed_proj_dim
    # every token reloads every weight; the tied embedding is read by the input and the head
    weights = 4 * steps * (n_params + embed)
    row = 2 * cfg.num_hidden_layers * batch * cfg.hidden_size * 4  # K and V of one token, fp32
    # decode step i (1..steps-1) reads the prompt plus i-1 generated tokens
    kv_read = row * sum(prompt_len + i - 1 for i in range(1, steps))
    kv_written = row * (prompt_len + steps - 1)
    return weights, kv_read, kv_written


@pytest.mark.parametrize("overlap", [True, False])
def test_host_tier(tiny_opt, overlap):
    """The cache in CPU memory copied every step as over a GPU's link (``host_in_place``
    off, which is how a CPU-only machine exercises that path)."""
    model, store = tiny_opt
    policy = Placement.from_percent([0, 100, 0, 100, 100, 0], overlap=overlap, host_in_place=False)
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        lm.generate([PROMPT], STEPS, stop_token_id=None)
        moved = lm.tiers.bytes_moved
    weights, kv_read, kv_written = _expected(model, len(PROMPT), STEPS)
    assert moved["host->device"]["weights"] == weights
    assert moved["host->device"]["kv_cache"] == kv_read
    assert moved["device->host"]["kv_cache"] == kv_written
    assert moved["disk->host"] == {"weights": 0, "experts": 0, "kv_cache": 0, "activations": 0}
    assert moved["host->disk"] == {"weights": 0, "experts": 0, "kv_cache": 0, "activations": 0}


@pytest.mark.parametrize("kv", ["full", "infinigen", "h2o"])
def test_host_cache_read_in_place_on_a_cpu(tiny_opt, kv):
    """On a CPU the host tier is the compute device's memory: the cache is read where it is
    (no KV bytes cross a link; the new token's row is still written there), with the same
    tokens and logits as the copying path."""
    model, store = tiny_opt
    outs = []
    for in_place in (True, False):
        policy = Placement.from_percent([100, 0, 0, 100, 100, 0], host_in_place=in_place)
        # one query both ways (auto takes own only where the cache is read in place)
        opts = {"speculation_query": "input"} if kv == "infinigen" else None
        with OffloadedLM.load(path=store, policy=policy, kv_policy=kv, kv_options=opts,
                              progress=False) as lm:
            outs.append(lm.generate([PROMPT, PROMPT[:4]], STEPS, stop_token_id=None,
                                    keep_logits=True))
            moved = lm.tiers.bytes_moved
        if in_place:
            assert moved["host->device"]["kv_cache"] == 0
            if kv == "full":
                assert moved["device->host"]["kv_cache"] == sum(  # one block per prompt
                    _expected(model, n, STEPS)[2] for n in (len(PROMPT), 4))
        else:
            assert moved["host->device"]["kv_cache"] > 0
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logits, outs[1].logits):
        assert (a - b).abs().max().item() < 1e-5


def test_disk_tier(tiny_opt):
    model, store = tiny_opt
    policy = Placement.from_percent([0, 0, 0, 0, 100, 0])
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        lm.generate([PROMPT], STEPS, stop_token_id=None)
        moved = lm.tiers.bytes_moved
        assert lm.weight_bytes_by_tier()["disk"] == 4 * sum(p.numel() for p in model.parameters())
    weights, kv_read, kv_written = _expected(model, len(PROMPT), STEPS)
    for link in ("disk->host", "host->device"):
        assert moved[link]["weights"] == weights
        assert moved[link]["kv_cache"] == kv_read
    for link in ("device->host", "host->disk"):
        assert moved[link]["kv_cache"] == kv_written


def test_everything_on_device_moves_nothing(tiny_opt):
    _, store = tiny_opt
    with OffloadedLM.load(path=store, progress=False) as lm:
        lm.generate([PROMPT], STEPS, stop_token_id=None)
        assert all(n == 0 for per in lm.tiers.bytes_moved.values() for n in per.values())


def test_cpu_cache_compute_moves_activations_not_cache(tiny_opt):
    model, store = tiny_opt
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], cpu_cache_compute=True)
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        lm.generate([PROMPT], STEPS, stop_token_id=None)
        moved = lm.tiers.bytes_moved
    cfg = model.config
    h = cfg.hidden_size * 4
    decode_steps = (STEPS - 1) * cfg.num_hidden_layers
    assert moved["host->device"]["kv_cache"] == 0
    assert moved["device->host"]["activations"] == decode_steps * 3 * h  # q, k_new, v_new
    assert moved["host->device"]["activations"] == decode_steps * h  # the attention output


def test_weight_split_follows_percent_finely(tiny_opt):
    """20% and 25% give different splits (FlexGen's whole-tensor rule gives the same)."""
    _, store = tiny_opt
    shares = []
    for pct in (20, 25, 30):
        with OffloadedLM.load(path=store, policy=Placement.from_percent([pct, 100 - pct, 100, 0,
                                                                      100, 0]),
                              progress=False) as lm:
            placed = lm.weight_bytes_by_tier()
            shares.append(placed["device"] / sum(placed.values()))
    for pct, share in zip((20, 25, 30), shares):
        assert abs(share - pct / 100) < 0.01


@pytest.mark.parametrize("batch,batches,prompts,rows", [(4, 1, 1, 1), (2, 2, 1, 1),
                                                         (2, 2, 3, 4), (3, 2, 4, 4)])
def test_a_short_block_runs_only_the_rows_it_needs(tiny_opt, batch, batches, prompts, rows):
    """Fewer prompts than a block (a short run, or the last block) run in as few equal GPU
    batches as hold them: the KV cache moved is that many rows' (``rows``: the prompts plus
    at most one dummy a GPU batch), not the policy's whole block, and every prompt's tokens
    are its own run's."""
    model, store = tiny_opt
    ids = [[2, 11 + i, 12, 13 + 2 * i, 14, 15, 16] for i in range(prompts)]
    policy = Placement.from_percent([0, 100, 0, 100, 100, 0], gpu_batch_size=batch,
                                 num_gpu_batches=batches, host_in_place=False)
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        out = lm.generate(ids, STEPS, stop_token_id=None)
        moved = lm.tiers.bytes_moved
    weights, kv_read, kv_written = _expected(model, len(PROMPT), STEPS, batch=rows)
    assert moved["host->device"]["kv_cache"] == kv_read
    assert moved["device->host"]["kv_cache"] == kv_written
    alone = Placement.from_percent([0, 100, 0, 100, 100, 0], host_in_place=False)
    with OffloadedLM.load(path=store, policy=alone, progress=False) as lm:
        assert out.token_ids == [lm.generate([p], STEPS, stop_token_id=None).token_ids[0]
                                 for p in ids]
