"""The placement optimizer: a linear program per batch shape, and a search over batch shapes.

For a fixed gpu-batch-size and num-gpu-batches, the fractions of weights, KV cache and
activations on each tier are the variables of a linear program (solved with PuLP's
CBC) that minimizes the predicted time of one block, prefill plus every decode step,
under each tier's memory limit. Its fractional solution becomes the whole
percentages the runtime takes, is checked against the runtime's own memory plan,
and is scored by :func:`~.cost.predict`; the best scored shape wins.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass

import pulp

from ..config import ConfigError
from ..placement import Placement
from ..engine import memory_plan
from .cost import decode_terms, disk_apart, overlaps, predict, prefill_terms
from .hardware import GB, HardwareProfile
from .workload import Workload, extra_device_bytes, fractions, mean_context

NAMES = ("wg", "wc", "wd", "cg", "cc", "cd", "hg", "hc", "hd", "eg", "ec", "ed")
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
NUM_BATCHES = (1, 2, 4, 8, 16)


@dataclass
class Plan:
    policy: Placement
    prediction: dict
    lp_fractions: dict

    def percent(self) -> list[int]:
        p = self.policy
        return [int(getattr(p, f)) for f in PERCENT_FIELDS]

    def experts_percent(self) -> list[int] | None:
        """``--experts-percent`` GPU CPU, or None when the experts follow the weights."""
        p = self.policy
        if p.expert_gpu_percent is None:
            return None
        return [int(p.expert_gpu_percent), int(p.expert_cpu_percent)]


def _coefficients(work: Workload, policy: Placement) -> dict[str, float]:
    """Bytes of weights (routed experts apart), cache and activations if all on one tier,
    and the fixed device need."""
    everything = dataclasses.replace(policy, w_gpu_percent=100, w_cpu_percent=0,
                                     cache_gpu_percent=100, cache_cpu_percent=0,
                                     act_gpu_percent=100, act_cpu_percent=0,
                                     expert_gpu_percent=100, expert_cpu_percent=0)
    need = memory_plan.plan(work.cfg, everything, work.torch_dtype, work.prompt_len,
                            work.gen_len)
    experts = need["experts"]["device"]
    return {"w": need["weights"]["device"] - experts, "e": experts,
            "c": need["kv_cache"]["device"],
            "h": need["activations"]["device"],
            # weights all on the device are read in place, but the placements searched here
            # offload some: two stages of them are in flight
            "fixed": need["working_set_device"] + need["stage_copies_if_offloaded"]
            + extra_device_bytes(work, policy)}


@functools.lru_cache(maxsize=1)
def solver():
    """CBC: PuLP's bundled binary (PuLP < 4), else a CBC found on the system."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        bundled = getattr(pulp, "PULP_CBC_CMD", None)
        if bundled is not None and bundled(msg=False).available():
            return bundled(msg=False)
    coin = pulp.COIN_CMD(msg=False)
    if coin.available():
        return coin
    raise ConfigError("the optimizer needs the CBC solver: `pip install 'pulp<4'` (which bundles "
                      "it) or install coinor-cbc")


def solve_placement(work: Workload, policy: Placement, hw: HardwareProfile,
                    cached: bool = False) -> dict | None:
    """LP fractions minimizing predicted block time for ``policy``'s batch shape, or None.

    ``cached``: price disk reads as page-cache reads (whether they will be depends on the
    placement, so the optimizer solves both ways and lets :func:`predict` judge)."""
    size = _coefficients(work, policy)
    if size["fixed"] > hw.gpu_mem:
        return None  # the working space alone does not fit
    prob = pulp.LpProblem("placement", pulp.LpMinimize)
    x = {n: prob.add_variable(n, 0, 1) for n in NAMES}
    for group in "wche":
        prob += x[group + "g"] + x[group + "c"] + x[group + "d"] == 1
    if not size["e"]:  # a dense model: the (empty) expert share follows the weights
        for tier in "gcd":
            prob += x["e" + tier] == x["w" + tier]
    elif policy.expert_gpu_percent is not None:  # --experts-percent given: kept as given
        for tier, v in zip("gcd", policy.expert_split):
            prob += x["e" + tier] == v
    dev = size["fixed"] + sum(size[g] * x[g + "g"] for g in "wche")
    host = sum(size[g] * x[g + "c"] for g in "wche")
    disk = sum(size[g] * x[g + "d"] for g in "wche")
    if hw.shared_memory:
        prob += dev + host <= min(hw.gpu_mem, hw.cpu_mem)
    else:
        prob += dev <= hw.gpu_mem
        prob += host <= hw.cpu_mem
    prob += disk <= hw.disk_mem
    pre = prefill_terms(work, policy, hw, x, cached)
    dec = decode_terms(work, policy, hw, x, mean_context(work), cached)
    steps = max(work.gen_len - 1, 0)
    if overlaps(policy, hw):
        t_pre, t_dec = prob.add_variable("t_prefill", 0), prob.add_variable("t_decode", 0)
        for term in pre.values():
            prob += t_pre >= term
        for term in dec.values():
            prob += t_dec >= term
        prob += t_pre + steps * t_dec
    elif disk_apart(policy, hw):  # disk reads beside the sum of the rest
        t_pre, t_dec = prob.add_variable("t_prefill", 0), prob.add_variable("t_decode", 0)
        for t, terms in ((t_pre, pre), (t_dec, dec)):
            prob += t >= terms["disk_read"]
            prob += t >= pulp.lpSum(v for k, v in terms.items() if k != "disk_read")
        prob += t_pre + steps * t_dec
    else:
        prob += pulp.lpSum(pre.values()) + steps * pulp.lpSum(dec.values())
    status = prob.solve(solver())
    if pulp.LpStatus[status] != "Optimal":
        return None
    return {n: min(1.0, max(0.0, v.value() or 0.0)) for n, v in x.items()}


def _round_pair(g: float, c: float, mode: int) -> tuple[int, int]:
    """Whole percentages for a (GPU, CPU) pair. Mode 0 floors the GPU share and the GPU+CPU
    sum, 1 rounds both, 2 sends whatever leaves the GPU to the CPU, 3 floors each share
    (what is left over goes to disk)."""
    gp = math.floor(100 * g + 1e-6)
    if mode == 1:
        gp = round(100 * g)
        return gp, min(100 - gp, round(100 * c))
    if mode == 2:
        return gp, 100 - gp - math.floor(100 * (1 - g - c) + 1e-6)
    if mode == 3:
        return gp, math.floor(100 * c + 1e-6)
    return gp, math.floor(100 * (g + c) + 1e-6) - gp


PERCENT_FIELDS = ("w_gpu_percent", "w_cpu_percent", "cache_gpu_percent", "cache_cpu_percent",
                  "act_gpu_percent", "act_cpu_percent")
EXPERT_FIELDS = ("expert_gpu_percent", "expert_cpu_percent")


def _candidates(frac: dict, groups: str = "wch") -> list[list[int]]:
    """Whole-percentage placements near the LP's fractions, two numbers per group in
    ``groups`` (``e``: the routed experts, after the six of ``--percent``).

    Roundings of each (GPU, CPU) pair, with the GPU share stepped down a little in case
    rounding overfills it, and each group moved whole to one of the tiers the LP used: a
    tensor split across tiers is joined after every read, which the LP does not price.
    """
    per_group = []
    for group in groups:
        g, c, d = frac[group + "g"], frac[group + "c"], frac[group + "d"]
        gp, cp = _round_pair(g, c, 0)
        if group == "e":  # the experts' share: floored, or whole on one tier (the product of
            options = {(gp, cp)}  # the four groups' options is what the candidates cost)
        else:
            options = {_round_pair(g, c, mode) for mode in (0, 1, 2, 3)}
            options |= {(max(0, gp - shift), cp + min(shift, gp)) for shift in (2, 10)}
        for share, whole in ((g, (100, 0)), (c, (0, 100)), (d, (0, 0))):
            if share > 0.005:
                options.add(whole)
        per_group.append(sorted(options))
    out = [[]]
    for options in per_group:
        out = [pct + list(pair) for pct in out for pair in options]
    return out


def to_policy(frac: dict, policy: Placement, work: Workload,
              hw: HardwareProfile) -> Placement | None:
    """The predicted-fastest whole-percentage policy near the LP fractions that fits; a MoE
    model's routed experts placed apart (``--experts-percent``) unless the policy fixed it."""
    best, best_t = None, math.inf
    apart = work.cfg.num_experts > 0 and policy.expert_gpu_percent is None
    for pct in _candidates(frac, "wche" if apart else "wch"):
        cand = dataclasses.replace(policy, **dict(zip(PERCENT_FIELDS + EXPERT_FIELDS, pct)))
        pred = predict(work, cand, hw)
        if pred["fits"] and pred["total_s"] < best_t:
            best, best_t = cand, pred["total_s"]
    return best


def smallest_need(work: Workload, policy: Placement) -> tuple[float, float]:
    """(bytes across all tiers, bytes the device needs) at batch 1 with everything placed."""
    one = dataclasses.replace(policy, gpu_batch_size=1, num_gpu_batches=1)
    size = _coefficients(work, one)
    return size["w"] + size["e"] + size["c"] + size["h"] + size["fixed"], size["fixed"]


def check_capacity(work: Workload, hw: HardwareProfile, base: Placement) -> None:
    """Fail before any search when not even one sequence fits, naming the memory it needs."""
    total, device = smallest_need(work, base)
    if device > hw.gpu_mem:
        raise ConfigError(
            f"{work.cfg.name} at prompt {work.prompt_len} + {work.gen_len} tokens needs at least "
            f"{device / GB:.2f} GB of device memory for one sequence (working space), but the "
            f"profile gives {hw.gpu_mem / GB:.2f} GB; use a device with more memory "
            "(--gpu-mem) or shorter lengths")
    have = (hw.gpu_mem if hw.shared_memory else hw.gpu_mem + hw.cpu_mem) + hw.disk_mem
    # placements are whole percentages: rounding the GPU and the CPU shares down can each push
    # up to one percent of the model and cache to disk
    slack = 0.02 * (total - device)
    if total + slack > have:
        raise ConfigError(
            f"{work.cfg.name} at prompt {work.prompt_len} + {work.gen_len} tokens does not fit: "
            f"one sequence needs {total / GB:.1f} GB across the tiers, which hold "
            f"{have / GB:.1f} GB; the smallest memory that fits is about "
            f"{(total + slack) / GB:.1f} GB in all, "
            f"e.g. --disk-mem {math.ceil((total + slack - have + hw.disk_mem) / GB)} "
            "(or an --offload-dir on a bigger disk)")


def optimize(work: Workload, hw: HardwareProfile, base: Placement | None = None,
             batch_sizes=BATCH_SIZES, num_batches=NUM_BATCHES, fixed_placement: bool = False,
             progress=None) -> tuple[Plan, list[Plan]]:
    """The predicted-fastest policy, and every feasible candidate scored (best first).

    With a policy that can attend where the cache is (the full cache), attention on the CPU
    (``--cpu-cache-compute``) is tried as well; with a mixture-of-experts model on a GPU
    machine, multiplying the experts held in CPU memory there (``--cpu-expert-compute``).
    With ``fixed_placement`` only the batch shape is searched and ``base``'s percentages
    are kept (``--percent`` given with ``--gpu-batch-size auto``).
    """
    work = work.validate()
    base = base or Placement()
    check_capacity(work, hw, base)
    flags = [base.cpu_cache_compute]
    if work.kv.attends_on_cpu and not (base.cpu_cache_compute or fixed_placement):
        flags.append(True)
    # routed experts in CPU memory multiplied there at decode, or fetched (MoE, with a GPU)
    expert_flags = [base.cpu_expert_compute]
    if (work.cfg.num_experts and not hw.shared_memory and not base.cpu_expert_compute
            and not fixed_placement):
        expert_flags.append(True)
    shapes = [(b, n, ccc, cec) for b in batch_sizes for n in num_batches for ccc in flags
              for cec in expert_flags]
    plans = []
    for b, n, ccc, cec in (progress(shapes) if progress else shapes):
        trial = dataclasses.replace(base, gpu_batch_size=b, num_gpu_batches=n,
                                    cpu_cache_compute=ccc, cpu_expert_compute=cec)
        if fixed_placement:
            pred = predict(work, trial, hw)
            if pred["fits"]:
                plans.append(Plan(trial, pred, fractions(trial)))
            continue
        found = []
        for cached in (False, True):
            frac = solve_placement(work, trial, hw, cached)
            policy = None if frac is None else to_policy(frac, trial, work, hw)
            if policy is not None:
                found.append(Plan(policy, predict(work, policy, hw), frac))
        if found:
            plans.append(max(found, key=lambda p: p.prediction["throughput"]))
    if not plans:
        shapes = ", ".join(f"{b}x{n}" for b in batch_sizes for n in num_batches)
        raise ConfigError(
            f"no policy for {work.cfg.name} fits the memory limits at the batch shapes tried "
            f"({shapes}); try smaller or auto --gpu-batch-size/--num-gpu-batches, or more "
            "memory (--gpu-mem, --cpu-mem, --disk-mem)")
    plans.sort(key=lambda p: -p.prediction["throughput"])
    return plans[0], plans
