"""Prefix pages (flexgen_infinigen.engine.prefix_pages) and a block that starts from them
(engine.prefix_reuse): a prefill that skips the columns the pages hold gives the logits and
tokens of the prefill that computes them (the independent reference: the same model with no
pages), for the full cache and InfiniGen, at batch 1 and with rows of other lengths beside;
the pages go to disk and back bit for bit, a restart finds them, and a damaged, cut or
foreign file is a miss."""
from __future__ import annotations

from contextlib import closing

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.engine.prefix_pages import SUFFIX, PrefixPages
from flexgen_infinigen.engine.prefix_reuse import block_prefix, keep_rows, usable
from flexgen_infinigen.kv import make_kv_policy

PAGE = 8
HISTORY = [1, *range(20, 61)]  # 42 tokens: five whole pages and two tokens
STEPS = 5


def _greedy(logits, step, batch):
    return logits.argmax(-1)


def _block(lm, prompts, pages=None):
    """(tokens per row, logits per step [rows, vocab], the prefix used) of one block of
    ``prompts``; with ``pages`` it starts from them and keeps its rows in them."""
    size, _ = lm._block_shape(len(prompts))
    batches = lm._pad_batches(prompts, size)
    prefix = block_prefix(pages, lm.engine, prompts, batches) if pages is not None else None
    rows, logits = [[] for _ in prompts], []

    def keep():  # every row's prompt and the tokens fed back (all but the last step's)
        width = max(map(len, prompts))
        keep_rows(pages, lm.engine, [(width - len(p), p + r[:STEPS - 1])
                                     for p, r in zip(prompts, rows)])

    with closing(lm.engine.generate_block(batches, STEPS, _greedy, keep_logits=True,
                                          prefix=prefix,
                                          at_end=keep if pages is not None else None)) as steps:
        for step in steps:
            logits.append(torch.cat(step.logits))
            for row, t in zip(rows, torch.cat(step.tokens).tolist()):
                row.append(t)
    return rows, logits, prefix


def _pages(lm, **kw) -> PrefixPages:
    from flexgen_infinigen.engine.prefill_cache import model_key
    return PrefixPages(model_key(lm), PAGE, **kw)


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory):
    """A tiny DeepSeek-V3 (MLA: its pages keep the latent rows once, as its cache does)."""
    from test_mla import _store

    return _store(tmp_path_factory.mktemp("mla"), q_lora_rank=24, vocab_size=512)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_opt", "tiny_mla"])
@pytest.mark.parametrize("kv", [("full", {}), ("infinigen", {"max_kv_fraction": 0.3,
                                                             "min_num_kv": 4})])
def test_a_chats_next_turn_prefills_only_its_new_tokens(family, kv, request):
    _, store = request.getfixturevalue(family)
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=3)
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        lm.use_kv_policy(make_kv_policy(kv[0], **kv[1]))
        assert usable(lm.engine)
        pages = _pages(lm)
        first, _, none = _block(lm, [HISTORY], pages)
        assert none is None and pages.memory  # the turn and its answer are kept
        one_copy = lm.cfg.values_are_keys  # MLA: the values are the keys, kept once
        assert all((page.v is None) == one_copy for page in pages.memory.values())
        # the next turn: the history, the answer as fed back, new tokens; a stranger beside
        turn = HISTORY + first[0][:STEPS - 1] + [7, 8, 9]
        short, other = [1, 300, 301, 302], [1, *range(400, 429)]
        for beside, known in ((short, 40), (other, len(turn) - len(other))):
            # the turn holds the history's five pages (its sixth was never whole); a row
            # beside without pages lets skip only its left padding
            ref_rows, ref_logits, _ = _block(lm, [turn, beside])
            rows, logits, prefix = _block(lm, [turn, beside], pages)
            assert prefix is not None and prefix.length == known
            assert rows == ref_rows
            for ours, ref in zip(logits, ref_logits):
                torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_policies_that_read_the_prompts_queries_prefill_everything(tiny_llama):
    _, store = tiny_llama
    with OffloadedLM.load(path=store, policy=Placement(), progress=False) as lm:
        lm.use_kv_policy(make_kv_policy("h2o", hh_ratio=0.2, recent_ratio=0.2))
        assert not usable(lm.engine)


def _page(layers=2, kv=2, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, PAGE * 3, kv, d, generator=g), \
        torch.randn(layers, PAGE * 3, kv, d, generator=g)


def test_pages_are_named_by_their_whole_prefix():
    pages = PrefixPages("model", PAGE)
    a, b = list(range(30)), list(range(8)) + [99] + list(range(9, 30))
    assert len(pages.names(a)) == 3 and pages.names(a)[0] == pages.names(b)[0]
    assert pages.names(a)[1:] != pages.names(b)[1:]  # diverged in page 2: all after differ
    assert PrefixPages("other", PAGE).names(a)[0] != pages.names(a)[0]
    k, v = _page()
    assert pages.add(a[:24], k, v) == 3
    assert pages.longest(a) == 24 and pages.longest(b) == 8 and pages.longest(a, 23) == 16
    got = pages.gather(a, 16)
    assert torch.equal(got[0], k[:, :16]) and torch.equal(got[1], v[:, :16])
    assert pages.add(a[:24], k, v) == 0  # held already


def test_memory_spills_to_disk_and_comes_back_bit_for_bit(tmp_path):
    k, v = _page()
    one = k[:, :PAGE].nbytes * 2
    pages = PrefixPages("model", PAGE, memory_bytes=one, folder=tmp_path, disk_bytes=2 * 4096)
    ids = list(range(24))
    pages.add(ids, k, v)
    assert len(pages.memory) == 1 and len(pages.disk) >= 1  # the oldest went to disk
    held = pages.longest(ids)
    got = pages.gather(ids, held)
    assert held == 24 and torch.equal(got[0], k) and torch.equal(got[1], v)
    pages.close()
    assert not tmp_path.exists() or not list(tmp_path.glob(f"*{SUFFIX}"))


def test_pages_whose_values_are_the_keys_keep_one_tensor(tmp_path):
    """MLA's pages: the keys alone, in memory and in their files; read back as both."""
    k, _ = _page()
    ids = list(range(24))
    first = PrefixPages("model", PAGE, memory_bytes=1 << 20, folder=tmp_path, disk_bytes=1 << 20,
                        persistent=True)
    assert first.add(ids, k, None) == 3 and first.in_memory == k.nbytes
    later = PrefixPages("model", PAGE, folder=tmp_path, disk_bytes=1 << 20, persistent=True)
    got = later.gather(ids, later.longest(ids))
    assert torch.equal(got[0], k) and got[1] is got[0]


def test_a_restart_finds_the_pages_and_a_bad_file_is_a_miss(tmp_path):
    k, v = _page()
    ids = list(range(24))
    first = PrefixPages("model", PAGE, memory_bytes=1 << 20, folder=tmp_path,
                        disk_bytes=1 << 20, persistent=True)
    first.add(ids, k, v)
    first.close()
    files = sorted(tmp_path.glob(f"*{SUFFIX}"))
    assert len(files) == 3
    later = PrefixPages("model", PAGE, memory_bytes=1 << 20, folder=tmp_path,
                        disk_bytes=1 << 20, persistent=True)
    assert later.longest(ids) == 24
    got = later.gather(ids, 24)
    assert torch.equal(got[0], k) and torch.equal(got[1], v)

    # page 1 with one byte flipped, page 3 cut short: each a miss when read, and removed
    name = later.names(ids)
    first_file, third = (tmp_path / f"{name[i]}{SUFFIX}" for i in (0, 2))
    data = bytearray(first_file.read_bytes())
    data[-100] ^= 1
    first_file.write_bytes(bytes(data))
    third.write_bytes(third.read_bytes()[:-10])
    again = PrefixPages("model", PAGE, memory_bytes=1 << 20, folder=tmp_path,
                        disk_bytes=1 << 20, persistent=True)
    assert again.longest(ids) == 24  # the names are there; reading them finds the damage
    assert again.gather(ids, 8) is None and not first_file.exists()
    assert again._get(name[2], ids[16:24]) is None and not third.exists()
    assert again._get(name[1], ids[8:16]) is not None  # the whole one still reads

    # another model's page under this model's name is never its own
    other = PrefixPages("another", PAGE, memory_bytes=1 << 20, folder=tmp_path / "o",
                        disk_bytes=1 << 20, persistent=True)
    other.add(ids, k, v)
    ours = PrefixPages("model", PAGE, folder=tmp_path / "o", disk_bytes=1 << 20,
                       persistent=True)
    theirs = tmp_path / "o" / f"{other.names(ids)[0]}{SUFFIX}"
    theirs.rename(tmp_path / "o" / f"{name[0]}{SUFFIX}")
    ours = PrefixPages("model", PAGE, folder=tmp_path / "o", disk_bytes=1 << 20,
                       persistent=True)
    assert ours.longest(ids[:8]) == 8 and ours.gather(ids, 8) is None


def test_the_servers_defaults_leave_room_for_chats():
    """A server given no sizes answers several requests at once and keeps a chat's history:
    its blocks have SERVE_ROWS rows (a run's batch is one prompt), and its pages take a
    quarter of the free memory up to PREFIX_CACHE_GB, unless --prefix-cache-gb says."""
    from flexgen_infinigen.cli.args import policy_from_args
    from flexgen_infinigen.serve import (PREFIX_CACHE_GB, SERVE_ROWS, build_parser,
                                         prefix_cache_bytes)

    a = build_parser().parse_args([])
    policy, _ = policy_from_args(a)
    assert SERVE_ROWS > 1 and (policy.gpu_batch_size, policy.num_gpu_batches) == (SERVE_ROWS, 1)
    assert build_parser().parse_args(["--gpu-batch-size", "2"]).gpu_batch_size == 2
    assert a.prefix_cache_gb is None
    assert prefix_cache_bytes(None, 100e9) == int(PREFIX_CACHE_GB * 1e9)
    assert prefix_cache_bytes(None, 4e9) == int(1e9)
    assert prefix_cache_bytes(2.5, 100e9) == int(2.5e9)
    assert prefix_cache_bytes(0.0, 100e9) == 0
