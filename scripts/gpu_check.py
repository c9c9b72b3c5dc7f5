"""The GPU check: the CUDA tests in shards, host-to-device bandwidth, how much copy time hides
under compute, planned against actual peak memory, the paper's OPT-13B setting, Llama-3.1-8B
shapes at 32K, a profile of InfiniGen's decode steps, and a mixture of experts with its experts
on the GPU and in CPU memory.

    scripts/gpu_check.sh --list                   # the steps, one command each
    scripts/gpu_check.sh --steps tests-core       # one step (each fits one 10-minute call)
    scripts/gpu_check.sh                          # every step, each in its own process
    scripts/gpu_check.sh --dry-run --out DIR      # on a CPU: every step at toy sizes

Each step writes ``<step>.json`` under ``--out`` (default ``benchmarks/results/gpu_check``)
with the machine, its status (``ok``, ``failed``: a command returned non-zero or ran past its
limit, ``error``: the step raised), and for a command its stdout and stderr (whole, in
``<step>.stdout.txt`` and ``<step>.stderr.txt``; their tails in the JSON). The exit status is
non-zero when any step is not ``ok``. Needs torch and numpy only (no pulp, no gguf: dummy
weights). The steps themselves are in ``gpu_check_steps.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

# a step must finish inside one call of the device tool (10 minutes), with room for starting
# Python and CUDA and bringing the results back
STEP_LIMIT_S = 480
# with --budget, the most of it each step may take, so that the later steps get their turn
# (a step's variants stop starting when the next would not fit)
BUDGET_SHARES = {"bandwidth": 25, "paper": 200, "long": 110, "tests-core": 90, "moe": 80}
TAIL = 6000  # characters of stdout and stderr kept in the JSON (the files keep everything)

# the CUDA tests, in shards that each run well inside STEP_LIMIT_S; the slow-stream matrix
# (72 cases, two loads each) is split by family and dtype ("float16" is also in "bfloat16")
MATRIX = "overlapped_equals_inline"
TEST_SHARDS = {
    "tests-core": ["tests/test_cuda.py", "tests/test_cuda_infinigen.py", "-k", f"not {MATRIX}"],
    "tests-matrix-opt-fp16": ["tests/test_cuda.py", "-k",
                              f"{MATRIX} and tiny_opt and not bfloat16"],
    "tests-matrix-opt-bf16": ["tests/test_cuda.py", "-k", f"{MATRIX} and tiny_opt and bfloat16"],
    "tests-matrix-llama-fp16": ["tests/test_cuda.py", "-k",
                                f"{MATRIX} and tiny_llama and not bfloat16"],
    "tests-matrix-llama-bf16": ["tests/test_cuda.py", "-k",
                                f"{MATRIX} and tiny_llama and bfloat16"],
}


class StepFailed(Exception):
    """A step's command returned non-zero or ran out of time; ``result`` keeps its output."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def machine() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30)
            info["driver"] = out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = None
    else:
        info["device"], info["driver"] = "cpu (dry run)", None
    return info


def run_command(a, name: str, args: list[str], limit: float | None = None) -> dict:
    """Run ``args`` in the repository root, its stdout and stderr kept whole in files under
    ``--out`` (so a timeout loses nothing). Raises :class:`StepFailed` on a non-zero exit or
    on running past ``limit`` seconds (the whole process group is stopped)."""
    limit = limit or a.step_limit
    out = Path(a.out)
    files = {s: out / f"{name}.{s}.txt" for s in ("stdout", "stderr")}
    start = time.perf_counter()
    with open(files["stdout"], "w") as so, open(files["stderr"], "w") as se:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=so, stderr=se, start_new_session=True)
        try:
            code, timed_out = proc.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code, timed_out = proc.wait(), True
    result = {"command": " ".join(args), "returncode": code, "timed_out": timed_out,
              "limit_s": limit, "seconds": time.perf_counter() - start,
              **{f"{s}_tail": files[s].read_text(errors="replace")[-TAIL:] for s in files},
              "files": {s: str(p) for s, p in files.items()}}
    if timed_out:
        raise StepFailed(f"{name}: ran past its {limit:.0f} s limit", result)
    if code != 0:
        raise StepFailed(f"{name}: exit status {code}", result)
    return result


def test_step(shard: str):
    def step(a) -> dict:
        args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                *TEST_SHARDS[shard]]
        if a.dry_run:
            args.append("--collect-only")
        return run_command(a, shard, args)
    step.__doc__ = f"pytest {' '.join(TEST_SHARDS[shard])}"
    return step


def steps() -> dict:
    """Every step by name, in the order ``gpu_check.sh`` runs them: the ones the issue's
    numbers come from first, so that a short lease ends with them."""
    import gpu_check_steps as s
    table = {"bandwidth": s.step_bandwidth, "paper": s.step_paper, "long": s.step_long,
             "tests-core": test_step("tests-core"), "moe": s.step_moe,
             "memory": s.step_memory, "overlap": s.step_overlap, "profile": s.step_profile}
    table.update({name: test_step(name) for name in TEST_SHARDS if name not in table})
    return table


STEPS = steps()


def _record(a, info: dict, name: str) -> tuple[str, dict]:
    """Run one step here; write and return its record."""
    start = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        result, status = STEPS[name](a), "ok"
    except StepFailed as e:
        result, status = {**e.result, "error": str(e)}, "failed"
    except Exception as e:  # a step's own error is recorded; the exit status says it failed
        result, status = {"error": repr(e), "traceback": traceback.format_exc()}, "error"
    record = {"step": name, "status": status, "dry_run": a.dry_run, "machine": info,
              "seconds": time.perf_counter() - start, "result": result}
    (Path(a.out) / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
    print(json.dumps({k: v for k, v in record.items() if k != "machine"}, default=str)[:1500],
          flush=True)
    if status != "ok":
        print(f"error: step {name} {status}: {result.get('error')}", file=sys.stderr)
    return status, record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="on a CPU, run every step at toy sizes (proves the script reaches them)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check"))
    p.add_argument("--steps", nargs="+", default=None, choices=list(STEPS),
                   help="steps to run (default: all, each in its own process)")
    p.add_argument("--list", action="store_true", help="print each step's command and exit")
    p.add_argument("--cut-gen-len", type=int, default=8,
                   help="decode steps measured in the OPT-13B setting (projected to 128)")
    p.add_argument("--step-limit", type=float, default=STEP_LIMIT_S,
                   help="seconds a step's command may run before it is stopped and failed")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all the steps together: a step starts only with at least "
                        "--min-step seconds left, runs at most until the budget ends, and its "
                        "variants stop starting when the next would not fit")
    p.add_argument("--min-step", type=float, default=45.0)
    p.add_argument("--only", nargs="+", default=None, metavar="LABEL",
                   help="run only the variants of the model steps with these labels")
    p.add_argument("--warm-once", action="store_true",
                   help="warm up once a load, not before each variant (a short lease)")
    p.add_argument("--share", nargs="+", default=[], metavar="STEP=S",
                   help="with --budget: seconds a step may take (default: BUDGET_SHARES)")
    p.add_argument("--until", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.list:
        for name in STEPS:
            print(f"scripts/gpu_check.sh --steps {name}")
        return 0
    a.cuda = torch.cuda.is_available() and not a.dry_run
    if not a.cuda and not a.dry_run:
        print("error: no CUDA device is visible; run with --dry-run on a CPU", file=sys.stderr)
        return 2
    a.device = torch.device("cuda" if a.cuda else "cpu")
    if a.until is None and a.budget is not None:
        a.until = time.time() + a.budget
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = a.steps or list(STEPS)
    failed = []
    if len(names) == 1:
        status, _ = _record(a, machine(), names[0])
        failed = [] if status == "ok" else names
    else:  # each step in its own process: a crash or a hang in one leaves the others' results
        flags = ["--out", str(out), "--cut-gen-len", str(a.cut_gen_len)] + \
            (["--dry-run"] if a.dry_run else []) + (["--warm-once"] if a.warm_once else []) + \
            (["--only", *a.only] if a.only else [])
        shares = {**BUDGET_SHARES, **{k: float(v) for k, v in
                                      (item.split("=", 1) for item in a.share)}}
        skipped = []
        for name in names:
            left = a.until - time.time() if a.until else float("inf")
            if left < a.min_step:
                skipped.append(name)
                continue
            limit = min(a.step_limit, left - 10)
            if a.until:
                limit = min(limit, shares.get(name, limit))
            args = [sys.executable, str(Path(__file__).resolve()), "--steps", name, *flags,
                    "--step-limit", str(limit)]
            if a.until:
                args += ["--until", str(time.time() + limit)]
            try:
                code = subprocess.run(args, cwd=ROOT, timeout=limit + 20).returncode
            except subprocess.TimeoutExpired:
                code = None
                print(f"error: step {name} ran past {limit + 20:.0f} s", file=sys.stderr)
            if code != 0:
                failed.append(name)
        if skipped:
            print(f"steps not started (the budget was spent): {', '.join(skipped)}")
    print(f"steps failed: {', '.join(failed) or 'none'}; JSON under {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
