"""What ``OffloadedLM.generate`` returns (:class:`Generation`), what each of its blocks runs
with and gives back, and the length check every entry point makes before loading or running."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .config import ConfigError, ModelConfig
from .engine.prefill_cache import PrefillCache
from .memory.tiers import Tiers
from .sampling import Sampler


@dataclass
class Generation:
    token_ids: list[list[int]]  # generated ids, one list per prompt (stop token included)
    texts: list[str]
    prefill_latency_s: float
    decode_latency_s: float
    num_prompts: int
    prompt_tokens: int
    generated_tokens: int  # per prompt: steps run (the longest block), or projected
    projected: bool = False  # decode latency extrapolated from --cut-gen-len steps
    logits: list[torch.Tensor] = field(default_factory=list)  # per prompt [steps, vocab]
    step_times: list[float] = field(default_factory=list)  # wall time of every iteration
    prompt_texts: list[str] = field(default_factory=list)
    decode_tokens: int | None = None  # tokens the decode steps made (rows x steps actually run)
    prefill_link_bytes: dict[str, int] = field(default_factory=dict)  # per link, prefill steps
    prefills_reused: int = 0  # blocks that started from a kept prefill (``prefill_cache``)


@dataclass
class BlockRun:
    """What every block of one ``generate`` call runs with."""

    steps: int
    sampler: Sampler
    stops: set[int]
    keep_logits: bool
    forced: list | None  # teacher forcing: each prompt's tokens to feed back
    prefill_cache: PrefillCache | None
    on_tokens: Callable[[int, list[int | None]], None] | None
    bar: object  # the progress bar (tqdm)


@dataclass
class BlockResult:
    """What one block gave ``generate``, for its real prompts (not its dummy rows)."""

    rows: list[list[int]]  # each prompt's generated ids
    logits: list[torch.Tensor]  # each prompt's [steps, vocab], where logits are kept
    times: list[float]  # wall time of each step run: the prefill, then the decode steps
    link_bytes: dict[str, int]  # bytes each link moved until the prefill step was done
    reused: bool  # it started from a kept prefill


def link_totals(tiers: Tiers) -> dict[str, int]:
    return {link: sum(kinds.values()) for link, kinds in tiers.bytes_moved.items()}


def check_lengths(cfg: ModelConfig, prompt_len: int, gen_len: int) -> None:
    if prompt_len < 1 or gen_len < 1:
        raise ConfigError(f"prompt length and --gen-len must be at least 1 "
                          f"(got {prompt_len} and {gen_len})")
    if prompt_len + gen_len > cfg.max_positions:
        raise ConfigError(
            f"prompt ({prompt_len} tokens) plus --gen-len ({gen_len}) is {prompt_len + gen_len}, "
            f"over {cfg.name}'s maximum of {cfg.max_positions} positions; shorten one of them")
