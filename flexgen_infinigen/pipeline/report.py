"""The pipeline's report: every rank's own figures, gathered on rank 0, and the run's
totals (bytes moved on every rank's links summed; KV statistics over all layers)."""
from __future__ import annotations

import resource

import torch

from ..memory.tiers import DEVICE, DISK, HOST, LINKS



def rank_summary(lm, gen, link, plan: dict | None) -> dict:
    """What one rank did: its layers, times, bytes over its own links and to other ranks."""
    engine, tiers = lm.engine, lm.tiers
    part = engine.part
    peak = torch.cuda.max_memory_allocated(tiers.device) if tiers.is_cuda else tiers.peak[DEVICE]
    stats = getattr(engine.kv_policy, "stats", None)
    return {
        "rank": link.rank, "layers": [part.start, part.stop], "embed": part.embed,
        "head": part.head, "device": str(tiers.device), "policy": lm.policy.to_dict(),
        "auto_plan": plan, "load_time_s": lm.load_time_s,
        "prefill_latency_s": gen.prefill_latency_s, "decode_latency_s": gen.decode_latency_s,
        "step_times": list(gen.step_times),
        "waiting_s": engine.debug.get("pipeline_wait_s", 0.0),
        "weights_by_tier_bytes": lm.weight_bytes_by_tier(),
        "bytes_moved": {k: dict(v) for k, v in tiers.bytes_moved.items()},
        "peak_memory_bytes": {DEVICE: peak, HOST: tiers.peak[HOST], DISK: tiers.peak[DISK],
                              "host_process_rss":
                              resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
        "between_ranks_bytes": link.traffic(),
        "kv_policy": engine.kv_policy.report(),
        "kv_counts": stats.tables() if stats is not None else None,
    }


def combine_reports(lm, gen, ranks: list[dict]) -> dict:
    """Rank 0's report of the whole run (its latencies are the pipeline's: it sees the first
    input and the last token) with ``pipeline.ranks``, one entry per rank."""
    from ..cli.report import build_report, link_bandwidth

    kv = lm.engine.kv_policy
    stats = getattr(kv, "stats", None)
    if stats is not None:  # rank 0 already counted its own layers
        for r in ranks[1:]:
            stats.absorb(r["kv_counts"])
    report = build_report(lm, gen, str(lm.tiers.device))
    moved = {link: {} for link in LINKS}
    for r in ranks:
        for link, kinds in r["bytes_moved"].items():
            for kind, n in kinds.items():
                moved[link][kind] = moved[link].get(kind, 0) + n
    placed = {t: sum(r["weights_by_tier_bytes"][t] for r in ranks) for t in (DEVICE, HOST, DISK)}
    seconds = sum(gen.step_times)
    report.update({
        "bytes_moved": moved, "weights_by_tier_bytes": placed,
        "link_bandwidth": link_bandwidth(moved, seconds, None),
        "load_time_s": max(r["load_time_s"] for r in ranks),
    })
    sent = sum(n for r in ranks for kinds in r["between_ranks_bytes"]["sent"].values()
               for n in kinds.values())
    report["pipeline"] = {"stages": len(ranks), "between_ranks_bytes": sent,
                          "ranks": [{k: v for k, v in r.items() if k != "kv_counts"}
                                    for r in ranks]}
    return report
