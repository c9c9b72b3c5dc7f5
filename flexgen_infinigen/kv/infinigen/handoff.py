"""What a decode step's speculation hands the same layer's ``load`` (:mod:`.cache`): the
previous layer's compute stream sets it, the cache-load lane takes it, once a step."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch


class Handed(Enum):
    """What speculation decided for this step."""

    READ_WHOLE = "read whole"  # the layer is read whole (its KV is under --select-from-mb)
    OWN_QUERY = "own query"  # --speculation-query own: chosen when the layer attends
    RANKED = "ranked"  # the rows ranked: ``load`` reads them
    MAPPED = "mapped"  # the rows ranked and already being read by the device from host memory


@dataclass(frozen=True)
class Speculation:
    """One step's speculation for one cache: what was decided, then what that needs.

    ``order`` ``[b, KV, n]``: the chosen positions, ranked; ``counts`` ``[b, KV]``: how many
    each KV head uses."""

    handed: Handed
    order: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    # RANKED, a cache the device addresses: the CUDA event of the finished ranking, which the
    # load stream waits for (None on a CPU); MAPPED: the row read's, for ``tiers.wait_rows``
    done: object = None
    # RANKED, a cache gathered on the host: waits for the ranking's copy there (the step's one
    # host sync) and gives (order, counts) on the host
    on_host: Callable[[], list[torch.Tensor]] | None = None
    rows: tuple[torch.Tensor, torch.Tensor] | None = None  # MAPPED: the K and V buffers

    @classmethod
    def ranked(cls, order, counts, done=None, on_host=None) -> "Speculation":
        return cls(Handed.RANKED, order, counts, done=done, on_host=on_host)

    @classmethod
    def mapped(cls, order, counts, rows, done) -> "Speculation":
        return cls(Handed.MAPPED, order, counts, done=done, rows=rows)


READ_WHOLE = Speculation(Handed.READ_WHOLE)
OWN_QUERY = Speculation(Handed.OWN_QUERY)
