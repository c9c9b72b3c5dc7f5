"""Pipeline parallelism on CPUs over gloo: 2 and 3 processes against one, faults, bad flags.

The tests start their processes themselves with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on a free loopback port), or torchrun itself for the command line,
and stop them all on the way out.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flexgen_infinigen import run
from flexgen_infinigen.api import OffloadedLM
from flexgen_infinigen.kv import make_kv_policy
from flexgen_infinigen.placement import Placement
from flexgen_infinigen.sampling import SamplingConfig

WORKER = Path(__file__).with_name("pipeline_worker.py")
PERCENT = [30, 50, 40, 40, 100, 0]  # weights and cache on all three tiers, on every rank
CALIBRATION = ("The river ran past the mill and under the old stone bridge, where children "
               "threw sticks into the water and raced to see whose came out first. ") * 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, argv: list[str], logs: Path, timeout: float = 20) -> list:
    """``world`` processes of ``python argv`` as one torchrun job would start them."""
    port, procs = free_port(), []
    logs.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        log = open(logs / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs


def wait_all(procs, limit: float, logs: Path) -> list[int]:
    """Exit codes, or kill everything and fail after ``limit`` seconds."""
    end = time.monotonic() + limit
    try:
        return [p.wait(timeout=max(end - time.monotonic(), 0.1)) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"ranks still running after {limit} s:\n" + read_logs(logs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def read_logs(logs: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(logs.glob("*.log")))


def prompts(vocab: int, n: int = 6) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(10, vocab, (8 + i % 3,), generator=gen).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("calibration") / "text.txt"
    path.write_text(CALIBRATION)
    return str(path)


@pytest.fixture(scope="module")
def cases(smollm2_store, calibration, tmp_path_factory):
    """OPT-125M (dummy) and SmolLM2-135M, each with the full cache and InfiniGen, run with
    1, 2 (uneven: 2 + 1 GPU batches) and 3 micro-batches (3 GPU batches of 2), and the
    one-process results to match."""
    kvs = [{"name": "full", "options": {}},
           {"name": "infinigen", "options": {"calibration": calibration}}]
    models = [{"name": "opt", "model": "opt-125m", "path": None, "dummy": True, "vocab": 50272},
              {"name": "smollm2", "model": None, "path": str(smollm2_store), "dummy": False,
               "vocab": 49152}]
    reference = {}
    for m in models:
        m.update(percent=PERCENT, batch=2, gpu_batches=3, prompt_len=10, gen_len=4,
                 prompts=prompts(m["vocab"]), kv_policies=kvs, micro_batches=[1, 2, 3],
                 offload_dir=str(tmp_path_factory.mktemp("offload")))
        policy = Placement.from_percent(PERCENT, gpu_batch_size=2, num_gpu_batches=3)
        with OffloadedLM.load(m["model"], m["path"], m["dummy"], policy, device="cpu",
                              offload_dir=m["offload_dir"], progress=False) as lm:
            for kv in kvs:
                lm.use_kv_policy(make_kv_policy(kv["name"], **kv["options"]))
                gen = lm.generate(m["prompts"], m["gen_len"], SamplingConfig(),
                                  stop_token_id=None, keep_logits=True)
                reference[(m["name"], kv["name"])] = (gen.token_ids, torch.stack(gen.logits))
    return models, reference


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_match_one_process(world, cases, tmp_path):
    models, reference = cases
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"models": models}))
    out = tmp_path / "out"
    out.mkdir()
    procs = launch(world, [str(WORKER), str(spec), str(out)], tmp_path / "logs")
    codes = wait_all(procs, 400, tmp_path / "logs")
    assert codes == [0] * world, read_logs(tmp_path / "logs")
    checked = 0
    for (model, kv), (tokens, logits) in reference.items():
        for k in (1, 2, 3):
            got = torch.load(out / f"{model}-{kv}-{k}.pt", weights_only=True)
            assert got["part"][0] == 0 and got["part"][1] < (12 if model == "opt" else 30)
            assert got["tokens"] == tokens, (model, kv, k)
            torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked == 12


def test_torchrun_command_line(tmp_path):
    """The README's command: same tokens as one process, per-rank report, exact bytes sent
    between ranks (hidden states, speculation inputs and tokens, counted independently)."""
    args = ["--model", "opt-125m", "--dummy", "--prompt-len", "6", "--gen-len", "3",
            "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--kv-policy", "infinigen",
            "--no-stop"]
    single = tmp_path / "single.json"
    assert run.main([*args, "--json", str(single)]) == 0
    piped = tmp_path / "piped.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2"]
    done = subprocess.run([*torchrun, "-m", "flexgen_infinigen.run", *args,
                           "--pipeline-stages", "2", "--json", str(piped)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = json.loads(single.read_text()), json.loads(piped.read_text())
    assert two["token_ids"] == one["token_ids"]
    assert two["kv_policy"]["kv_fetch_fraction"] == one["kv_policy"]["kv_fetch_fraction"]
    p = two["pipeline"]
    assert [r["rank"] for r in p["ranks"]] == [0, 1]
    assert p["ranks"][0]["embed"] and p["ranks"][1]["head"]
    assert p["ranks"][0]["layers"][1] == p["ranks"][1]["layers"][0]
    b, m, prompt, gen, hidden = 2, 2, 6, 3, 768
    hidden_bytes = m * b * (prompt + (gen - 1)) * hidden * 4
    spec_bytes = m * b * (gen - 1) * hidden * 4  # the handed-over attention input, decode only
    token_bytes = m * b * gen * 8
    assert p["ranks"][0]["between_ranks_bytes"]["sent"] == {
        "1": {"hidden": hidden_bytes, "speculation_input": spec_bytes}}
    assert p["ranks"][1]["between_ranks_bytes"]["sent"] == {"0": {"tokens": token_bytes}}
    assert p["between_ranks_bytes"] == hidden_bytes + spec_bytes + token_bytes
    assert "pipeline: 2 stages" in done.stdout


FAULT_ARGS = ["-m", "flexgen_infinigen.run", "--model", "opt-125m", "--dummy", "--prompt-len",
              "8", "--gen-len", "1500", "--no-stop", "--pipeline-stages", "3",
              "--pipeline-timeout", "8"]


def decoding(log: Path, steps: int = 5) -> bool:
    """Rank 0's progress bar shows ``steps`` tokens made (the prefill is one)."""
    import re
    counts = [int(c) for c in re.findall(r"(\d+)/1500", log.read_text())]
    return bool(counts) and max(counts) >= steps


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_failed_rank_ends_the_others(fault, tmp_path):
    """Rank 1 killed (SIGKILL) or frozen (SIGSTOP) mid-decode: ranks 0 and 2 exit nonzero
    within --pipeline-timeout (8 s) plus slack, naming rank 1."""
    logs = tmp_path / "logs"
    procs = launch(3, FAULT_ARGS, logs)
    try:
        end = time.monotonic() + 120
        while not decoding(logs / "rank0.log"):
            assert time.monotonic() < end, "no decode step within 120 s:\n" + read_logs(logs)
            assert all(p.poll() is None for p in procs), read_logs(logs)
            time.sleep(0.2)
        os.kill(procs[1].pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        start = time.monotonic()
        codes = [procs[r].wait(timeout=45) for r in (0, 2)]
        took = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(c not in (0, None) for c in codes), read_logs(logs)
    assert took < 8 + 20, took
    for r in (0, 2):
        text = (logs / f"rank{r}.log").read_text()
        assert f"error: [rank {r}]" in text and "rank 1" in text, read_logs(logs)


def cli_error(capsys, argv, monkeypatch, world=None) -> str:
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world))
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    capsys.readouterr()
    start = time.perf_counter()
    rc = run.main([str(a) for a in argv])
    _, err = capsys.readouterr()
    assert rc == 2 and time.perf_counter() - start < 5, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("flags, world, words", [
    (["--pipeline-stages", "13"], 13, ["13", "12 layers"]),
    (["--pipeline-stages", "3"], 2, ["--pipeline-stages 3", "2 process", "torchrun"]),
    (["--pipeline-stages", "2"], None, ["torchrun --nproc-per-node 2"]),
    (["--pipeline-stages", "0"], None, ["at least 1"]),
    (["--pipeline-stages", "1"], 2, ["--pipeline-stages 2"]),
    (["--pipeline-stages", "2", "--pipeline-micro-batches", "0"], 2, ["micro-batches"]),
    (["--pipeline-stages", "2", "--pipeline-timeout", "0"], 2, ["timeout"]),
    (["--pipeline-stages", "2", "--hw", "t4-pcie3,t4-pcie3,a100-pcie4"], 2,
     ["3 profiles for 2 ranks"]),
    (["--pipeline-stages", "2", "--gpu-batch-size", "auto"], 2, ["fixed --gpu-batch-size"]),
])
def test_bad_pipeline_flags_fail_before_loading(flags, world, words, capsys, monkeypatch):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", *flags], monkeypatch, world)
    for w in words:
        assert w.lower() in line.lower(), (w, line)
