"""The flags every command shares (model, placement and schedule, KV policy) and what they
turn into: a :class:`~..placement.Placement` (or the optimizer's, with ``auto``) and the checks that
need no weights; plus the ``--json FILE`` writer. Below the commands, above the runtime."""
from __future__ import annotations

import argparse
import json
import math

from ..switches import HF_HUB_OFFLINE
from ..config import DEFAULT_MODEL, ConfigError
from ..flags import int_or_auto, str2bool
from ..kv import add_kv_args, kv_policy_from_args
from ..placement import Placement
from ..memory.offload_dir import offload_root
from ..sampling import SamplingConfig
from .request_checks import SEED_MAX, SEED_MIN


def add_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("placement and schedule")
    g.add_argument("--percent", nargs="+", default=["100", "0", "100", "0", "100", "0"],
                   metavar="P",
                   help="six numbers WG WC CG CC HG HC: weights, KV cache and activations on GPU "
                        "/ CPU in percent, disk gets the rest (on a CPU-only machine 'GPU' is the "
                        "compute device); or 'auto' to let the optimizer choose")
    g.add_argument("--experts-percent", nargs=2, type=float, default=None,
                   metavar=("GPU", "CPU"),
                   help="mixture-of-experts models: the routed experts on GPU / CPU in percent, "
                        "disk gets the rest (default: as the weights in --percent); attention, "
                        "router, shared experts and norms follow --percent. "
                        "--experts-percent 0 100 keeps the experts in CPU memory")
    g.add_argument("--gpu-batch-size", type=int_or_auto, default=1, metavar="N|auto")
    g.add_argument("--num-gpu-batches", type=int_or_auto, default=None, metavar="N|auto",
                   help="default 1, or auto when --gpu-batch-size is auto")
    g.add_argument("--hw", default=None,
                   help="hardware profile for auto choices: a JSON from `python -m "
                        "flexgen_infinigen.profile` or a built-in name (default: this machine); "
                        "with --pipeline-stages, one for all ranks or one per rank, "
                        "comma-separated in rank order")
    g.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="prompt tokens a layer's MLP and attention take at a time (default: "
                        "the memory plan's choice, which keeps each chunk's temporaries near "
                        "256 MB); nothing prompt x prompt is ever held")
    g.add_argument("--host-in-place", type=str2bool, default=True,
                   help="CPU-only machines: read a KV cache held in CPU memory where it is "
                        "(default); false copies it every step as a GPU's link would (to "
                        "test or measure the transfer path without a GPU)")
    g.add_argument("--sep-layer", type=str2bool, default=None,
                   help="attention and MLP as separate schedule stages, so a stage's weights "
                        "load while the one before computes (default: separate, except one "
                        "stage a layer on a CPU whose dense weights are all read in place)")
    g.add_argument("--pin-weight", type=str2bool, default=True)
    g.add_argument("--cpu-cache-compute", action="store_true")
    g.add_argument("--cpu-expert-compute", action="store_true",
                   help="a mixture-of-experts model: at decode, routed experts held in CPU "
                        "memory (--experts-percent) are multiplied there by the CPU and only "
                        "the tokens' rows cross the link; prompts still fetch them")
    g.add_argument("--compress-weight", action="store_true",
                   help="pack float weights into 4-bit groups of 64; weights a quantized GGUF "
                        "brought are kept as its codes, and this changes nothing for them")
    g.add_argument("--compress-cache", action="store_true")
    g.add_argument("--overlap", type=str2bool, default=None,
                   help="overlap transfers with compute (default: on with CUDA; on a CPU on when "
                        "anything is on disk, whose reads wait on the disk, and off otherwise, "
                        "where a copy thread only competes with compute for the cores)")
    g.add_argument("--direct-io", type=str2bool, default=False,
                   help="read the disk tier with O_DIRECT, bypassing the page cache (default "
                        "false: buffered reads with several requests in flight keep the disk "
                        "as busy; see docs/design/tiers_and_disk.md)")
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    g.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default: float16 on CUDA, float32 on CPU")
    g.add_argument("--offload-dir", default=None, help="folder for the disk tier (removed on exit)")
    add_kv_args(p)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help=f"a Hugging Face Hub name (org/name[@revision], org/name:QUANT or "
                        "org/name/FILE.gguf for a GGUF repo), a .gguf file, a checkpoint folder "
                        f"(each converted into the cache on first use) or a registry name "
                        f"(default {DEFAULT_MODEL})")
    add_offline_arg(g)
    g.add_argument("--path", default=None, help="a converted weight store folder")
    g.add_argument("--dummy", action="store_true", help="seeded random weights in true shapes")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", action=_Threads, type=_thread_count, default=None, metavar="N",
                   help="CPU threads for compute (torch's and the kernels'; as llama.cpp's -t; "
                        "default: torch's, one a core)")
    g.add_argument("--chat-template", type=_chat_template_file, default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's own (as in "
                        "transformers' chat_template.jinja); checked when the command starts")


def _chat_template_file(path: str) -> str:
    """``--chat-template FILE``: the path, once the file is read and parses (an argparse
    error, before any loading, otherwise)."""
    from ..text.chat import template_file

    try:
        template_file(path)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return path


def _thread_count(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of threads >= 1, got {value!r}")
    return n


class _Threads(argparse.Action):
    """``--threads N``: this process computes on N threads from now on (torch's pool, which
    the CPU kernels split their rows over), set as the flag is read, before any loading."""

    def __call__(self, parser, namespace, values, option_string=None):
        import torch

        torch.set_num_threads(values)
        setattr(namespace, self.dest, values)


class _Offline(argparse.Action):
    """``--offline`` is ``HF_HUB_OFFLINE=1`` for this process (and the ranks it starts): a Hub
    name is served from the cache, with no request."""

    def __call__(self, parser, namespace, values, option_string=None):
        HF_HUB_OFFLINE.set("1")
        setattr(namespace, self.dest, True)


def add_offline_arg(p) -> None:
    p.add_argument("--offline", action=_Offline, nargs=0, default=False,
                   help="use the Hugging Face cache only and make no request (as "
                        "HF_HUB_OFFLINE=1)")


def parse_percent(values: list[str]) -> list[float] | None:
    """Six percentages, or None for ``--percent auto``."""
    if [v.lower() for v in values] == ["auto"]:
        return None
    if len(values) != 6:
        raise ConfigError(f"--percent takes six numbers (wg wc cg cc hg hc) or auto, "
                          f"got {len(values)} values")
    try:
        return [float(v) for v in values]
    except ValueError:
        raise ConfigError(f"--percent takes six numbers or auto, got {' '.join(values)}") from None


def expert_percent(a) -> dict:
    """The policy fields of ``--experts-percent`` (none when it is not given)."""
    given = getattr(a, "experts_percent", None)
    if given is None:
        return {}
    return {"expert_gpu_percent": given[0], "expert_cpu_percent": given[1]}


def wants_plan(a) -> bool:
    return "auto" in ([v.lower() for v in a.percent] + [a.gpu_batch_size, a.num_gpu_batches])


def policy_from_args(a, cfg=None, lengths: tuple[int, int] | None = None,
                     weight_reads: int = 1) -> tuple[Placement, dict | None]:
    """(policy, plan): the policy the flags give, or with ``auto`` anywhere the optimizer's
    choice for ``cfg`` at ``lengths`` = (prompt, generated) tokens and its prediction
    (``weight_reads``: see :func:`~.planner.auto.search`)."""
    percent = parse_percent(a.percent)
    switches = dict(overlap=a.overlap, sep_layer=a.sep_layer, pin_weight=a.pin_weight,
                    cpu_cache_compute=a.cpu_cache_compute,
                    cpu_expert_compute=a.cpu_expert_compute, compress_weight=a.compress_weight,
                    compress_cache=a.compress_cache, direct_io=a.direct_io,
                    prefill_chunk=a.prefill_chunk, host_in_place=a.host_in_place,
                    **expert_percent(a))
    if not wants_plan(a):
        return Placement.from_percent(percent, gpu_batch_size=a.gpu_batch_size,
                                   num_gpu_batches=1 if a.num_gpu_batches is None
                                   else a.num_gpu_batches, **switches), None
    if cfg is None or lengths is None:
        raise ConfigError("auto placement needs the model and lengths; it is available in "
                          "`run`, or use `python -m flexgen_infinigen.optimize`")
    from ..kv import policy_class
    from ..planner.auto import check_possible, profile_for, search, summary
    from ..engine.loading import resolve_device, resolve_dtype

    policy_class(a.kv_policy, plannable=True)  # before a minute of profiling

    b = None if a.gpu_batch_size == "auto" else a.gpu_batch_size
    n = a.num_gpu_batches
    n = None if n == "auto" or (n is None and b is None) else (1 if n is None else n)
    item = resolve_dtype(a.dtype, resolve_device(a.device)).itemsize
    if a.hw is None:  # before a minute of profiling, what needs no profile
        check_possible(cfg, *lengths, item, a.offload_dir)
    hw = profile_for(a.hw, offload_dir=a.offload_dir)
    fraction = kv_policy_from_args(a).kv_fraction
    base = Placement(**switches)
    if percent is not None:
        base = Placement.from_percent(percent, **switches)
    best, _ = search(cfg, *lengths, hw, base, a.kv_policy, fraction, b, n, item,
                     fixed_placement=percent is not None, weight_reads=weight_reads)
    experts = best.experts_percent()
    print(f"auto policy ({hw.name} profile): --percent {' '.join(map(str, best.percent()))} "
          + (f"--experts-percent {' '.join(map(str, experts))} " if experts else "")
          + f"--gpu-batch-size {best.policy.gpu_batch_size} --num-gpu-batches "
          f"{best.policy.num_gpu_batches}" + (" --cpu-cache-compute" if
                                               best.policy.cpu_cache_compute else "")
          + (" --cpu-expert-compute" if best.policy.cpu_expert_compute else "")
          + f"; predicted {best.prediction['throughput']:.2f} tokens/s")
    return best.policy, {"hardware": hw.name, "hardware_source": hw.source, **summary(best)}


def check_policy_args(a) -> None:
    """Placement checks that need no weights (every command with policy flags runs them)."""
    parse_percent(a.percent)
    if expert_percent(a):
        Placement(**expert_percent(a)).validate()
    if a.offload_dir:
        offload_root(a.offload_dir)  # created, and checked writable, before any loading
    kv_policy_from_args(a).check_placement(a.cpu_cache_compute)


def check_sampling_args(a) -> SamplingConfig:
    """The sampling flags (``--temperature``, ``--top-p``, ``--repetition-penalty``), checked:
    argparse's ``float`` takes ``nan`` and ``inf``, which no comparison refuses."""
    for flag in ("temperature", "top_p", "repetition_penalty"):
        value = getattr(a, flag)
        if not math.isfinite(value):
            raise ConfigError(f"--{flag.replace('_', '-')} must be a finite number (got "
                              f"{value})")
    if not SEED_MIN <= a.seed <= SEED_MAX:  # what a torch generator takes
        raise ConfigError(f"--seed must be from {SEED_MIN} to {SEED_MAX} (got {a.seed})")
    return SamplingConfig(a.temperature, a.top_p, a.seed, a.repetition_penalty).validate()


def write_json(path: str | None, data: dict) -> None:
    """The ``--json FILE`` output of every command."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
        print(f"written to {path}")
