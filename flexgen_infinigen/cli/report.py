"""The run report: latency and throughput, sizes, peak memory per tier, bytes moved and the
bandwidth each link achieved (against this machine's saved profile, when there is one)."""
from __future__ import annotations

import math
import resource
import sys

import torch

from ..api import Generation, OffloadedLM
from ..models import family_of
from ..planner.hardware import HardwareProfile
from ..planner.measure import saved_profile
from ..engine import memory_plan
from ..memory.codes import can_compress
from ..engine.stages import LayerSlice
from ..memory.tiers import DEVICE, DISK, HOST, LINKS, Tiers
from .weight_formats import weight_formats

GB = 1e9


def build_report(lm: OffloadedLM, gen: Generation, device: str, extra: dict | None = None) -> dict:
    cfg, policy, tiers = lm.cfg, lm.policy, lm.tiers
    n, p, g = gen.num_prompts, gen.prompt_tokens, gen.generated_tokens
    total_latency = gen.prefill_latency_s + gen.decode_latency_s
    item = torch.tensor([], dtype=lm.engine.dtype).element_size()
    weight_elems = sum(math.prod(s) for s in family_of(cfg).weight_shapes(cfg).values())
    cache_bytes = cfg.kv_copies * cfg.num_layers * n * (p + g) * cfg.kv_dim * item
    hidden_bytes = n * p * cfg.hidden_size * item
    placed = lm.weight_bytes_by_tier()
    if tiers.is_cuda:
        peak_device = torch.cuda.max_memory_allocated(tiers.device)
    else:
        peak_device = tiers.peak[DEVICE]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    part = lm.engine.part if lm.engine.part != LayerSlice.whole(cfg) else None
    planned = memory_plan.plan(cfg, policy, lm.engine.dtype, gen.prompt_tokens,
                               gen.generated_tokens, kv=lm.engine.kv_policy, part=part,
                               device=lm.engine.tiers.device,
                               layouts=lm.weight_layouts)["total"]
    shapes = family_of(cfg).weight_shapes(cfg)
    formats = weight_formats(shapes, lm.weight_formats, lm.weight_layouts,
                             policy.compress_weight, lambda n: can_compress(shapes[n]))
    report = {
        "model": {"name": cfg.name, "architecture": cfg.architecture, "family": cfg.family,
                  "num_layers": cfg.num_layers,
                  "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
                  "num_kv_heads": cfg.num_kv_heads},
        "device": device,
        "dtype": str(lm.engine.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "policy": policy.to_dict(),
        "kv_policy": lm.engine.kv_policy.report(),
        "num_prompts": n, "prompt_len": p, "gen_len": g, "projected": gen.projected,
        "sizes_bytes": {"model": weight_elems * item, "cache": cache_bytes, "hidden": hidden_bytes},
        "weights_by_tier_bytes": placed,
        "weight_formats": formats,
        "prefill_latency_s": gen.prefill_latency_s,
        "prefill_throughput": n * p / max(gen.prefill_latency_s, 1e-9),
        "decode_latency_s": gen.decode_latency_s,
        "decode_throughput": (n * max(g - 1, 0) if gen.decode_tokens is None
                              else gen.decode_tokens) / max(gen.decode_latency_s, 1e-9),
        "total_latency_s": total_latency,
        "total_throughput": n * g / max(total_latency, 1e-9),
        "peak_memory_bytes": {DEVICE: peak_device, HOST: tiers.peak[HOST], DISK: tiers.peak[DISK],
                              "host_pinned_exact": tiers.pinned_bytes, "host_process_rss": rss},
        # what the memory plan expected each tier to hold (on a CPU device and host are one)
        "planned_memory_bytes": planned,
        "debug": {"host_syncs_per_step": list(lm.engine.debug["host_syncs_per_step"])},
        "bytes_moved": tiers.bytes_moved,
        "link_bandwidth": link_bandwidth(tiers.bytes_moved, sum(gen.step_times),
                                         _profile_of(tiers), gen.prefill_link_bytes,
                                         gen.prefill_latency_s),
        "load_time_s": lm.load_time_s,
        "texts": gen.texts,
        "prompt_texts": gen.prompt_texts,
        "token_ids": gen.token_ids,
    }
    report.update(extra or {})
    return report


def _profile_of(tiers: Tiers) -> HardwareProfile | None:
    """This machine's saved profile if it was measured on this kind of compute device (a
    profile of the GPU says nothing of a ``--device cpu`` run); never measures."""
    prof = saved_profile()
    return prof if prof is not None and prof.shared_memory != tiers.is_cuda else None


def link_bandwidth(bytes_moved: dict, seconds: float, profile: HardwareProfile | None,
                   prefill_bytes: dict | None = None, prefill_s: float = 0.0) -> dict:
    """Bytes/s each link achieved: the ledger's bytes (all kinds, since it was last reset, as
    ``bytes_moved`` reports them) over ``seconds``, the wall time of the generation's steps as
    run (under ``--cut-gen-len`` the steps run, not the projection); and, given the bytes of
    the prefill steps and their time, the decode steps' own rate. Links that moved nothing
    are left out. With a profile, each link's peak and ``share_of_peak``: the share of the
    run the link would have been busy at that peak."""
    links = {}
    decode_s = seconds - prefill_s
    for link in LINKS:
        moved = sum(bytes_moved[link].values())
        if moved == 0:
            continue
        rate = moved / max(seconds, 1e-9)
        decode = None
        if prefill_bytes is not None and decode_s > 0:
            decode = (moved - prefill_bytes.get(link, 0)) / decode_s
        row = {"bytes": moved, "bytes_per_s": rate, "decode_bytes_per_s": decode,
               "peak_bytes_per_s": None, "peak_from": None, "share_of_peak": None}
        if profile is not None:
            row["peak_from"], peak = profile.link_peak(link)
            row["peak_bytes_per_s"], row["share_of_peak"] = peak, rate / peak
        links[link] = row
    return {"seconds": seconds, "profile": profile.source if profile is not None else None,
            "links": links}


def _gb(n: float) -> str:
    return f"{n / GB:.3f} GB"


def print_report(r: dict, out=None, max_texts: int = 3) -> None:
    out = out or sys.stdout  # looked up per call: the stream may be replaced after import
    w = lambda s="": print(s, file=out)  # noqa: E731
    m = r["model"]
    w(f"model: {m['name']} ({m['architecture']}, {m['num_layers']} layers, "
      f"hidden {m['hidden_size']}) "
      f"on {r['device']} ({_threads(r.get('threads'))}), {r['dtype']}, "
      f"kv policy {r['kv_policy']['kv_policy']}")
    pol = r["policy"]
    w("policy: percent {} {} {} {} {} {}, gpu batch {} x {}, overlap {}, sep-layer {}, "
      "cpu-cache-compute {}, compress weight {} cache {}".format(
          pol["w_gpu_percent"], pol["w_cpu_percent"], pol["cache_gpu_percent"],
          pol["cache_cpu_percent"], pol["act_gpu_percent"], pol["act_cpu_percent"],
          pol["gpu_batch_size"], pol["num_gpu_batches"], pol["overlap"], pol["sep_layer"],
          pol["cpu_cache_compute"], pol["compress_weight"], pol["compress_cache"])
      + ("" if pol.get("expert_gpu_percent") is None else
         f", experts percent {pol['expert_gpu_percent']} {pol['expert_cpu_percent']}")
      + (", experts in CPU memory computed there" if pol.get("cpu_expert_compute") else ""))
    s = r["sizes_bytes"]
    placed = r["weights_by_tier_bytes"]
    tot = max(sum(placed.values()), 1)
    w(f"model size: {_gb(s['model'])}, cache size: {_gb(s['cache'])}, "
      f"hidden size (prefill): {_gb(s['hidden'])}")
    w("weights placed: " + ", ".join(f"{t} {_gb(n)} ({100 * n / tot:.1f}%)"
                                     for t, n in placed.items()))
    fmt = r.get("weight_formats")
    if fmt:
        w(f"weights: {fmt['summary']}")
        if fmt.get("compress_weight"):
            w(f"compress weight: {fmt['compress_weight']}")
    proj = " (projected from --cut-gen-len)" if r["projected"] else ""
    made = [len(t) for t in r.get("token_ids") or []]
    if made and min(made) < r["gen_len"]:  # some stopped at the end of their sequence or turn
        w(f"prompts: {r['num_prompts']} x {r['prompt_len']} tokens, generated up to "
          f"{r['gen_len']} each ({sum(made) / len(made):.1f} on average: some stopped at the "
          "end-of-sequence token)")
    else:
        w(f"prompts: {r['num_prompts']} x {r['prompt_len']} tokens, generated {r['gen_len']} "
          "each")
    w(f"prefill latency: {r['prefill_latency_s']:.3f} s, "
      f"prefill throughput: {r['prefill_throughput']:.2f} token/s")
    w(f"decode latency: {r['decode_latency_s']:.3f} s{proj}, "
      f"decode throughput: {r['decode_throughput']:.2f} token/s")
    w(f"total latency: {r['total_latency_s']:.3f} s, "
      f"total throughput: {r['total_throughput']:.2f} token/s")
    plan = r.get("auto_plan")
    if plan:
        w(f"auto plan ({plan['hardware']} profile) predicted {plan['predicted_throughput']:.2f} "
          f"token/s overall, decode step {plan['predicted_decode_step_s'] * 1e3:.1f} ms")
    pk = r["peak_memory_bytes"]
    plan = r["planned_memory_bytes"]
    w(f"peak memory: device {_gb(pk['device'])}, host {_gb(pk['host'])} "
      f"(process RSS {_gb(pk['host_process_rss'])}), disk {_gb(pk['disk'])}; "
      f"planned: device {_gb(plan['device'])}, host {_gb(plan['host'])}, "
      f"disk {_gb(plan['disk'])}")
    w("bytes moved:")
    kinds = list(next(iter(r["bytes_moved"].values())))
    w(f"  {'link':<14}" + "".join(f"{k:>14}" for k in kinds))
    for link in LINKS:
        row = r["bytes_moved"][link]
        w(f"  {link:<14}" + "".join(f"{_gb(row[k]):>14}" for k in kinds))
    bw = r["link_bandwidth"]
    if bw["links"]:
        w(f"link bandwidth over the {bw['seconds']:.3f} s of prefill and decode steps run"
          + (f", against the saved profile ({bw['profile']}):" if bw["profile"] else
             " (no saved profile of this machine: `python -m flexgen_infinigen.profile` "
             "gives each link's peak):"))
    for link, row in bw["links"].items():
        peak = ("" if row["peak_bytes_per_s"] is None else
                f"  {100 * row['share_of_peak']:.0f}% of {row['peak_bytes_per_s'] / GB:.2f} "
                f"GB/s peak ({row['peak_from']})")
        decode = ("" if row["decode_bytes_per_s"] is None else
                  f" (decode steps {row['decode_bytes_per_s'] / GB:.3f} GB/s)")
        w(f"  {link:<14}{row['bytes_per_s'] / GB:>9.3f} GB/s{peak}{decode}")
    if r.get("pipeline"):
        print_pipeline(r["pipeline"], w)
    for key, value in r["kv_policy"].items():
        if key == "kv_policy":
            continue
        if isinstance(value, list):
            value = " ".join(f"{v:.2f}" for v in value)
        elif isinstance(value, float):
            value = f"{value:.4g}"
        w(f"{key}: {value}")
    prompts = r.get("prompt_texts") or [""] * len(r["texts"])
    for prompt, text in list(zip(prompts, r["texts"]))[:max_texts]:
        if text:
            w("-" * 60)
            tail = prompt[-160:].replace("\n", " ")
            w(f"[prompt] ...{tail}" if len(prompt) > 160 else f"[prompt] {prompt}")
            w(f"[generated] {text}")
    if r["texts"] and any(r["texts"]):
        w("-" * 60)


def print_pipeline(p: dict, w) -> None:
    """The per-rank lines of a pipeline run's report."""
    w(f"pipeline: {p['stages']} stages, {p['between_ranks_bytes'] / GB:.4f} GB sent between "
      "ranks")
    w(f"  {'rank':<5}{'layers':<12}{'load s':>8}{'prefill s':>11}{'decode s':>10}"
      f"{'waiting s':>11}{'moved GB':>10}{'sent GB':>9}  placement (wg wc cg cc hg hc)")
    for r in p["ranks"]:
        layers = f"{r['layers'][0]}-{r['layers'][1] - 1}" + ("+E" if r["embed"] else "") + \
            ("+H" if r["head"] else "")
        moved = sum(n for kinds in r["bytes_moved"].values() for n in kinds.values())
        sent = sum(n for kinds in r["between_ranks_bytes"]["sent"].values()
                   for n in kinds.values())
        pol = r["policy"]
        percent = " ".join(f"{pol[k]:g}" for k in (
            "w_gpu_percent", "w_cpu_percent", "cache_gpu_percent", "cache_cpu_percent",
            "act_gpu_percent", "act_cpu_percent"))
        w(f"  {r['rank']:<5}{layers:<12}{r['load_time_s']:>8.2f}{r['prefill_latency_s']:>11.3f}"
          f"{r['decode_latency_s']:>10.3f}{r['waiting_s']:>11.3f}{moved / GB:>10.3f}"
          f"{sent / GB:>9.4f}  {percent}")


def _threads(n) -> str:
    return "threads unknown" if n is None else f"{n} thread{'' if n == 1 else 's'}"
