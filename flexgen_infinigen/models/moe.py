"""Mixture-of-experts MLPs (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE): a softmax top-k router,
routed SwiGLU experts and, in Qwen2-MoE, a shared expert behind a sigmoid gate.

Every expert matrix is its own weight-store tensor (``experts.{e}.gate_proj.weight``, as
the Hugging Face checkpoints write them), so a step reads only the experts its tokens were
routed to: the engine hands expert weights over as :class:`~..runtime.tiered.OnDemand`
handles, brought to the compute device the first time a token picks the expert and kept for
the rest of the stage (every GPU batch of a block and every prefill chunk share them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..runtime.cpu_layers import MOE_MAX_ROWS, linear, moe_experts
from ..runtime.compression import PackedWeight
from ..runtime.tiered import OnDemand, OnHost

ROUTER = "router.weight"
EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")
SHARED = "shared_expert"
SHARED_GATE = "shared_expert_gate.weight"


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return cfg.num_experts > 0 and layer not in cfg.dense_layers


def is_expert_weight(name: str) -> bool:
    """A routed expert's matrix (``layers.{i}.experts.{e}...``): read only when routed to,
    and counted apart (kind ``experts``) when it moves between tiers."""
    return name.startswith("experts.") or ".experts." in name


def _swiglu_shapes(prefix: str, width: int, h: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.gate_proj.weight": (width, h), f"{prefix}.up_proj.weight": (width, h),
            f"{prefix}.down_proj.weight": (h, width)}


def mlp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A MoE layer's MLP weights, named as a ``layers.{i}.`` prefix completes them."""
    h = cfg.hidden_size
    shapes = {"mlp_norm.weight": (h,), ROUTER: (cfg.num_experts, h)}
    for e in range(cfg.num_experts):
        shapes.update(_swiglu_shapes(f"experts.{e}", cfg.expert_intermediate_size, h))
    if cfg.shared_expert_size:
        shapes.update(_swiglu_shapes(SHARED, cfg.shared_expert_size, h))
        shapes[SHARED_GATE] = (1, h)
    return shapes


def expert_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """The bytes of one routed expert's three matrices."""
    return 3 * cfg.expert_intermediate_size * cfg.hidden_size * itemsize


def route(cfg: ModelConfig, x: torch.Tensor, router) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k] in ``x``'s dtype, experts [n, k]) for the tokens ``x`` [n, h]: the
    softmax over every expert (in float32), its top k (equal values as ``torch.topk``
    breaks the tie, as transformers' routers do: in no index order), renormalised to sum to
    1 when ``norm_topk_prob``."""
    probs = torch.softmax(linear(x, router).float(), dim=-1)
    top, experts = torch.topk(probs, cfg.experts_per_token, dim=-1)
    if cfg.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    return top.to(x.dtype), experts


def swiglu(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def fetch(weight):
    """A weight the math can multiply: an :class:`OnDemand` handle is read (once), an
    :class:`OnHost` one gives the stored tensor (for the host's own math)."""
    if isinstance(weight, OnDemand):
        return weight.get()
    return weight.value if isinstance(weight, OnHost) else weight


def _by_expert(weights, experts, used: list[int], some: bool):
    """(first, tokens, router weights) as the experts call takes them: expert ``used[u]``'s
    tokens ``tokens[first[u]:first[u + 1]]``, by expert and within one by token (the order
    ``torch.where`` gives in the per-expert path); None when an expert takes more tokens
    than the call can. A decode step's few tokens are grouped in Python lists (no tensor
    operation on the ``[tokens, k]`` routing); more, by tensor operations."""
    if experts.shape[0] <= MOE_MAX_ROWS:  # no expert can take more than the call can
        keep = set(used)
        rows: dict[int, list] = {e: [] for e in used}
        for t, (row, wts) in enumerate(zip(experts.tolist(), weights.tolist())):
            for e, wt in zip(row, wts):
                if e in keep:
                    rows[e].append((t, wt))
        grouped = [pair for e in used for pair in rows[e]]
        first = [0]
        for e in used:
            first.append(first[-1] + len(rows[e]))
        return first, [t for t, _ in grouped], [wt for _, wt in grouped]
    chosen = experts.reshape(-1)
    if some:  # the others last in the order below, and cut off
        chosen = torch.where(torch.isin(chosen, torch.tensor(used, dtype=chosen.dtype)),
                             chosen, int(experts.max()) + 1)
    counts = torch.bincount(chosen)
    if int(counts[used].max()) > MOE_MAX_ROWS:
        return None
    first = [0] + torch.cumsum(counts[used], 0).tolist()
    order = torch.argsort(chosen, stable=True)[:first[-1]]
    return first, order // experts.shape[1], weights.reshape(-1)[order]


def _routed(w: dict, flat, weights, experts, used: list[int], some: bool = False):
    """The sum over the experts ``used`` of each token's routed outputs, on the device
    ``flat`` is on; ``some``: ``used`` leaves out experts the tokens chose (their share is
    added elsewhere)."""
    # on a CPU, every expert in one compiled call when none takes more rows than the call
    # can: a decode step's tokens (one GPU batch's, or a whole block's), a short prompt (on
    # a GPU the routing below would cost host syncs for a call that never takes GPU tensors)
    grouped = None if flat.is_cuda else _by_expert(weights, experts, used, some)
    if grouped is not None:
        mats = [fetch(w[f"experts.{e}.{m}.weight"]) for e in used for m in EXPERT_MATRICES]
        out = moe_experts(flat, mats, *grouped)
        if out is not None:
            return out
    out = torch.zeros_like(flat)
    for e in used:
        rows, slot = torch.where(experts == e)
        mats = [fetch(w[f"experts.{e}.{m}.weight"]) for m in EXPERT_MATRICES]
        out.index_add_(0, rows, swiglu(flat[rows], *mats) * weights[rows, slot, None])
    return out


def _routed_on_host(w: dict, flat, weights, experts, used: list[int]) -> torch.Tensor:
    """:func:`_routed` for experts the CPU multiplies in CPU memory (:class:`OnHost`): the
    tokens' rows and their routing cross to the host, the sum comes back; the experts do
    not move. In float32 on the host when the experts are codes (the CPU kernels' form)."""
    handle = w[f"experts.{used[0]}.{EXPERT_MATRICES[0]}.weight"]
    x, wts, exps = (handle.to_host(t) for t in (flat, weights, experts))
    if isinstance(handle.value, PackedWeight):
        x, wts = x.float(), wts.float()
    return handle.to_compute(_routed(w, x, wts, exps, used, some=True).to(flat.dtype))


def mlp(cfg: ModelConfig, w: dict, x: torch.Tensor) -> torch.Tensor:
    """The MoE MLP of the normalized input ``x`` [b, s, h] (no residual): each routed expert
    takes the rows of the tokens that chose it, scaled by their router weight; the shared
    expert, if any, takes every token, scaled by the sigmoid of its gate. Experts the CPU
    multiplies where they are held (:class:`OnHost`) take their tokens there."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts = route(cfg, flat, w[ROUTER])
    used = sorted(set(experts.reshape(-1).tolist()))  # the experts the tokens use, in order
    on_host = [e for e in used if isinstance(w[f"experts.{e}.{EXPERT_MATRICES[0]}.weight"],
                                             OnHost)]
    here = [e for e in used if e not in on_host] if on_host else used
    for e in here:  # reads from disk all in flight before the first is needed
        for m in EXPERT_MATRICES:
            if isinstance(w[f"experts.{e}.{m}.weight"], OnDemand):
                w[f"experts.{e}.{m}.weight"].start()
    out = _routed(w, flat, weights, experts, here, some=bool(on_host)) if here \
        else torch.zeros_like(flat)
    if on_host:
        out += _routed_on_host(w, flat, weights, experts, on_host)
    if cfg.shared_expert_size:
        shared = swiglu(flat, *(w[f"{SHARED}.{m}.weight"] for m in EXPERT_MATRICES))
        out += torch.sigmoid(linear(flat, w[SHARED_GATE])) * shared
    return out.view_as(x)
