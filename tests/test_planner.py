"""The cost model, the placement LP and the optimizer commands.

References: the runtime's own byte ledger (the cost model's traffic must equal what
the engine moves), the runtime's memory plan (every chosen policy must pass it), and
a brute-force grid over the same linear objective (the LP must not be beaten).
"""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError, get_config
from flexgen_infinigen.planner import cost, lp, workload
from flexgen_infinigen.planner.cost import predict
from flexgen_infinigen.planner.hardware import BUILTIN, GB, HardwareProfile, load_profile
from flexgen_infinigen.planner.workload import Workload

A6000 = BUILTIN["a6000-pcie3"]


def unit_profile(**changes) -> HardwareProfile:
    """Every rate 1 byte/s, no fixed costs: a link term in seconds equals its bytes."""
    ones = {1: 1.0, 1 << 40: 1.0}
    base = dataclasses.replace(
        A6000, disk_read_bw=1.0, disk_write_bw=1.0, rates={r: dict(ones) for r in A6000.rates},
        overhead_s={}, op_overhead_s=0.0, copies_overlap_compute=False,
        gpu_mem=1e15, cpu_mem=1e15, disk_mem=1e15)
    return dataclasses.replace(base, **changes)


def cpu_profile(mem_gb: float = 20.0) -> HardwareProfile:
    """A plausible CPU-only machine (device and host share memory, copies take the cores)."""
    return dataclasses.replace(A6000, name="test-cpu", dtype_bytes=4, shared_memory=True,
                               copies_overlap_compute=False, gpu_mem=mem_gb * GB,
                               cpu_mem=mem_gb * GB)


# ---- the cost model against the runtime's ledger ----------------------------------------------
@pytest.mark.parametrize("percent", [[0, 100, 0, 100, 100, 0], [30, 30, 25, 50, 100, 0],
                                     [100, 0, 0, 0, 100, 0]])
def test_predicted_traffic_equals_the_ledger(tiny_opt, percent):
    _, store = tiny_opt
    steps, prompt = 6, [2, 11, 12, 13, 14, 15, 16, 17]
    policy = Placement.from_percent(percent, overlap=False)
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        lm.generate([prompt], steps, stop_token_id=None)
        moved = {link: sum(kinds.values()) for link, kinds in lm.tiers.bytes_moved.items()}
        cfg = lm.cfg
    work = Workload(cfg, len(prompt), steps, dtype_bytes=4)
    hw = unit_profile()
    x = workload.fractions(policy)
    pre = cost.prefill_terms(work, policy, hw, x)
    dec = cost.decode_terms(work, policy, hw, x, workload.mean_context(work))

    def total(key):
        return pre[key] + (steps - 1) * dec[key]

    # weights are split by whole rows, so a fraction of a tensor is exact only to a row
    # (the cache percentages above split the tiny model's 4 heads exactly)
    assert total("h2d") == pytest.approx(moved["host->device"], rel=0.03)
    assert total("d2h") == pytest.approx(moved["device->host"], rel=0.03)
    assert total("disk_read") == pytest.approx(moved["disk->host"], rel=0.03)
    assert total("disk_write") == pytest.approx(moved["host->disk"], rel=0.03, abs=1)


# ---- monotonicity -----------------------------------------------------------------------------
POLICIES = [Placement.from_percent(p, gpu_batch_size=b) for p, b in [
    ([100, 0, 100, 0, 100, 0], 4), ([0, 100, 0, 100, 100, 0], 8), ([50, 30, 0, 60, 100, 0], 16),
    ([20, 80, 0, 100, 0, 100], 32)]]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("rate", ["h2d", "d2h", "attention", "page_cache_read", "host_gather"])
def test_more_bandwidth_never_predicts_slower(policy, rate):
    work = Workload(get_config("opt-6.7b"), 512, 32, 2)
    hw = dataclasses.replace(A6000, cpu_mem=1e13, disk_mem=1e13)
    base = predict(work, policy, hw)
    faster = dataclasses.replace(hw, rates={**hw.rates, rate: {
        k: 2 * v for k, v in hw.rates[rate].items()}})
    got = predict(work, policy, faster)
    assert got["total_s"] <= base["total_s"] * (1 + 1e-12)
    for key in ("disk_read_bw", "disk_write_bw"):
        more = predict(work, policy, dataclasses.replace(hw, **{key: 2 * getattr(hw, key)}))
        assert more["total_s"] <= base["total_s"] * (1 + 1e-12)


@pytest.mark.parametrize("kv", ["infinigen", "h2o"])
def test_smaller_fetch_fraction_never_predicts_more_kv_traffic(kv):
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=8)
    hw = unit_profile()
    traffic = []
    for fraction in (1.0, 0.5, 0.2, 0.1, 0.05):
        work = Workload(get_config("opt-13b"), 1024, 64, 2, kv, fraction)
        terms = predict(work, policy, hw)["decode_terms_s"]
        traffic.append(terms["h2d"])
    assert traffic == sorted(traffic, reverse=True) and traffic[-1] < traffic[0]
    full = predict(Workload(get_config("opt-13b"), 1024, 64, 2), policy, hw)
    assert full["decode_terms_s"]["h2d"] >= traffic[0]


# ---- the linear program -----------------------------------------------------------------------
def _objective(work, policy, hw, x):
    pre = cost.prefill_terms(work, policy, hw, x)
    dec = cost.decode_terms(work, policy, hw, x, workload.mean_context(work))
    return sum(pre.values()) + (work.gen_len - 1) * sum(dec.values())


def test_lp_is_not_beaten_by_a_grid_and_respects_memory():
    cfg = get_config("opt-6.7b")
    work = Workload(cfg, 512, 32, 2)
    policy = Placement(gpu_batch_size=8, overlap=False)
    hw = dataclasses.replace(A6000, copies_overlap_compute=False, gpu_mem=10 * GB,
                             cpu_mem=12 * GB, disk_mem=100 * GB)
    frac = lp.solve_placement(work, policy, hw)
    size = lp._coefficients(work, policy)
    dev = size["fixed"] + sum(size[g] * frac[g + "g"] for g in "wch")
    host = sum(size[g] * frac[g + "c"] for g in "wch")
    disk = sum(size[g] * frac[g + "d"] for g in "wch")
    assert dev <= hw.gpu_mem * (1 + 1e-6) and host <= hw.cpu_mem * (1 + 1e-6)
    assert disk <= hw.disk_mem * (1 + 1e-6)
    best = _objective(work, policy, hw, frac)
    steps = [i / 10 for i in range(11)]
    for wg, wc, cg, cc in itertools.product(steps, repeat=4):
        if wg + wc > 1 or cg + cc > 1:
            continue
        x = {"wg": wg, "wc": wc, "wd": 1 - wg - wc, "cg": cg, "cc": cc, "cd": 1 - cg - cc,
             "hg": 1, "hc": 0, "hd": 0}
        need_dev = size["fixed"] + size["w"] * wg + size["c"] * cg + size["h"]
        need_host = size["w"] * wc + size["c"] * cc
        need_disk = size["w"] * x["wd"] + size["c"] * x["cd"]
        if need_dev <= hw.gpu_mem and need_host <= hw.cpu_mem and need_disk <= hw.disk_mem:
            assert best <= _objective(work, policy, hw, x) * (1 + 1e-6)


@pytest.mark.parametrize("limits", [(10, 12, 100), (24, 64, 0), (6, 200, 0), (12, 8, 60)])
def test_optimizer_pick_passes_the_runtime_memory_plan(limits):
    from flexgen_infinigen.engine import memory_plan

    gpu, cpu, disk = limits
    hw = A6000.with_memory(gpu, cpu, disk)
    work = Workload(get_config("opt-6.7b"), 512, 32, 2)
    best, plans = lp.optimize(work, hw, batch_sizes=(1, 4, 16), num_batches=(1, 2))
    for plan in plans:
        p = plan.policy
        assert all(float(v).is_integer() for v in plan.percent())
        need = memory_plan.plan(work.cfg, p, work.torch_dtype, 512, 32)["total"]
        assert need["device"] + workload.extra_device_bytes(work, p) <= gpu * GB
        assert need["host"] <= cpu * GB and need["disk"] <= disk * GB
    assert best.prediction["throughput"] == max(p.prediction["throughput"] for p in plans)


def test_infeasible_request_names_the_memory_that_would_fit():
    hw = BUILTIN["t4-pcie3"].with_memory(disk_gb=100)
    work = Workload(get_config("opt-175b"), 512, 32, 2)
    total, _ = lp.smallest_need(work, Placement())
    with pytest.raises(ConfigError) as e:
        lp.optimize(work, hw)
    msg = str(e.value)
    assert f"needs {total / GB:.1f} GB" in msg and "--disk-mem" in msg
    # the named size is enough: with exactly that much disk, a plan exists
    need = int(msg.split("--disk-mem ")[1].split()[0])
    best, _ = lp.optimize(work, hw.with_memory(disk_gb=need), batch_sizes=(1,),
                          num_batches=(1,))
    assert best.policy.block_size == 1
    with pytest.raises(ConfigError, match="device memory"):
        lp.optimize(work, hw.with_memory(gpu_gb=0.01))


def test_paper_setting_full_and_infinigen_choose_differently():
    """OPT-13B, batch 20, prompt 1920, 128 tokens on the A6000 profile (InfiniGen's setting)."""
    cfg = get_config("opt-13b")
    picks = {}
    for kv, fraction in (("full", 1.0), ("infinigen", 0.2)):
        work = Workload(cfg, 1920, 128, 2, kv, fraction)
        best, _ = lp.optimize(work, A6000, batch_sizes=(20,), num_batches=(1,))
        picks[kv] = (best.percent(), best.policy.cpu_cache_compute)
        assert best.prediction["fits"]
    assert picks["full"] != picks["infinigen"]
    paper = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=20)
    full = predict(Workload(cfg, 1920, 128, 2), paper, A6000)
    ig = predict(Workload(cfg, 1920, 128, 2, "infinigen", 0.2), paper, A6000)
    assert ig["decode_step_s"] < full["decode_step_s"]


def test_solver_is_available():
    assert lp.solver().available()


# ---- commands -----------------------------------------------------------------------------------
def test_optimize_command_json(tmp_path, capsys):
    from flexgen_infinigen.optimize import main

    out = tmp_path / "plan.json"
    assert main(["--model", "opt-13b", "--prompt-len", "1920", "--gen-len", "128", "--hw",
                 "a6000-pcie3", "--kv-policy", "infinigen", "--gpu-batch-size", "20",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    best = data["best"]
    assert best["gpu_batch_size"] == 20 and len(best["percent"]) == 6
    assert " ".join(map(str, best["percent"])) in data["command"]
    assert "--kv-policy infinigen" in data["command"]
    assert main(["--hw", str(tmp_path / "missing.json")]) == 2
    assert "profile" in capsys.readouterr().err


def test_profile_file_round_trip_and_show(tmp_path, capsys):
    from flexgen_infinigen.profile import main

    path = tmp_path / "hw.json"
    cpu_profile().save(str(path))
    assert load_profile(str(path)) == cpu_profile()
    assert main(["--show", str(path)]) == 0
    assert "test-cpu" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ConfigError, match="re-run"):
        load_profile(str(bad))


def test_run_percent_auto_uses_the_plan(smollm2_store, tmp_path):
    from flexgen_infinigen.run import main

    hw = tmp_path / "hw.json"
    cpu_profile(mem_gb=8).save(str(hw))
    out = tmp_path / "r.json"
    assert main(["--percent", "auto", "--gpu-batch-size", "auto", "--hw", str(hw),
                 "--prompt-len", "32", "--gen-len", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    plan, pol = report["auto_plan"], report["policy"]
    assert [pol[k] for k in lp.PERCENT_FIELDS] == plan["percent"]
    assert pol["gpu_batch_size"] == plan["gpu_batch_size"]
    assert report["num_prompts"] == plan["gpu_batch_size"] * plan["num_gpu_batches"]


def test_run_auto_rejects_bad_values_before_loading(capsys):
    from flexgen_infinigen.run import main

    assert main(["--percent", "auto", "--hw", "no-such-profile"]) == 2
    assert "no hardware profile" in capsys.readouterr().err
    assert main(["--percent", "10", "20"]) == 2
    assert "six numbers" in capsys.readouterr().err


def test_engine_overheads_run_the_real_engine():
    """The profile's fixed costs come from tiny models run by the engine with every option."""
    import torch

    from flexgen_infinigen.planner.measure import engine_overheads

    got = engine_overheads(torch.device("cpu"), torch.float32)
    assert set(got) == {f"{f}/{w}" for f in ("opt", "llama")
                        for w in ("layer", "kv_offload", "weights_offload", "infinigen", "h2o")}
    assert all(0 <= v < 0.1 for v in got.values())
    assert got["opt/layer"] > 0 and got["llama/layer"] > 0
