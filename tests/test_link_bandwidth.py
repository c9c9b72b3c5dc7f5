"""The report's achieved GB/s per link: the ledger's bytes over the run's step time, beside the
saved profile's peak (read from the cache, never measured during a report)."""
from __future__ import annotations

import dataclasses
import io
import json

import pytest

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.cli.report import build_report, print_report
from flexgen_infinigen.planner import measure
from flexgen_infinigen.planner.hardware import BUILTIN, GB
from flexgen_infinigen.planner.measure import cache_path, save_to_cache
from flexgen_infinigen.memory.tiers import LINKS
from flexgen_infinigen.config import CACHE_ENV

PROMPT = [2, 11, 12, 13, 14, 15, 16]
HOST_TIER = [0, 100, 0, 100, 100, 0]  # weights and KV cache in host memory
DISK_TIER = [0, 0, 0, 0, 100, 0]  # weights and KV cache on disk: all four links move bytes


def cpu_profile(**changes):
    """A CPU-only machine's profile with recognizable peaks."""
    rates = dict(BUILTIN["a6000-pcie3"].rates, h2d={1 << 20: 3 * GB, 1 << 28: 7 * GB},
                 d2h={1 << 20: 5 * GB, 1 << 28: 4 * GB},
                 page_cache_read={1 << 20: 9 * GB, 1 << 28: 6 * GB})
    fields = dict(name="test-cpu", shared_memory=True, rates=rates, disk_read_bw=2 * GB,
                  disk_write_bw=1 * GB, source="test profile")
    return dataclasses.replace(BUILTIN["a6000-pcie3"], **{**fields, **changes})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder, and a report that would fail if it measured this machine."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))

    def no_measuring(*args, **kwargs):
        raise AssertionError("a report must not measure the machine")

    monkeypatch.setattr(measure.cache, "measure_hardware", no_measuring)
    return tmp_path


def _run(store, percent, gen_len=5, **generate):
    policy = Placement.from_percent(percent, overlap=False)
    with OffloadedLM.load(path=store, policy=policy, device="cpu", progress=False) as lm:
        gen = lm.generate([PROMPT], gen_len, stop_token_id=None, **generate)
        report = build_report(lm, gen, "cpu")
        ledger = {link: sum(kinds.values()) for link, kinds in lm.tiers.bytes_moved.items()}
    return gen, report, ledger


def _printed(report) -> list[str]:
    out = io.StringIO()
    print_report(report, out)
    return out.getvalue().splitlines()


def test_rates_are_the_ledger_bytes_over_the_step_time(tiny_opt, cache):
    gen, report, ledger = _run(tiny_opt[1], DISK_TIER)
    bw = report["link_bandwidth"]
    seconds = gen.prefill_latency_s + gen.decode_latency_s
    assert bw["seconds"] == pytest.approx(seconds, rel=1e-9)
    assert bw["profile"] is None
    assert set(bw["links"]) == set(LINKS) and all(ledger[link] > 0 for link in LINKS)
    for link, row in bw["links"].items():
        assert row["bytes"] == ledger[link] == sum(report["bytes_moved"][link].values())
        assert row["bytes_per_s"] == pytest.approx(ledger[link] / seconds, rel=1e-9)
        assert row["peak_bytes_per_s"] is None and row["share_of_peak"] is None
    assert json.loads(json.dumps(report))["link_bandwidth"] == bw
    lines = _printed(report)
    assert any("no saved profile" in line for line in lines)
    for link, row in bw["links"].items():
        assert any(line.startswith(f"  {link:<14}{row['bytes_per_s'] / GB:>9.3f} GB/s")
                   for line in lines)


def test_decode_rates_leave_out_the_prefill(tiny_opt, cache):
    """Weights in host memory cross host->device at every step; the prefill also writes the
    prompt's KV cache to the host, which the decode rate must not count."""
    gen, report, ledger = _run(tiny_opt[1], HOST_TIER, gen_len=6)
    decode_s = sum(gen.step_times[1:])
    for link, row in report["link_bandwidth"]["links"].items():
        prefill = gen.prefill_link_bytes[link]
        assert 0 < prefill < ledger[link]
        assert row["decode_bytes_per_s"] == pytest.approx((ledger[link] - prefill) / decode_s)
    # one prefill step wrote a whole prompt to the host cache, one decode step one token
    kv_out = gen.prefill_link_bytes["device->host"]
    per_step = (ledger["device->host"] - kv_out) / (len(gen.step_times) - 1)
    assert kv_out > 3 * per_step


def test_links_that_moved_nothing_are_left_out(tiny_opt, cache):
    _, report, ledger = _run(tiny_opt[1], HOST_TIER)
    assert ledger["disk->host"] == ledger["host->disk"] == 0
    assert set(report["link_bandwidth"]["links"]) == {"host->device", "device->host"}


def test_peaks_come_from_the_saved_profile(tiny_opt, cache):
    save_to_cache(cpu_profile())
    _, report, _ = _run(tiny_opt[1], DISK_TIER)
    bw = report["link_bandwidth"]
    assert bw["profile"] == "test profile"
    expected = {"host->device": ("rates.h2d", 7 * GB), "device->host": ("rates.d2h", 5 * GB),
                "disk->host": ("rates.page_cache_read", 9 * GB),
                "host->disk": ("disk_write_bw", 1 * GB)}
    for link, (source, peak) in expected.items():
        row = bw["links"][link]
        assert (row["peak_from"], row["peak_bytes_per_s"]) == (source, peak)
        assert row["share_of_peak"] == pytest.approx(row["bytes_per_s"] / peak)
        line = f"{100 * row['share_of_peak']:.0f}% of {peak / GB:.2f} GB/s peak ({source})"
        assert any(ln.startswith(f"  {link}") and line in ln for ln in _printed(report))
    # cold reads faster than cached ones: the disk read rate is the peak
    slow_cache = cpu_profile(disk_read_bw=20 * GB)
    assert slow_cache.link_peak("disk->host") == ("disk_read_bw", 20 * GB)


@pytest.mark.parametrize("saved", ["gpu", "corrupt"])
def test_no_peak_from_another_device_or_an_unreadable_profile(tiny_opt, cache, saved):
    if saved == "gpu":  # a profile of this machine's GPU says nothing of a CPU run
        save_to_cache(cpu_profile(shared_memory=False))
    else:
        cache_path().write_text("{not json")
    _, report, _ = _run(tiny_opt[1], HOST_TIER)
    bw = report["link_bandwidth"]
    assert bw["profile"] is None and bw["links"]
    assert all(row["peak_bytes_per_s"] is None for row in bw["links"].values())


def test_projected_runs_divide_by_the_steps_run(tiny_opt, cache):
    """--cut-gen-len projects the decode latency; the bytes are the steps run's, and so is
    the time they are divided by."""
    gen, report, ledger = _run(tiny_opt[1], HOST_TIER, gen_len=8, cut_gen_len=3)
    assert gen.projected and len(gen.step_times) == 3
    bw = report["link_bandwidth"]
    assert bw["seconds"] == pytest.approx(sum(gen.step_times), rel=1e-9)
    assert bw["seconds"] < 0.9 * report["total_latency_s"]
    row = bw["links"]["host->device"]
    assert row["bytes_per_s"] == pytest.approx(ledger["host->device"] / sum(gen.step_times))
