"""InfiniGen's options (speculation keys, rehearsal query, calibration, KV pool, when to read a
layer whole), checked before loading; the selection rule's are
:class:`..options.SelectionOptions`."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ...config import ConfigError
from ..options import SelectionOptions
from .pool import check_pool_options
from .spec_keys import KINDS
from .spec_pages import PAGE_KINDS

def own_query_runs(cfg, policy, item: int, on_cpu: bool) -> bool:
    """Where ``--speculation-query own`` runs (``InfiniGenCache.attend_in_place``): a CPU
    computing on a KV cache of ``item``-byte floats (float32) held in one place it reads in
    place, with the kernels. ``auto`` takes ``own`` there."""
    from ...kernels import cpu_kernels

    device, host, _ = policy.cache_split
    one_place = device == 1 or (host == 1 and policy.host_in_place)
    return (on_cpu and one_place and not policy.compress_cache and item == 4
            and cfg.head_dim % 8 == 0 and cpu_kernels.library() is not None)



@dataclass(frozen=True)
class InfiniGenOptions(SelectionOptions):
    partial_weight_ratio: float | None = None  # None: the default of the speculation keys
    speculation_keys: str = "int4"
    column_score: str = "q"
    # the rehearsal's input: layer i's attention input as it is ("input"), or layer i's
    # residual through layer i+1's own input norm ("renorm": the same cost, a closer guess);
    # or no rehearsal: the layer's own query when it attends ("own": rows read in place only);
    # "auto": own where it can run, else renorm where the model allows, else input
    speculation_query: str = "auto"
    calibration: str | None = None  # text file; default: the store's skew, else built-in text
    prompt_skew: bool = False  # blend each prompt's own query statistics into its skew
    kv_pool_capacity: float = 1.0  # fraction of each head's context kept on the host
    eviction: str = "fifo"
    # a layer whose KV (for the batch) is under this many MB is read whole, not chosen from:
    # choosing costs more than it saves there; None: 12 on a CPU, 0 on a GPU
    select_from_mb: float | None = None

    def validate(self) -> "InfiniGenOptions":
        super().validate()
        r = self.partial_weight_ratio
        if r is not None and not 0 < r <= 1:
            raise ConfigError(f"--partial-weight-ratio must be in (0, 1] (got {r})")
        if self.speculation_query not in ("input", "renorm", "own", "auto"):
            raise ConfigError(f"--speculation-query must be input, renorm, own or auto (got "
                              f"{self.speculation_query!r})")
        if self.speculation_keys not in {**KINDS, **PAGE_KINDS}:
            raise ConfigError(f"--speculation-keys must be one of "
                              f"{', '.join([*KINDS, *PAGE_KINDS])} "
                              f"(got {self.speculation_keys!r})")
        check_pool_options(self.kv_pool_capacity, self.eviction)
        if self.calibration is not None and not os.path.isfile(self.calibration):
            raise ConfigError(f"--calibration {self.calibration} does not exist; give a text "
                              "file, or drop the flag to use the store's skew")
        if self.select_from_mb is not None and not self.select_from_mb >= 0:
            raise ConfigError(f"--select-from-mb must be 0 or more (got {self.select_from_mb})")
        if self.column_score not in ("q", "qk"):
            raise ConfigError(f"--column-score must be q or qk (got {self.column_score!r})")
        return self

    @property
    def ratio(self) -> float:
        if self.partial_weight_ratio is not None:
            return self.partial_weight_ratio
        return DEFAULT_RATIO.get(self.speculation_keys, 1.0)


# partial-weight ratio by speculation key kind when none is given
DEFAULT_RATIO = {"partial": 0.3, "int8": 1.0, "int4": 1.0, "int2": 1.0}
