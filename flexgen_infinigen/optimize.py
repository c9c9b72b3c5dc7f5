"""Command line: ``python -m flexgen_infinigen.optimize --model M --prompt-len P --gen-len G``.

Picks the placement percentages and batch shape with the highest predicted throughput
for a hardware profile, and prints the ``run`` command that uses them.
"""
from __future__ import annotations

import argparse
import sys

from .cli.args import add_offline_arg, write_json
from .config import DEFAULT_MODEL
from .flags import int_or_auto
from .kv import plannable_names, policy_class
from .planner.auto import (
    check_possible,
    default_kv_fraction,
    describe,
    profile_for,
    run_command,
    search,
    summary,
)
from .planner.hardware import BUILTIN
from .placement import Placement
from .guards import check_output_path
from .guards import run_command as run_guarded
from .engine.loading import model_config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flexgen_infinigen.optimize",
        description="Choose --percent, --gpu-batch-size and --num-gpu-batches from a cost model "
                    "of the hardware (a linear program per batch shape, solved with PuLP).")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="a registry name, a Hub name (org/name; a checkpoint repo sends its "
                        "config.json only), a .gguf file or a Hugging Face checkpoint folder")
    add_offline_arg(p)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--hw", default=None,
                   help="a profile JSON from `python -m flexgen_infinigen.profile`, or a built-in "
                        f"profile ({', '.join(BUILTIN)}); default: this machine")
    p.add_argument("--gpu-mem", type=float, default=None, help="GB usable on the GPU")
    p.add_argument("--cpu-mem", type=float, default=None, help="GB usable in CPU memory")
    p.add_argument("--disk-mem", type=float, default=None, help="GB usable on disk")
    p.add_argument("--offload-dir", default=None, help="the disk tier's folder (for its space)")
    p.add_argument("--kv-policy", default="full", choices=plannable_names())
    p.add_argument("--kv-fraction", type=float, default=None,
                   help="fraction of the context fetched (infinigen; default its cap, 0.2) or "
                        "kept (h2o; default 0.2)")
    p.add_argument("--gpu-batch-size", type=int_or_auto, default="auto",
                   metavar="N|auto")
    p.add_argument("--num-gpu-batches", type=int_or_auto, default="auto",
                   metavar="N|auto")
    p.add_argument("--compress-weight", action="store_true")
    p.add_argument("--compress-cache", action="store_true")
    p.add_argument("--cpu-cache-compute", action="store_true",
                   help="force attention on the CPU (default: tried both ways with "
                        "--kv-policy full)")
    p.add_argument("--dtype-bytes", type=int, default=None, choices=[2, 4],
                   help="bytes per value (default: the profile's, fp16 on GPUs, fp32 on CPUs)")
    p.add_argument("--top", type=int, default=3, help="also show this many runners-up")
    p.add_argument("--json", default=None, metavar="FILE")
    return p


def main(argv=None) -> int:
    return run_guarded(_main, argv)


def _main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    check_output_path(a.json, "--json")
    cfg = model_config(a.model, shapes_only=True)  # planning needs shapes, no weights
    policy_class(a.kv_policy, plannable=True).check_model(cfg)
    if a.hw is None:  # profiling this machine takes a while: first what needs no profile
        check_possible(cfg, a.prompt_len, a.gen_len, a.dtype_bytes or 2, a.offload_dir,
                       a.gpu_mem, a.cpu_mem, a.disk_mem)
    hw = profile_for(a.hw, a.gpu_mem, a.cpu_mem, a.disk_mem, a.offload_dir)
    base = Placement(compress_weight=a.compress_weight, compress_cache=a.compress_cache,
                  cpu_cache_compute=a.cpu_cache_compute)
    fraction = a.kv_fraction if a.kv_fraction is not None else \
        default_kv_fraction(a.kv_policy)
    fixed = [None if v == "auto" else v for v in (a.gpu_batch_size, a.num_gpu_batches)]
    best, plans = search(cfg, a.prompt_len, a.gen_len, hw, base, a.kv_policy, fraction,
                         *fixed, a.dtype_bytes)
    command = run_command(best, cfg.name, a.prompt_len, a.gen_len, a.kv_policy)
    print(f"{cfg.name}, prompt {a.prompt_len}, gen {a.gen_len}, kv policy {a.kv_policy}"
          + (f" (fraction {fraction:g})" if a.kv_policy != "full" else "")
          + f", hardware {hw.name}: {hw.device}")
    print("best policy:")
    print(describe(best, hw))
    for i, plan in enumerate(plans[1:1 + a.top], 2):
        print(f"#{i}:")
        print(describe(plan, hw))
    print(f"run it with:\n  {command}")
    if cfg.name != DEFAULT_MODEL:
        print("  (add --path to the weight store converted with `python -m "
              "flexgen_infinigen.convert`, or --dummy for random weights)")
    write_json(a.json, {"model": cfg.name, "prompt_len": a.prompt_len, "gen_len": a.gen_len,
                        "kv_policy": a.kv_policy, "kv_fraction": fraction,
                        "hardware": hw.to_dict(), "best": summary(best), "command": command,
                        "candidates": [summary(p) for p in plans[:1 + a.top]],
                        "shapes_feasible": len(plans)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
