"""Where each routed expert of a mixture-of-experts model lives.

``--experts-percent`` places whole experts, not a share of every expert's rows: an expert split
over two tiers could never be multiplied where it is, and every routed token would read both
parts. In each MoE layer the first experts in the layer's order (by index, or most used first
when a routing profile gives the order) go to the compute device, the next to CPU memory and
the rest to disk, as many in each tier as the percentages give (``split_sizes``: the same
rounding as a tensor's rows). The loader and the memory plan both place through this module,
so the plan's bytes per tier are the loaded ones.
"""
from __future__ import annotations

from ..memory.split_tensor import split_sizes

ONE_TIER = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))


def expert_of(name: str) -> tuple[int, int] | None:
    """(layer, expert) of a routed expert's matrix ``layers.{i}.experts.{e}.{...}``."""
    head, sep, tail = name.partition(".experts.")
    if not sep or not head.startswith("layers."):
        return None
    return int(head.split(".")[1]), int(tail.split(".")[0])


def tier_of(rank: int, num_experts: int, split: tuple[float, float, float]) -> int:
    """The tier index (0 device, 1 host, 2 disk) of the expert at ``rank`` in its layer's
    order."""
    dev, host, _ = split_sizes(num_experts, split)
    return 0 if rank < dev else 1 if rank < dev + host else 2


def home_split(name: str, split: tuple[float, float, float], num_experts: int,
               order: dict[int, list[int]] | None = None) -> tuple[float, float, float]:
    """The split a routed expert's matrix is placed with: all of it in one tier.
    ``order``: per layer, its experts most used first (a routing profile)."""
    layer, expert = expert_of(name)
    ranks = order.get(layer) if order else None
    rank = expert if not ranks else (ranks.index(expert) if expert in ranks
                                     else len(ranks) + expert)  # unprofiled: last
    return ONE_TIER[tier_of(rank, num_experts, split)]
