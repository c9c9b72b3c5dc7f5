"""InfiniGen's chosen rows reach the compute device without a host round trip: with the KV
cache in host memory that the device maps (on a CPU: ``--host-in-place false``, standing in
for a GPU's pinned host memory), the row load is issued right after speculation ranked the
rows, with no host wait in between, and gives what the host gather gives."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.kv import InfiniGenOptions
from flexgen_infinigen.memory import mapped_rows
from flexgen_infinigen.memory.tiers import Tiers

PROMPTS = [[2, 5, 17, 99, 45, 8, 200, 31, 7, 300, 12, 13, 14, 15, 16, 17] * 2,
           [2, 40, 41, 42, 43, 44, 9, 8, 7, 6] * 2]
STEPS = 6
OPTIONS = {"options": InfiniGenOptions(max_kv_fraction=0.3, min_num_kv=4, first_layer=1,
                                       select_from_mb=0.0)}


def _run(store, kv="infinigen", overlap=True):
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], host_in_place=False, overlap=overlap,
                                 gpu_batch_size=2)
    with OffloadedLM.load(path=store, policy=policy, kv_policy=kv,
                          kv_options=OPTIONS if kv == "infinigen" else None,
                          progress=False) as lm:
        out = lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)
        return out, list(lm.engine.debug["host_syncs_per_step"]), lm.tiers.bytes_moved


@pytest.mark.parametrize("overlap", [True, False])
def test_no_host_wait_between_speculation_and_the_row_load(tiny_llama, monkeypatch, overlap):
    """A deliberately slow host path (every host read of device values, and every wait for
    one, sleeps) is never taken in a decode step: each selecting layer's row load is issued
    on the thread that speculated, right after its ranking, and a decode step synchronizes
    the host exactly as often as the full cache's."""
    events, lock = [], threading.Lock()

    def log(*what):
        with lock:
            events.append((threading.get_ident(), *what))

    def slow(fn, name):
        def wrapped(self, *args, **kwargs):
            time.sleep(0.02)
            log(name)
            return fn(self, *args, **kwargs)
        return wrapped

    for name in ("host_values_async", "count_sync", "take_to_compute", "gather_to_compute"):
        monkeypatch.setattr(Tiers, name, slow(getattr(Tiers, name), f"host:{name}"))
    real_gather = Tiers.gather_mapped

    def gather(self, *args, **kwargs):
        log("row load")
        return real_gather(self, *args, **kwargs)
    monkeypatch.setattr(Tiers, "gather_mapped", gather)
    from flexgen_infinigen.kv.infinigen import cache as infinigen_cache
    real_rank = infinigen_cache.InfiniGenCache._rank

    def rank(self, *args, **kwargs):
        out = real_rank(self, *args, **kwargs)
        log("speculation", self.spec.layer)
        return out
    monkeypatch.setattr(infinigen_cache.InfiniGenCache, "_rank", rank)

    out, syncs, _ = _run(tiny_llama[1], overlap=overlap)
    speculations = [i for i, e in enumerate(events) if e[1] == "speculation"]
    assert speculations, "nothing was selected"
    for i in speculations:
        nxt = [e for e in events[i + 1:] if e[0] == events[i][0]]
        # the next thing that thread does to the tiers: the two row reads (K, V), no host wait
        assert [e[1] for e in nxt[:2]] == ["row load", "row load"], nxt[:3]
    first = speculations[0]
    waits = [e for e in events[first:] if e[1] in ("host:host_values_async",
                                                   "host:take_to_compute",
                                                   "host:gather_to_compute")]
    assert not waits
    monkeypatch.undo()
    _, full_syncs, _ = _run(tiny_llama[1], kv="full", overlap=overlap)
    assert syncs[1:] == full_syncs[1:]


def test_the_device_read_equals_the_host_gather(tiny_llama, monkeypatch):
    """Tokens, logits and bytes over the link are those of the host gather (the fallback)."""
    mapped, _, moved = _run(tiny_llama[1])
    monkeypatch.setenv(mapped_rows.ENV, "0")
    host, _, host_moved = _run(tiny_llama[1])
    assert mapped.token_ids == host.token_ids
    for a, b in zip(mapped.logits, host.logits):
        assert torch.equal(a, b)
    assert moved["host->device"]["kv_cache"] == host_moved["host->device"]["kv_cache"]


def test_mapped_gather_reads_the_indexed_rows():
    src = torch.randn(50, 8)
    index = torch.tensor([3, 7, 0, 49, 12, 12])
    out = torch.empty(6, 8)
    mapped_rows.gather(src, index, torch.tensor([3, 3]), 2, out)
    assert torch.equal(out, src[index])
