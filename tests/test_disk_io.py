"""The disk tier's reads and writes: large requests through a file descriptor, O_DIRECT for
the aligned part where the filesystem allows it, the rest buffered; byte-exact against the
data written, whatever the alignment; one clear error naming the file on a short read; and
a whole run with weights and KV cache on disk equal to the run that keeps them in memory."""
from __future__ import annotations

import os

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.memory import disk_io
from flexgen_infinigen.memory.disk_io import OffloadIOError
from flexgen_infinigen.memory.tiers import DEVICE, DISK, HOST, Tiers


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def tiers(request, tmp_path):
    t = Tiers(torch.device("cpu"), str(tmp_path), direct_io=request.param)
    yield t
    t.close()


def _direct_possible(t: Tiers, disk: torch.Tensor) -> bool:
    return t.disk.locate(disk)[0].direct_fd is not None


def test_reads_equal_what_was_written_at_any_alignment(tiers, monkeypatch):
    monkeypatch.setattr(disk_io, "REQUEST_BYTES", 8192)  # many requests in flight
    n = 50_001  # not a whole number of blocks
    data = torch.randn(n)
    disk = tiers.empty(DISK, (n,), torch.float32)
    tiers.write(disk, DISK, data, "weights", src_tier=HOST)
    assert torch.equal(tiers.to_compute(disk, DISK, "weights"), data)  # aligned buffer
    for lo, hi in [(0, 1024), (1, 4097), (1000, 40_000), (n - 7, n)]:  # odd offsets
        assert torch.equal(tiers.to_host(disk[lo:hi], DISK, "weights"), data[lo:hi])
        out = torch.empty(hi - lo + 1)[1:]  # a destination that is not block aligned
        tiers.write(out, HOST, disk[lo:hi], "weights", src_tier=DISK)
        assert torch.equal(out, data[lo:hi])
    direct = tiers.disk.direct_bytes
    if tiers.disk.direct and _direct_possible(tiers, disk):
        assert direct >= 4 * (n * 4 // 4096 - 2) * 1024  # the aligned bulk went direct
    else:
        assert direct == 0


def test_rows_written_one_at_a_time_are_read_back(tiers):
    """The KV cache's pattern: a prompt's rows, then one row per step, then a range read."""
    rows = torch.randn(37, 3, 64, dtype=torch.bfloat16)
    disk = tiers.empty(DISK, (40, 3, 64), torch.bfloat16)
    tiers.write(disk[0:30], DISK, rows[:30], "kv_cache", src_tier=DEVICE)
    for i in range(30, 37):
        tiers.write(disk[i:i + 1], DISK, rows[i:i + 1], "kv_cache", src_tier=DEVICE)
    out = torch.empty(37, 3, 64, dtype=torch.bfloat16)
    tiers.write(out, DEVICE, disk[0:37], "kv_cache", src_tier=DISK)
    assert torch.equal(out, rows)
    moved = tiers.bytes_moved
    assert moved["host->disk"]["kv_cache"] == moved["disk->host"]["kv_cache"] == rows.nbytes


def test_a_short_read_is_one_error_naming_the_file(tiers):
    disk = tiers.empty(DISK, (10_000,), torch.float32)
    tiers.write(disk, DISK, torch.randn(10_000), "weights", src_tier=HOST)
    path = tiers.disk.locate(disk)[0].path
    os.truncate(path, 8192)  # the file lost its tail (a full disk, a stray cleanup)
    with pytest.raises(OffloadIOError, match=os.path.basename(path)) as err:
        tiers.to_compute(disk[5000:], DISK, "weights")
    assert "\n" not in str(err.value) and "short read" in str(err.value)


def test_files_are_removed_with_their_tensors(tiers):
    disk = tiers.empty(DISK, (4096,), torch.float32)
    path = tiers.disk.locate(disk)[0].path
    assert os.path.exists(path)
    del disk
    assert not os.path.exists(path)


def test_small_tensors_share_files_and_leave_with_the_last(tiers, monkeypatch):
    """Small disk tensors are block-aligned pieces of shared files (a MoE model has tens of
    thousands of expert tensors, and a file holds descriptors): each reads back what was
    written to it, a shared file is full before the next starts, and a file is removed when
    its last tensor goes; a large tensor still gets a file of its own."""
    monkeypatch.setattr(disk_io, "SHARED_FILE_BYTES", 64 * 4096)
    data = [torch.randn(1100 + 20 * i) for i in range(40)]  # 4.3-7.4 KiB: two blocks each
    disk = [tiers.empty(DISK, (len(d),), torch.float32) for d in data]
    for d, t in zip(data, disk):
        tiers.write(t, DISK, d, "weights", src_tier=HOST)
    paths = [tiers.disk.locate(t)[0].path for t in disk]
    assert len(set(paths)) == 2  # 32 two-block pieces fill a 64-block file
    for d, t in zip(data, disk):
        assert torch.equal(tiers.to_compute(t, DISK, "weights"), d)
    big = tiers.empty(DISK, ((disk_io.SMALL_BYTES >> 2) + 1,), torch.float32)
    assert tiers.disk.locate(big)[0].path not in paths
    first = paths[0]
    del disk[:31], data, d, t  # the loops' names hold a tensor too
    assert os.path.exists(first)  # one piece of it is still held
    del disk[0]
    assert not os.path.exists(first) and os.path.exists(paths[-1])
    del disk
    assert not os.path.exists(paths[-1])


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
def test_weights_and_cache_on_disk_equal_the_run_in_memory(tiny_opt, tmp_path, direct_io):
    prompts = [[2, 5, 17, 99, 45, 8, 200, 31], [2, 40, 41, 42]]
    runs = []
    placements = (([0, 100, 0, 100, 100, 0], False), ([0, 0, 0, 0, 100, 0], direct_io),
                  ([10, 30, 20, 30, 0, 50], direct_io))
    for percent, direct in placements:
        policy = Placement.from_percent(percent, gpu_batch_size=2, direct_io=direct)
        with OffloadedLM.load(path=tiny_opt[1], policy=policy, dtype="float32", progress=False,
                              offload_dir=str(tmp_path)) as lm:
            out = lm.generate(prompts, 6, stop_token_id=None, keep_logits=True)
            runs.append((out, lm.tiers.disk.direct_bytes,
                         {k: dict(v) for k, v in lm.tiers.bytes_moved.items()}))
    for out, _, _ in runs[1:]:
        assert out.token_ids == runs[0][0].token_ids
        for a, b in zip(out.logits, runs[0][0].logits):
            assert torch.equal(a, b)
    assert runs[1][2]["disk->host"]["weights"] > 0 and runs[1][2]["disk->host"]["kv_cache"] > 0
    if not direct_io:
        assert runs[1][1] == 0


def test_a_block_that_fails_to_start_leaves_the_engine_usable(tiny_opt, tmp_path, monkeypatch):
    """A full disk while making the KV cache files: one clear error, and the next generate
    runs (the engine is not left marked as running a block)."""
    from flexgen_infinigen.config import ConfigError

    policy = Placement.from_percent([100, 0, 0, 0, 100, 0])
    with OffloadedLM.load(path=tiny_opt[1], policy=policy, dtype="float32", progress=False,
                          offload_dir=str(tmp_path)) as lm:
        real = lm.tiers.disk.allocate

        def full_disk(count, dtype):
            raise ConfigError("the offload folder has no room (disk full)")

        monkeypatch.setattr(lm.tiers.disk, "allocate", full_disk)
        with pytest.raises(ConfigError, match="disk full"):
            lm.generate([[2, 5, 17]], 3, stop_token_id=None)
        monkeypatch.setattr(lm.tiers.disk, "allocate", real)
        assert len(lm.generate([[2, 5, 17]], 3, stop_token_id=None).token_ids[0]) == 3
