"""Mixture-of-experts MLPs (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE, GLM-4.5, gpt-oss): a softmax
top-k router (GLM-4.5: sigmoid scores, chosen with a learned bias within the best groups of
experts, then scaled; gpt-oss: a bias on the logits), routed SwiGLU experts (gpt-oss: with
biases and its clamped SwiGLU) and a shared expert (Qwen2-MoE's behind a sigmoid gate,
GLM's without).

The math here routes the tokens and multiplies; an :class:`ExpertRunner` (as mlx-lm's
``SwitchGLU``: the module that applies the routed experts to the tokens, given the routing)
decides where each routed expert's matrices come from and where they are multiplied. A
plain dict of tensors takes :class:`LocalExperts` (the matrices are its entries, multiplied
where they are); the engine puts its own runner in a stage's weights under :data:`RUNNER`
(``engine/experts.py``: experts read from their tier only when a token picks them, or
multiplied in CPU memory with the tokens crossing).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels.gguf import moe_blocks
from ..kernels.layers import MOE_MAX_ROWS, linear, moe_experts

ROUTER = "router.weight"
ROUTER_BIAS = "router.bias"  # added to the router's logits (gpt-oss)
CHOICE_BIAS = "router.choice_bias"  # added to the scores for choosing only (GLM's)
EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")
SHARED = "shared_expert"
SHARED_GATE = "shared_expert_gate.weight"
# where a stage's weights carry their expert runner (no weight has this name)
RUNNER = "routed_experts"


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return cfg.num_experts > 0 and layer not in cfg.dense_layers


def is_expert_weight(name: str) -> bool:
    """A routed expert's matrix (``layers.{i}.experts.{e}...``): read only when routed to,
    and counted apart (kind ``experts``) when it moves between tiers."""
    return name.startswith("experts.") or ".experts." in name


def _swiglu_shapes(prefix: str, width: int, h: int,
                   bias: bool = False) -> dict[str, tuple[int, ...]]:
    shapes = {f"{prefix}.gate_proj.weight": (width, h), f"{prefix}.up_proj.weight": (width, h),
              f"{prefix}.down_proj.weight": (h, width)}
    if bias:
        shapes.update({f"{prefix}.gate_proj.bias": (width,), f"{prefix}.up_proj.bias": (width,),
                       f"{prefix}.down_proj.bias": (h,)})
    return shapes


def mlp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A MoE layer's MLP weights, named as a ``layers.{i}.`` prefix completes them."""
    h = cfg.hidden_size
    shapes = {"mlp_norm.weight": (h,), ROUTER: (cfg.num_experts, h)}
    if cfg.router_sigmoid:
        shapes[CHOICE_BIAS] = (cfg.num_experts,)
    if cfg.router_bias:
        shapes[ROUTER_BIAS] = (cfg.num_experts,)
    for e in range(cfg.num_experts):
        shapes.update(_swiglu_shapes(f"experts.{e}", cfg.expert_intermediate_size, h,
                                     cfg.expert_bias))
    if cfg.shared_expert_size:
        shapes.update(_swiglu_shapes(SHARED, cfg.shared_expert_size, h))
        if cfg.shared_expert_gated:
            shapes[SHARED_GATE] = (1, h)
    return shapes


def expert_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """The bytes of one routed expert's three matrices (and their biases)."""
    f, h = cfg.expert_intermediate_size, cfg.hidden_size
    return (3 * f * h + (2 * f + h if cfg.expert_bias else 0)) * itemsize


def route(cfg: ModelConfig, x: torch.Tensor, router,
          choice_bias: torch.Tensor | None = None,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k] in ``x``'s dtype, experts [n, k]) for the tokens ``x`` [n, h]: the
    softmax over every expert (in float32) of the logits (plus ``bias``, gpt-oss's), its
    top k (equal values as ``torch.topk`` breaks the tie, as transformers' routers do: in
    no index order), renormalised to sum to 1 when ``norm_topk_prob`` (the same as gpt-oss's
    softmax over the top k logits). A sigmoid router (``cfg.router_sigmoid``) is
    :func:`route_sigmoid`."""
    if cfg.router_sigmoid:
        return route_sigmoid(cfg, x, router, choice_bias)
    probs = torch.softmax(linear(x, router, bias).float(), dim=-1)
    top, experts = torch.topk(probs, cfg.experts_per_token, dim=-1)
    if cfg.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    return top.to(x.dtype), experts


def route_sigmoid(cfg: ModelConfig, x: torch.Tensor, router, choice_bias):
    """GLM-4.5's (and DeepSeek-V3's) routing: sigmoid scores in float32; the experts are
    chosen by score + ``choice_bias``, only among the ``router_topk_groups`` best of
    ``router_groups`` equal groups (a group ranked by the sum of its two best biased
    scores; the others' scores count as 0); a chosen expert's weight is its unbiased score,
    renormalised over the k when ``norm_topk_prob``, times ``routed_scaling``."""
    scores = torch.sigmoid(linear(x, router).float())
    choice = scores + choice_bias.float() if choice_bias is not None else scores
    groups = cfg.router_groups
    if groups > 1:
        n, e = choice.shape
        best = choice.view(n, groups, e // groups).topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros_like(best).scatter_(
            1, best.topk(cfg.router_topk_groups, dim=-1).indices, 1.0)
        choice = choice.masked_fill(kept.repeat_interleave(e // groups, 1) == 0, 0.0)
    experts = choice.topk(cfg.experts_per_token, dim=-1).indices
    top = scores.gather(1, experts)
    if cfg.norm_topk_prob:
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
    return (top * cfg.routed_scaling).to(x.dtype), experts


def swiglu(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def expert_mlp(cfg: ModelConfig, x: torch.Tensor, parts: list) -> torch.Tensor:
    """One routed expert of a config whose experts are not plain SwiGLU (biases, gpt-oss's
    clamped SwiGLU), on its tokens ``x``; ``parts``: gate, up, down and, with
    ``cfg.expert_bias``, their biases."""
    gate, up, down = parts[:3]
    gb, ub, db = parts[3:] if len(parts) == 6 else (None, None, None)
    g, u = linear(x, gate, gb), linear(x, up, ub)
    if cfg.swiglu_limit:
        limit = cfg.swiglu_limit
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        act = (u + 1) * (g * torch.sigmoid(g * cfg.swiglu_alpha))
    else:
        act = F.silu(g) * u
    return linear(act, down, db)


def plain_experts(cfg: ModelConfig) -> bool:
    """Routed experts that are three SwiGLU matrices and nothing else (what the compiled
    experts calls compute)."""
    return not (cfg.expert_bias or cfg.swiglu_limit)


def expert_matrix(e: int, m: str) -> str:
    """The name, in a MoE layer's weights, of routed expert ``e``'s matrix ``m``."""
    return f"experts.{e}.{m}.weight"


def expert_parts(e: int, w) -> list[str]:
    """Routed expert ``e``'s weight names in the order :func:`expert_mlp` takes them: its
    three matrices, then their biases where the weights ``w`` (names or a dict) have them."""
    names = [expert_matrix(e, m) for m in EXPERT_MATRICES]
    biases = [f"experts.{e}.{m}.bias" for m in EXPERT_MATRICES]
    return names + biases if biases[0] in w else names


class ExpertRunner(Protocol):
    """Applies the routed experts to the tokens, given the routing."""

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                 used: list[int], expert: Callable | None = None) -> torch.Tensor:
        """The sum of each token's routed experts' outputs, ``[n, h]`` on ``x``'s device,
        for the tokens ``x`` [n, h] routed as :func:`route` gives (``weights`` and
        ``experts`` [n, k]); ``used``: the experts they chose, ascending; ``expert(x,
        parts)``: one expert's math when it is not plain SwiGLU (:func:`expert_mlp`)."""
        ...


class LocalExperts:
    """The runner of a plain dict of weights: each expert's matrices are the dict's entries
    (tensors, or codes a CPU multiplies), multiplied where they are."""

    def __init__(self, w: dict):
        self.w = w

    def matrices(self, e: int) -> list:
        return [self.w[n] for n in expert_parts(e, self.w)]

    def __call__(self, x, weights, experts, used, expert=None):
        return apply_experts(x, weights, experts, used, self.matrices, expert=expert)


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


def apply_experts(x: torch.Tensor, weights, experts, used: list[int],
                  matrices: Callable[[int], list], some: bool = False,
                  expert: Callable | None = None) -> torch.Tensor:
    """The sum over the experts ``used`` of each token's routed outputs, on the device ``x``
    is on; ``matrices(e)``: expert ``e``'s (gate, up, down, and any biases) as the math
    multiplies them, asked for in the order the experts are used; ``some``: ``used`` leaves
    out experts the tokens chose (their share is added elsewhere); ``expert(x, parts)``:
    one expert's math where it is not plain SwiGLU (the compiled call computes only that)."""
    # on a CPU, every expert in one compiled call when none takes more rows than the call
    # can: a decode step's tokens (one GPU batch's, or a whole block's), a short prompt (on
    # a GPU the routing below would cost host syncs for a call that never takes GPU tensors)
    grouped = None if x.is_cuda or expert is not None else _by_expert(weights, experts, used,
                                                                       some)
    if grouped is not None:
        mats = [mat for e in used for mat in matrices(e)]
        out = moe_experts(x, mats, *grouped)
        if out is None:  # a file's blocks as they lie
            out = moe_blocks(x, mats, *grouped)
        if out is not None:
            return out
    out = torch.zeros_like(x)
    for e in used:
        rows, slot = torch.where(experts == e)
        y = swiglu(x[rows], *matrices(e)) if expert is None else expert(x[rows], matrices(e))
        out.index_add_(0, rows, y * weights[rows, slot, None])
    return out


def mlp(cfg: ModelConfig, w: dict, x: torch.Tensor) -> torch.Tensor:
    """The MoE MLP of the normalized input ``x`` [b, s, h] (no residual): each routed expert
    takes the rows of the tokens that chose it, scaled by their router weight (through the
    runner ``w`` carries under :data:`RUNNER`, else :class:`LocalExperts` of ``w``); the
    shared expert, if any, takes every token, scaled by the sigmoid of its gate."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts = route(cfg, flat, w[ROUTER], w.get(CHOICE_BIAS), w.get(ROUTER_BIAS))
    used = sorted(set(experts.reshape(-1).tolist()))  # the experts the tokens use, in order
    runner: ExpertRunner | None = w.get(RUNNER)
    if runner is None:
        runner = LocalExperts(w)
    if plain_experts(cfg):
        out = runner(flat, weights, experts, used)
    else:
        out = runner(flat, weights, experts, used, expert=partial(expert_mlp, cfg))
    if cfg.shared_expert_size:
        shared = swiglu(flat, *(w[f"{SHARED}.{m}.weight"] for m in EXPERT_MATRICES))
        gate = w.get(SHARED_GATE)
        out += shared if gate is None else torch.sigmoid(linear(flat, gate)) * shared
    return out.view_as(x)
