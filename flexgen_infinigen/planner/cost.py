"""The cost model: predicted prefill and decode time, throughput and memory for a policy.

A step's time is split by resource (host->device link, device->host, disk reads, disk
writes, host gather, device compute, CPU compute). Each term is linear in the
placement fractions, so the optimizer's linear program (:mod:`.lp`) minimizes the same
terms that :func:`predict` reports. With overlap on a machine whose copies run beside
compute a step takes as long as its slowest resource; otherwise it is their sum.
:func:`predict` adds what is not linear in the fractions (:func:`step_costs`, and
disk reads served from the page cache) and is what ranks the optimizer's candidates.
"""
from __future__ import annotations

import math

from ..placement import Placement
from ..kernels.attention import score_rows
from .hardware import HardwareProfile
from .workload import Sizes, Workload, expert_coverage, fits, fractions, mean_context, memory_needs


def _weights_time(hw: HardwareProfile, sz: Sizes) -> float:
    """Seconds to bring every weight tensor of one step over the host link, one copy each."""
    return sum(hw.seconds("h2d", n) for n in sz.weight_tensors)


def _matmul(hw: HardwareProfile, m: float, params: float, on_cpu: bool = False) -> float:
    return 2 * m * params / hw.flops(m, on_cpu)


def _expert_products(cfg, sz, hw: HardwareProfile, calls: int, tokens: int,
                     on_cpu: bool = False) -> float:
    """Seconds for ``calls`` products of ``tokens`` tokens each over the experts they route
    to, in every MoE layer (each expert's codes read once a call)."""
    per_call = expert_coverage(cfg, tokens)
    return calls * sz.moe_layers * _matmul(hw, tokens * cfg.experts_per_token / per_call,
                                           per_call * sz.expert_params, on_cpu)


def expert_terms(work: Workload, policy: Placement, hw: HardwareProfile, x: dict, tokens: int,
                 cached: bool = False, decode: bool = False) -> dict:
    """Seconds per resource for the routed experts of one step of the block, whose GPU
    batches of ``tokens`` tokens each (the block's ``num_gpu_batches`` of them) read the
    union of their experts once (:func:`~.workload.expert_coverage` of all the block's
    tokens; an expert off the device is fetched by the first token that picks it and kept
    for the stage). A prompt's GPU batches multiply their own routed rows; a ``decode``
    step multiplies the block's tokens together (the engine's MoE stage runs once a block).
    Linear in the expert fractions ``x["eg"]``, ``x["ec"]``, ``x["ed"]``; all zero for a
    dense model."""
    cfg, sz = work.cfg, Sizes.of(work, policy)
    zero = {k: 0.0 for k in ("h2d", "disk_read", "compute")}
    if not sz.moe_layers:
        return zero
    n = policy.num_gpu_batches
    read = sz.expert_step_bytes(cfg, n * tokens)  # as stored, per step of the block
    pieces = 3 * sz.moe_layers * expert_coverage(cfg, n * tokens)  # one copy per matrix
    off = x["ec"] + x["ed"]
    r = work.weight_reads
    compute = _expert_products(cfg, sz, hw, 1, n * tokens) if decode \
        else _expert_products(cfg, sz, hw, n, tokens)
    if policy.compress_weight:  # expanded from 4 bits where they are multiplied
        compute += r * hw.seconds("dequant", sz.expert_step_bytes(cfg, n * tokens, raw=True),
                                  pieces)
    terms = {"h2d": r * off * hw.seconds("h2d", read, pieces),
             "disk_read": r * x["ed"] * _disk_read(hw, read, pieces, cached, policy.direct_io),
             "compute": compute}
    if decode and policy.cpu_expert_compute:
        # the experts in CPU memory are multiplied there, not fetched: the CPU's products
        # join the step's compute (the next layer waits for them), and every MoE layer
        # sends the block's rows and routing to the host and the sum back
        rows = n * tokens * sz.moe_layers
        item = work.dtype_bytes
        terms["h2d"] = r * x["ed"] * hw.seconds("h2d", read, pieces) + hw.seconds(
            "h2d", rows * cfg.hidden_size * item, sz.moe_layers)
        terms["d2h"] = hw.seconds("d2h", rows * (cfg.hidden_size * item
                                                 + cfg.experts_per_token * (item + 8)),
                                  3 * sz.moe_layers)
        terms["compute"] = (1 - x["ec"]) * compute + x["ec"] * _expert_products(
            cfg, sz, hw, 1, n * tokens, on_cpu=True)
    return terms


def expert_cpu_seconds(work: Workload, policy: Placement, hw: HardwareProfile,
                       tokens: int) -> float:
    """Seconds for the CPU to multiply one decode step's routed experts where they are held
    in CPU memory, at the profile's measured CPU matmul rate (the block's GPU batches of
    ``tokens`` rows in one product, spread over the experts they route to): what computing
    experts on the host would cost instead of fetching them (``expert_terms``)."""
    cfg, sz = work.cfg, Sizes.of(work, policy)
    if not sz.moe_layers:
        return 0.0
    return _expert_products(cfg, sz, hw, 1, policy.num_gpu_batches * tokens, on_cpu=True)


def _add(terms: dict, extra: dict) -> dict:
    for key, v in extra.items():
        terms[key] = terms[key] + v
    return terms


def prefill_terms(work: Workload, policy: Placement, hw: HardwareProfile, x: dict,
                  cached: bool = False) -> dict:
    """Seconds per resource for the prompt pass of one block (linear in the fractions ``x``)."""
    cfg, sz, item = work.cfg, Sizes.of(work, policy), work.dtype_bytes
    b, n, p, layers = policy.gpu_batch_size, policy.num_gpu_batches, work.prompt_len, \
        work.cfg.num_layers
    hid = n * b * p * cfg.hidden_size * item * sz.num_stages
    kv_new = n * b * p * sz.kv_token * layers
    off_w, off_c, off_h = x["wc"] + x["wd"], x["cc"] + x["cd"], x["hc"] + x["hd"]
    scores = 4 * b * cfg.num_heads * p * p  # bytes of float32 scores (in query chunks)
    # norms, residuals, rotary, activation: about a dozen passes over the hidden states and
    # four over the MLP's intermediate ones
    passes = b * p * (12 * cfg.hidden_size + 4 * cfg.intermediate_size) * item
    chunks = math.ceil(p / score_rows(b, cfg.num_heads, p))
    compute = n * (layers * (_matmul(hw, b * p, sz.layer_params)
                             + hw.seconds("prefill_attention", scores, chunks)
                             + hw.seconds("device_copy", passes, 16)
                             + hw.overhead(cfg.family))
                   + _matmul(hw, b, sz.head_params))
    r = work.weight_reads
    if policy.compress_weight:
        compute += r * sum(hw.seconds("dequant", n * sz.weights_step_raw / sz.weights_step)
                           for n in sz.weight_tensors)
    if policy.compress_cache:
        compute += hw.seconds("dequant", n * b * p * sz.kv_token_raw * layers,
                              cfg.kv_copies * n * layers)
    # K and V are separate copies (one where the values are the keys)
    copies, kv_copies = n * sz.num_stages, cfg.kv_copies * n * layers
    terms = {"h2d": r * off_w * _weights_time(hw, sz) + off_h * hw.seconds("h2d", hid, copies),
            "d2h": off_c * hw.seconds("d2h", kv_new, kv_copies)
            + off_h * hw.seconds("d2h", hid, copies),
            "disk_read": x["hd"] * _disk_read(hw, hid, copies, cached, policy.direct_io)
            + r * x["wd"] * sum(_disk_read(hw, t, 1, cached, policy.direct_io)
                                for t in sz.weight_tensors),
            "disk_write": (x["cd"] * kv_new + x["hd"] * hid) / hw.disk_write_bw,
            "gather": 0.0, "compute": compute, "cpu_compute": 0.0}
    return _add(terms, expert_terms(work, policy, hw, x, b * p, cached))


def _disk_read(hw: HardwareProfile, total: float, pieces: float, cached: bool,
               direct: bool = False) -> float:
    """Seconds to read ``total`` bytes from the disk tier as ``pieces`` equal reads: from the
    page cache, or cold at the profiled rate for that read size, with O_DIRECT or buffered
    (the profile's one figure when it has no table by size)."""
    if cached:
        return hw.seconds("page_cache_read", total, pieces)
    table = "disk_read" if direct else "disk_buffered_read"
    if table in hw.rates:
        return hw.seconds(table, total, pieces)
    return total / hw.disk_read_bw


def decode_terms(work: Workload, policy: Placement, hw: HardwareProfile, x: dict,
                 context: float, cached: bool = False) -> dict:
    """Seconds per resource for one decode step of one block at ``context`` cached tokens."""
    cfg, sz, item = work.cfg, Sizes.of(work, policy), work.dtype_bytes
    b, n, layers = policy.gpu_batch_size, policy.num_gpu_batches, cfg.num_layers
    f = work.fetch_fraction(context)
    hid = n * b * cfg.hidden_size * item * sz.num_stages
    # cached bytes read, as stored, and the recurrent layers' states (read whole)
    ctx = n * b * (context * sz.kv_token * layers * f + sz.state_row)
    ctx_raw = n * b * (context * sz.kv_token_raw * layers * f + sz.state_row)
    kv_new = n * b * (sz.kv_token * layers + sz.state_row)  # and the states written back
    off_w, off_c, off_h = x["wc"] + x["wd"], x["cc"] + x["cd"], x["hc"] + x["hd"]
    # K and V are separate copies (one where the values are the keys)
    copies, kv_copies = n * sz.num_stages, cfg.kv_copies * n * layers
    r = work.weight_reads
    h2d = r * off_w * _weights_time(hw, sz) + off_h * hw.seconds("h2d", hid, copies)
    d2h = off_c * hw.seconds("d2h", kv_new, kv_copies) + off_h * hw.seconds("d2h", hid, copies)
    compute = n * (layers * (_matmul(hw, b, sz.layer_params) + hw.overhead(cfg.family))
                   + _matmul(hw, b, sz.head_params))
    cpu_compute = gather = 0.0
    if policy.cpu_cache_compute:  # q, k, v to the host, the output back, attention there
        h2d += hw.seconds("h2d", n * layers * b * cfg.hidden_size * item, n * layers)
        d2h += hw.seconds("d2h", n * layers * b * (cfg.hidden_size + cfg.kv_copies * cfg.kv_dim)
                          * item,
                          3 * n * layers) + x["cg"] * hw.seconds("d2h", ctx, kv_copies)
        cpu_compute = hw.seconds("cpu_attention", ctx_raw, n * layers)
    else:
        h2d += off_c * hw.seconds("h2d", ctx, kv_copies)
        compute += hw.seconds("attention", ctx_raw, n * layers)
    if policy.compress_weight:
        compute += r * sum(hw.seconds("dequant", n * sz.weights_step_raw / sz.weights_step)
                           for n in sz.weight_tensors)
    if policy.compress_cache:
        compute += hw.seconds("dequant", ctx_raw, kv_copies)
    extra = work.kv.decode_work(cfg, b, context, item)  # what the KV policy adds
    if extra.maps_rows and "mapped_rows" in hw.rates and not policy.cpu_cache_compute:
        # the GPU reads the chosen rows from pinned memory itself: no gather, a slower link
        h2d += off_c * (hw.seconds("mapped_rows", ctx, kv_copies)
                        - hw.seconds("h2d", ctx, kv_copies))
    elif extra.gathers_rows:  # its chosen rows are gathered on the host before the link
        gather = off_c * hw.seconds("host_gather", 2 * ctx, kv_copies)
    if extra.layers:
        compute += n * extra.layers * (
            _matmul(hw, b, extra.matmul_params)
            + (hw.overhead(cfg.family, extra.overhead) if extra.overhead else 0.0)
            + hw.seconds("attention", extra.scan_bytes))
    disk_read = x["cd"] * _disk_read(hw, ctx, kv_copies, cached, policy.direct_io) \
        + x["hd"] * _disk_read(hw, hid, copies, cached, policy.direct_io) \
        + r * x["wd"] * sum(_disk_read(hw, t, 1, cached, policy.direct_io)
                            for t in sz.weight_tensors)
    terms = {"h2d": h2d, "d2h": d2h, "disk_read": disk_read,
             "disk_write": (x["cd"] * kv_new + x["hd"] * hid) / hw.disk_write_bw,
             "gather": gather, "compute": compute, "cpu_compute": cpu_compute}
    return _add(terms, expert_terms(work, policy, hw, x, b, cached, decode=True))


def step_costs(work: Workload, policy: Placement, hw: HardwareProfile,
               context: float | None) -> float:
    """Device seconds per decode step that switch on with a placement rather than grow with
    it: fixed costs of offloaded reads, and copying the device part of a tensor split across
    tiers into the buffer its other parts are read into. They are not
    linear in the fractions, so the linear program leaves them out; :func:`predict` adds
    them, and the optimizer's rounding compares candidates with :func:`predict`.
    ``context`` None is the prefill, which reads no cache."""
    cfg, sz = work.cfg, Sizes.of(work, policy)
    n, layers = policy.num_gpu_batches, cfg.num_layers
    w, c = policy.weight_split, policy.cache_split
    t = 0.0
    r = work.weight_reads
    if w[0] < 1:
        t += r * layers * hw.overhead(cfg.family, "weights_offload")
    if sum(v > 0 for v in w) > 1:  # a split tensor is read into one buffer: the device
        t += r * sum(hw.seconds("device_copy", w[0] * v)  # part copies
                     for v in sz.weight_tensors)
    if context is None:
        return t
    per = (policy.gpu_batch_size * context * sz.kv_token_raw * work.fetch_fraction(context)
           / cfg.kv_copies)  # one of K and V
    if c[0] < 1 or policy.cpu_cache_compute:
        # a loaded (not resident) cache is joined with the new token's keys and values
        t += cfg.kv_copies * n * layers * hw.seconds("device_copy", per)
        if not policy.cpu_cache_compute:
            t += n * layers * hw.overhead(cfg.family, "kv_offload")
    if sum(v > 0 for v in c) > 1:
        t += cfg.kv_copies * n * layers * hw.seconds("device_copy", c[0] * per)
    return t


def overlaps(policy: Placement, hw: HardwareProfile) -> bool:
    overlap = hw.copies_overlap_compute if policy.overlap is None else policy.overlap
    return bool(overlap and hw.copies_overlap_compute)


def disk_apart(policy: Placement, hw: HardwareProfile) -> bool:
    """On a machine whose copies take the compute cores, overlapped disk reads still run
    beside the rest: a reader waits on the disk, not on a core."""
    overlap = policy.uses_disk if policy.overlap is None else policy.overlap
    return bool(overlap and not hw.copies_overlap_compute and policy.uses_disk)


def combine(terms: dict, overlapped: bool, disk_beside: bool = False) -> float:
    """A step's seconds from its terms: the slowest resource when everything overlaps; the
    disk reads against the sum of the rest when only they do; else the sum."""
    if overlapped:
        return max(terms.values())
    if disk_beside:
        return max(terms["disk_read"], sum(v for k, v in terms.items() if k != "disk_read"))
    return sum(terms.values())


def predict(work: Workload, policy: Placement, hw: HardwareProfile) -> dict:
    """Predicted times (s), throughput (tokens/s) and memory per tier (bytes) for one block."""
    work = work.validate()
    policy = policy.validate()
    x = fractions(policy)
    need = memory_needs(work, policy)
    # offloaded files that fit in spare host memory are read back from the page cache
    # (unless the reads bypass it)
    room = hw.cpu_mem if hw.page_cache_mem is None else hw.page_cache_mem
    spare = room - need["host"] - (need["device"] if hw.shared_memory else 0)
    cached = need["disk"] <= spare and not policy.direct_io
    overlapped, beside = overlaps(policy, hw), disk_apart(policy, hw)
    pre = prefill_terms(work, policy, hw, x, cached)
    dec = decode_terms(work, policy, hw, x, mean_context(work), cached)
    dec["compute"] += step_costs(work, policy, hw, mean_context(work))
    pre["compute"] += step_costs(work, policy, hw, None)
    prefill_s, step_s = combine(pre, overlapped, beside), combine(dec, overlapped, beside)
    decode_s = step_s * max(work.gen_len - 1, 0)
    tokens = policy.block_size * work.gen_len
    layers = work.cfg.num_layers
    sz, b = Sizes.of(work, policy), policy.gpu_batch_size
    experts = {"moe_layers": sz.moe_layers,
               "coverage_per_step": expert_coverage(work.cfg, policy.block_size),
               "bytes_per_step": sz.expert_step_bytes(work.cfg, policy.block_size),
               "off_device_bytes_per_step":
                   (x["ec"] + x["ed"]) * sz.expert_step_bytes(work.cfg, policy.block_size),
               "cpu_compute_s": expert_cpu_seconds(work, policy, hw, b)} \
        if sz.moe_layers else None
    return {"prefill_s": prefill_s, "decode_step_s": step_s, "decode_s": decode_s,
            "total_s": prefill_s + decode_s,
            "throughput": tokens / (prefill_s + decode_s),
            "decode_throughput": policy.block_size / step_s,
            "decode_layer_s": step_s / layers, "prefill_layer_s": prefill_s / layers,
            "prefill_terms_s": pre, "decode_terms_s": dec, "overlapped": overlapped,
            "disk_from_page_cache": cached and need["disk"] > 0,
            "memory_bytes": need, "fits": fits(need, hw), "experts": experts}
