"""Options of the selective KV policies (InfiniGen and the oracle), checked before loading."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..config import ConfigError
from .pool import check_pool_options
from .selection import RULES, Budget
from .spec_keys import KINDS
from .spec_pages import PAGE_KINDS

# Per selecting layer, with a floor in rows: what a head needs grows more slowly than its
# context, so a fraction that keeps long-context answers (0.04: Qwen2.5's retrieval at 8K-32K
# equal to the full cache's) starves a short context, and the floor covers it (SmolLM2's
# perplexity within ~1% of the full cache's from 1K to 8K tokens; docs/usage/long_context.md).
# With the two layers that read everything, Qwen2.5 (24 layers) reads 0.120 of a long cache.
DEFAULT_KV_FRACTION = 0.04
DEFAULT_MIN_KV = 256


def own_query_runs(cfg, policy, item: int, on_cpu: bool) -> bool:
    """Where ``--speculation-query own`` runs (``InfiniGenCache.attend_in_place``): a CPU
    computing on a KV cache of ``item``-byte floats (float32) held in one place it reads in
    place, with the kernels. ``auto`` takes ``own`` there."""
    from ..runtime import cpu_kernels

    device, host, _ = policy.cache_split
    one_place = device == 1 or (host == 1 and policy.host_in_place)
    return (on_cpu and one_place and not policy.compress_cache and item == 4
            and cfg.head_dim % 8 == 0 and cpu_kernels.library() is not None)


@dataclass(frozen=True)
class SelectionOptions:
    """Which cached tokens each KV head reads at a decode step."""

    selection: str | None = None  # a rule of kv.selection.RULES; None: the policy's default
    alpha: float | None = None  # None: 4 for OPT, 5 for Llama (the paper's defaults)
    max_kv_fraction: float = DEFAULT_KV_FRACTION
    max_num_kv: int | None = None
    min_num_kv: int = DEFAULT_MIN_KV  # rows a head reads at least (all below that)
    keep_sink: int = 0  # the first tokens of each sequence, always read
    keep_recent: int = 0  # the newest cached tokens, always read
    first_layer: int = 2  # layers below this read the whole cache

    def validate(self):
        if self.selection is not None and self.selection not in RULES:
            raise ConfigError(f"--selection must be one of {', '.join(RULES)} "
                              f"(got {self.selection!r})")
        if self.alpha is not None and not self.alpha >= 0:
            raise ConfigError(f"--alpha must be >= 0 (got {self.alpha}); use inf to keep all")
        if not 0 < self.max_kv_fraction <= 1:
            raise ConfigError(f"--max-kv-fraction must be in (0, 1] (got {self.max_kv_fraction})")
        if self.max_num_kv is not None and self.max_num_kv < 1:
            raise ConfigError(f"--max-num-kv must be at least 1 (got {self.max_num_kv})")
        for flag, v in [("--keep-sink", self.keep_sink), ("--keep-recent", self.keep_recent),
                        ("--min-num-kv", self.min_num_kv)]:
            if v < 0:
                raise ConfigError(f"{flag} must be 0 or more (got {v})")
        if self.first_layer < 1:
            raise ConfigError(f"--first-layer must be at least 1 (got {self.first_layer}): layer "
                              "0 has no previous layer to speculate from")
        return self

    @property
    def budget(self) -> Budget:
        floor = self.min_num_kv  # an explicit cap below the floor wins: it is what was asked
        if self.max_num_kv is not None:
            floor = min(floor, self.max_num_kv)
        return Budget(self.max_kv_fraction, self.max_num_kv, floor, self.keep_sink,
                      self.keep_recent)

    def with_defaults(self, family: str, rule: str):
        alpha = self.alpha if self.alpha is not None else (4.0 if family == "opt" else 5.0)
        return replace(self, alpha=alpha, selection=self.selection or rule)


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


def add_selection_args(parser) -> None:
    """The flags of :class:`SelectionOptions` (once per parser: two policies share them)."""
    if getattr(parser, "_selection_flags_added", False):
        return
    parser._selection_flags_added = True
    g = parser.add_argument_group("token selection (with --kv-policy infinigen or oracle)")
    g.add_argument("--selection", default=None,
                   help="rule turning scores into rows: mass (default: the most softmax mass "
                        "summed over the group's query heads), cap, margin, artifact, head-union")
    g.add_argument("--alpha", type=float, default=None,
                   help="a token counts when its (approximate) logit is above max - alpha "
                        "(default 4 for OPT, 5 for Llama; inf keeps all up to the cap)")
    g.add_argument("--max-kv-fraction", type=float, default=DEFAULT_KV_FRACTION,
                   help="cap on tokens read per KV head, as a fraction of the context")
    g.add_argument("--max-num-kv", type=int, default=None, help="cap on tokens read")
    g.add_argument("--min-num-kv", type=int, default=DEFAULT_MIN_KV,
                   help="tokens a KV head reads at least, whatever the fraction (all of a "
                        f"shorter context; default {DEFAULT_MIN_KV})")
    g.add_argument("--keep-sink", type=int, default=0,
                   help="always read the first N tokens of each sequence (inside the cap)")
    g.add_argument("--keep-recent", type=int, default=0,
                   help="always read the newest N cached tokens (inside the cap)")
    g.add_argument("--first-layer", type=int, default=SelectionOptions.first_layer,
                   help="the first layer that selects; the ones below read the whole cache "
                        "(at least 1: layer 0 has no layer before it to speculate from)")


def selection_from_args(a, options_class=SelectionOptions, **more):
    """``options_class`` from the selection flags plus ``more``, checked."""
    return options_class(selection=a.selection, alpha=a.alpha,
                         max_kv_fraction=a.max_kv_fraction, max_num_kv=a.max_num_kv,
                         min_num_kv=a.min_num_kv, keep_sink=a.keep_sink, keep_recent=a.keep_recent,
                         first_layer=a.first_layer, **more).validate()
