"""Options of the selective KV policies (InfiniGen and the oracle): the selection rule and
its budget, checked before loading; InfiniGen's own are in :mod:`flexgen_infinigen.options`."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ConfigError
from .selection_rules import RULES, Budget

# Per selecting layer, with a floor in rows: what a head needs grows more slowly than its
# context, so a fraction that keeps long-context answers (0.04: Qwen2.5's retrieval at 8K-32K
# equal to the full cache's) starves a short context, and the floor covers it (SmolLM2's
# perplexity within ~1% of the full cache's from 1K to 8K tokens; docs/usage/long_context.md).
# With the two layers that read everything, Qwen2.5 (24 layers) reads 0.120 of a long cache.
DEFAULT_KV_FRACTION = 0.04
DEFAULT_MIN_KV = 256



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
