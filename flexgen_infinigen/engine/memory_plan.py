"""How many bytes a policy needs on each tier, checked against what the machine has.

The check runs before any weight is placed, so an impossible policy fails in a
second with one line that says which tier is short and what to change.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig
from ..models import family_of
from ..models.moe import is_expert_weight, is_moe_layer
from ..placement import Placement
from ..kernels.attention import FUSED_ROWS
from ..kv.recurrent import state_bytes
from ..memory.codes import can_compress, stored_bytes
from ..memory.offload_dir import remove_stale_folders
from ..memory.split_tensor import split_sizes
from ..memory.tiers import DEVICE, DISK, HOST, TIERS

GIB = 1 << 30


def _split_bytes(shape, split_dim: int, fractions, itemsize: int, compress: bool,
                 layout: tuple[int, int] | None = None) -> list[int]:
    sizes = split_sizes(shape[split_dim], fractions)
    out = []
    for size in sizes:
        seg = list(shape)
        seg[split_dim] = size
        # compressible is decided on the whole tensor's shape (its segments share the groups)
        out.append(stored_bytes(seg, itemsize, compress and can_compress(tuple(shape)),
                                layout))
    return out


ALLOCATOR_HEADROOM = 0.05  # of the device total: blocks the per-stream caching pools hold


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


PREFILL_CHUNK_BYTES = 256 << 20  # one prefill chunk's MLP temporaries stay near this


def prefill_chunk(cfg: ModelConfig, policy: Placement, item: int, prompt_len: int) -> int:
    """Prompt tokens a layer's MLP takes at a time: ``--prefill-chunk``, else as many as keep
    the chunk's widest temporaries (gate, up, their product, the output) near
    ``PREFILL_CHUNK_BYTES``, at least 16; never more than the prompt."""
    if policy.prefill_chunk:
        return max(1, min(prompt_len, policy.prefill_chunk))
    width = max(cfg.intermediate_size, cfg.hidden_size)
    tokens = PREFILL_CHUNK_BYTES // (4 * policy.gpu_batch_size * width * item)
    return max(1, min(prompt_len, max(16, tokens)))


def prompt_activation_bytes(cfg: ModelConfig, batch: int, prompt_len: int, item: int) -> int:
    """What a layer holds for the whole prompt while it runs: the hidden state in and out, the
    normed input, q (before and after RoPE), k and v, attention's output, and the o_proj
    product (the widest prompt-sized tensors alive at once in the attention stage)."""
    per_token = 4 * cfg.hidden_size + 3 * cfg.q_dim + 4 * cfg.kv_dim
    return batch * prompt_len * per_token * item


def _packed_in_place(policy: Placement, device: torch.device | None, coded: bool = False) -> bool:
    """Weight codes that a CPU multiplies where they are stored (``cpu_layers.linear_q4``):
    the dense weights all on the compute device, which is the CPU (routed experts are
    counted apart: :func:`_expert_copies`). No stage of them is ever expanded; a product
    the kernel does not take expands one matrix, for that product only. ``coded``: the
    weights came as a quantized file's codes."""
    return (device is not None and device.type == "cpu" and (policy.compress_weight or coded)
            and policy.weight_split[0] >= 1.0)


def one_stage_a_layer(cfg: ModelConfig, policy: Placement, device: torch.device,
                      layouts: dict | None = None) -> bool:
    """Whether ``sep_layer=None`` resolves to one schedule stage a layer: on a CPU, every
    dense weight on the compute device and read where it is (floats, or codes the kernels
    multiply in place), no routed experts (a MoE layer's MLP stage runs once a block). Then
    no stage's weights load, so splitting a layer overlaps nothing and only adds a stage's
    bookkeeping to every step; the working set is the same either way."""
    coded = bool(layouts) or policy.compress_weight
    return (device.type == "cpu" and policy.weight_split[0] >= 1.0 and cfg.num_experts == 0
            and (not coded or _packed_in_place(policy, device, bool(layouts))))


def _expert_copies(cfg: ModelConfig, policy: Placement, device: torch.device | None,
                   layouts: dict, item: int, per_layer: int) -> int:
    """The most bytes of one layer's routed experts a stage holds copied while it computes
    (a prefill may route to every expert; each routed one is kept for the whole stage). On
    a CPU, 4-bit experts (a quantized file's codes, or ``--compress-weight``) in its memory
    are multiplied where they are and those on disk are read as codes; elsewhere an expert
    off the device comes as floats (a GPU expands codes as it reads them)."""
    if not cfg.num_experts:
        return 0
    dev, host, disk = split_sizes(cfg.num_experts, policy.expert_split)
    coded = policy.compress_weight or any(is_expert_weight(n) for n in layouts)
    cpu = device is not None and device.type == "cpu"
    if cpu and coded:
        copied = disk + host * (not policy.host_in_place)
        layout = next((lay for n, lay in layouts.items() if is_expert_weight(n)), None)
        shapes = [s for n, s in _weight_shapes(cfg).items()
                  if is_expert_weight(n) and n.startswith(f"layers.{_moe_layer(cfg)}.")
                  and ".experts.0." in n]
        each = sum(stored_bytes(s, item, True, layout) for s in shapes)
        return copied * each
    copied = host + disk + (dev if coded and not cpu else 0)
    return copied * per_layer // cfg.num_experts * item


def _moe_layer(cfg: ModelConfig) -> int:
    return next(i for i in range(cfg.num_layers) if is_moe_layer(cfg, i))


def _expanded_matrix(cfg: ModelConfig, shapes: dict, policy: Placement, item: int,
                     head: bool) -> int:
    """The largest weight matrix expanded from 4 bits at once where they are multiplied in
    place: a layer's (a prefill's many rows go through torch), and the output table when
    the head's rows are more than the kernel takes or the kernel cannot run here."""
    from ..kernels.cpu_kernels import library
    from ..kernels.layers import MAX_LINEAR_ROWS

    layer = max(math.prod(s) for n, s in shapes.items()
                if n.startswith("layers.0.") and len(s) == 2)
    kernel = (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
              and library() is not None)
    table = cfg.vocab_size * cfg.embed_dim if head and (
        policy.gpu_batch_size > MAX_LINEAR_ROWS or not kernel) else 0
    return max(layer, table) * item


@functools.lru_cache(maxsize=32)
def _weight_shapes(cfg: ModelConfig) -> dict:
    return family_of(cfg).weight_shapes(cfg)


@functools.lru_cache(maxsize=32)
def _layer_sizes(cfg: ModelConfig) -> tuple[tuple, tuple]:
    """Each layer's (attention, MLP) weights in elements, and its routed experts apart: a MoE
    model may mix dense and expert layers; experts are read while their stage computes (a
    prefill may route to all of a layer's), not prefetched with the next stage."""
    shapes = _weight_shapes(cfg)
    layer_stages, layer_experts = [], []
    for i in range(cfg.num_layers):
        names = family_of(cfg).stage_weights(cfg, i)
        size = {n: math.prod(shapes[f"layers.{i}.{n}"]) for k in ("attn", "mlp")
                for n in names[k]}
        layer_stages.append(tuple(sum(size[n] for n in names[k] if not is_expert_weight(n))
                                  for k in ("attn", "mlp")))
        layer_experts.append(sum(v for n, v in size.items() if is_expert_weight(n)))
    return tuple(layer_stages), tuple(layer_experts)


def _group_shapes(named, layouts: dict | None = None) -> list[tuple]:
    """(shape, routed expert?, layout, count) over (name, shape) pairs: a MoE model's tens
    of thousands of expert matrices come in a few shapes."""
    counts = {}
    for name, shape in named:
        key = (tuple(shape), is_expert_weight(name), (layouts or {}).get(name))
        counts[key] = counts.get(key, 0) + 1
    return [(*key, n) for key, n in counts.items()]


@functools.lru_cache(maxsize=32)
def _shape_groups(cfg: ModelConfig) -> tuple:
    """Every weight of the whole model as (shape, routed expert?, no layout, count)."""
    return tuple(_group_shapes(_weight_shapes(cfg).items()))


def plan(cfg: ModelConfig, policy: Placement, dtype: torch.dtype, prompt_len: int,
         gen_len: int, kv=None, part=None, device: torch.device | None = None,
         layouts: dict | None = None) -> dict[str, dict[str, int]]:
    """Bytes per tier for weights, KV cache, activations, the device's working set and what
    the KV policy ``kv`` (a :class:`~.kv.base.KVPolicy`) adds on the device; of the whole
    model, or of one pipeline rank's ``part`` (a :class:`~.stages.LayerSlice`). The compute
    ``device``, when known, tells whether 4-bit weights are multiplied in place (a CPU).
    ``layouts``: the weights kept as a quantized file's codes (a
    :class:`..memory.codes.CodeLayout` by name, :func:`.loading.weight_layouts`), counted as
    stored (float16 scales at two bytes); ``--compress-weight`` then changes nothing."""
    item = torch.tensor([], dtype=dtype).element_size()
    layouts = layouts or {}
    if layouts:
        policy = dataclasses.replace(policy, compress_weight=False)
    in_place = _packed_in_place(policy, device, bool(layouts))
    shapes = _weight_shapes(cfg)  # read only
    layer_stages, layer_experts = _layer_sizes(cfg)
    ends = head = True
    layers = range(cfg.num_layers) if part is None else part.layers
    recurrent = sum(cfg.is_linear(i) for i in layers)  # layers with a state, not a cache
    state_row = state_bytes(family_of(cfg).recurrent_state_shapes(cfg)) if recurrent else 0
    if part is not None:
        names = part.weight_names(cfg)
        shapes = {n: s for n, s in shapes.items() if n in names or n.startswith("layers.0.")}
        ends, head = part.embed or part.head, part.head
        cfg = dataclasses.replace(cfg, num_layers=len(part.layers))
    if part is None and not layouts:
        groups = _shape_groups(cfg)
    else:  # layer 0's shapes stay known for the working set below, but count only the part's
        groups = _group_shapes(((name, shape) for name, shape in shapes.items()
                                if part is None or name in names), layouts)
    weights, experts = [0, 0, 0], [0, 0, 0]
    homes = split_sizes(max(cfg.num_experts, 1), policy.expert_split)  # whole experts a tier
    for shape, expert, layout, count in groups:
        if expert:  # each layer's experts in the same shapes: a tier holds its share whole
            whole = stored_bytes(shape, item, policy.compress_weight and can_compress(shape),
                                 layout)
            for t, n in enumerate(homes):
                weights[t] += whole * count * n // cfg.num_experts
                experts[t] += whole * count * n // cfg.num_experts
            continue
        for t, n in enumerate(_split_bytes(shape, 0, policy.weight_split, item,
                                           policy.compress_weight, layout)):
            weights[t] += n * count
    b, max_len = policy.gpu_batch_size, prompt_len + gen_len
    cache_shape = (max_len, b * cfg.num_kv_heads, cfg.head_dim)
    per_cache = _split_bytes(cache_shape, 1, policy.cache_split, item, policy.compress_cache)
    n_caches = 2 * (cfg.num_layers - recurrent) * policy.num_gpu_batches
    # a recurrent layer's rows each hold one state, split over the tiers by whole rows
    states = [rows * state_row * recurrent * policy.num_gpu_batches
              for rows in split_sizes(b, policy.cache_split)]
    cache = [n * n_caches + st for n, st in zip(per_cache, states)]
    act_shape = (b, prompt_len, cfg.hidden_size)
    act = [n * policy.num_gpu_batches
           for n in _split_bytes(act_shape, 0, policy.act_split, item, False)]
    # working set on the device: two stages of weights in flight when they are copied (a
    # stage is attention and MLP together without --sep-layer), the loaded K and V of the
    # batch computing and of the next (prefetched) one when any of the cache is off the
    # device, prefill activations (the
    # MLP's widest temporaries for one prefill chunk, the prompt-sized tensors of a layer) and
    # one fused attention chunk's mask (scores are never materialized; a policy that needs
    # the prompt's attention mass, H2O, counts its score chunk itself)
    biggest_stage = max(max(per) if policy.split_layers else sum(per) for per in layer_stages)
    biggest_stage = max(biggest_stage, cfg.vocab_size * cfg.embed_dim * ends) * item
    cache_off_device = per_cache[1] + per_cache[2] > 0 or policy.compress_cache
    loads = 2 * 2 * math.prod(cache_shape) * item if cache_off_device else 0
    chunk = prefill_chunk(cfg, policy, item, prompt_len)
    rows = min(prompt_len, chunk, FUSED_ROWS)
    # a stage's weights are copied (brought to the device, or expanded from 4 bits) unless
    # they all sit on the device as they are: then compute reads them in place (4-bit ones
    # too on a CPU, but for one matrix at a time in a product the kernel does not take)
    resident = (policy.weight_split[0] >= 1.0
                and (not (policy.compress_weight or layouts) or in_place))
    stage_copies = 2 * biggest_stage * (not resident) + _expert_copies(
        cfg, policy, device, layouts, item, max(layer_experts))
    expanded = _expanded_matrix(cfg, shapes, policy, item, head) if in_place else 0
    working = (stage_copies + expanded + loads
               + b * rows * prompt_len  # one fused attention chunk's boolean mask
               + 4 * b * chunk * max(cfg.intermediate_size, cfg.hidden_size) * item
               + prompt_activation_bytes(cfg, b, prompt_len, item)
               + b * cfg.vocab_size * 4 * head)
    on_cpu = device is not None and torch.device(device).type == "cpu"
    kv_terms = kv.device_bytes(cfg, policy, item, max_len, weights_in_place=in_place,
                               on_cpu=on_cpu) if kv is not None else {}
    # host staging for what is read from disk (a stage's weights or a cache's disk part, the
    # one in use and the next), from the pinned caching allocator, which rounds to a power of 2
    disk_read = max(biggest_stage * max(policy.weight_split[2], policy.expert_split[2]),
                    2 * per_cache[2])
    staging = 2 * _pow2(math.ceil(disk_read)) if disk_read else 0
    totals = {t: weights[i] + cache[i] + act[i] for i, t in enumerate(TIERS)}
    totals[DEVICE] += working + sum(kv_terms.values())
    # checked by ``check_fit`` on top of the totals (the placement optimizer's linear
    # program cannot express a power of two or a share of the total)
    headroom = int(ALLOCATOR_HEADROOM * totals[DEVICE])
    # "weights" holds every weight; "experts" the routed experts' part of it
    return {"weights": dict(zip(TIERS, weights)), "experts": dict(zip(TIERS, experts)),
            "kv_cache": dict(zip(TIERS, cache)),
            "activations": dict(zip(TIERS, act)), "working_set_device": working,
            # two stages of weights in flight unless resident, and a layer's routed experts
            # copied for a stage (both in ``working``); and what that is with every weight
            # off the device, as floats (the placement optimizer's fixed term)
            "stage_copies": stage_copies,
            "stage_copies_if_offloaded": 2 * biggest_stage + max(layer_experts) * item,
            "kv_policy_device": kv_terms, "allocator_headroom_device": headroom,
            "staging_host": staging,
            "total": totals}


def available(device: torch.device, offload_dir: str | None) -> dict[str, int]:
    """Bytes free on each tier of this machine."""
    host = _host_available()
    if device.type == "cuda":
        free_dev, _ = torch.cuda.mem_get_info(device)
    else:
        free_dev = host  # the compute device is the CPU: device and host share memory
    root = Path(offload_dir or tempfile.gettempdir()).absolute()
    while not root.exists():  # a folder the run will create: its disk is its parent's
        root = root.parent
    if root.is_dir():
        remove_stale_folders(root)  # what killed runs left there is free space for this one
    disk = shutil.disk_usage(root).free
    return {DEVICE: free_dev, HOST: host, DISK: disk}


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fit(need: dict, have: dict[str, int], device: torch.device) -> None:
    total = dict(need["total"])
    total[DEVICE] += need.get("allocator_headroom_device", 0)
    total[HOST] += need.get("staging_host", 0)
    shared = device.type != "cuda"
    checks = [(DEVICE, total[DEVICE] + (total[HOST] if shared else 0)), (DISK, total[DISK])]
    if not shared:
        checks.insert(1, (HOST, total[HOST]))
    hints = {DEVICE: "move weights or cache to disk (lower wg wc cg cc in --percent, or "
                     "--experts-percent), add --compress-weight / --compress-cache, or lower "
                     "--gpu-batch-size"
             if shared else
             "lower the GPU percentages in --percent (wg cg hg) or --experts-percent, or "
             "--gpu-batch-size",
             HOST: "move more to disk (lower wc cc hc in --percent, or the CPU share of "
                   "--experts-percent) or lower --gpu-batch-size",
             DISK: "free disk space under --offload-dir or keep more in memory"}
    for tier, n in checks:
        if n > have[tier]:
            label = "memory (device and host share it here)" if shared and tier == DEVICE \
                else f"{tier} memory" if tier != DISK else "disk space"
            raise ConfigError(
                f"this policy needs {n / GIB:.1f} GiB of {label} but only "
                f"{have[tier] / GIB:.1f} GiB is free; {hints[tier]}")
