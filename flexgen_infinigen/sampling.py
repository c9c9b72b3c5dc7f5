"""Choosing the next token: greedy, or temperature with nucleus (top-p) sampling."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TOP_P_FLOOR = 2.0 ** -126  # float32's smallest normal: a smaller top_p rounds to 0 there
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0  # > 1: tokens already in the sequence are less likely

    def validate(self) -> "SamplingConfig":
        from .config import ConfigError
        # written so that NaN fails each check (every comparison with NaN is false)
        if not 0 <= self.temperature < math.inf:
            raise ConfigError(f"--temperature must be a finite number >= 0 (0 = greedy), got "
                              f"{self.temperature}")
        if not TOP_P_FLOOR <= self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1] and at least {TOP_P_FLOOR:.3g} "
                              f"(float32's smallest normal), got {self.top_p}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not SEED_MIN <= self.seed <= SEED_MAX:
            raise ConfigError(f"the seed must be an integer from {SEED_MIN} to {SEED_MAX} (64 "
                              f"bits), got {self.seed!r}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ConfigError(f"--repetition-penalty must be a finite number above 0 (1 = "
                              f"off), got {self.repetition_penalty}")
        return self


class Sampler:
    def __init__(self, config: SamplingConfig):
        self.config = config
        self.generator = torch.Generator().manual_seed(config.seed)

    def __call__(self, logits: torch.Tensor, step: int = 0, batch: int = 0) -> torch.Tensor:
        """Token ids [b] from last-position logits [b, vocab] (computed on the CPU in float32)."""
        logits = logits.float().cpu()
        if self.config.temperature == 0:
            return logits.argmax(-1)
        scaled = logits / self.config.temperature
        # a temperature so small that the scaled logits overflow (softmax would be NaN): its
        # limit, the greedy choice
        greedy = ~torch.isfinite(scaled.amax(-1))
        probs = torch.softmax(scaled.masked_fill(greedy[:, None], 0), dim=-1)
        if self.config.top_p < 1:
            sorted_p, order = probs.sort(-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p
            drop = before >= self.config.top_p
            drop[:, 0] = False  # the most likely token is always kept
            sorted_p = sorted_p.masked_fill(drop, 0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        drawn = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        return torch.where(greedy, logits.argmax(-1), drawn)


class ForcedTokens:
    """Teacher forcing: step ``i`` of GPU batch ``k`` returns the given tokens, not a choice."""

    def __init__(self, tokens: torch.Tensor, batch_size: int):
        self.tokens, self.batch_size = tokens, batch_size  # [block rows, steps]

    def __call__(self, logits: torch.Tensor, step: int = 0, batch: int = 0) -> torch.Tensor:
        rows = slice(batch * self.batch_size, (batch + 1) * self.batch_size)
        return self.tokens[rows, step]


class RepetitionPenalty:
    """Wraps a chooser: the logits of tokens already in a row's sequence (prompt and what was
    generated) are divided by ``penalty`` where positive and multiplied where negative, as
    transformers' ``repetition_penalty`` does, before the choice."""

    def __init__(self, chooser, rows: list[list[int]], batch_size: int, penalty: float):
        self.chooser, self.batch_size, self.penalty = chooser, batch_size, penalty
        self.seen = [set(r) for r in rows]

    def __call__(self, logits: torch.Tensor, step: int = 0, batch: int = 0) -> torch.Tensor:
        logits = logits.float().cpu().clone()
        first = batch * self.batch_size
        for r in range(logits.shape[0]):
            ids = torch.tensor(sorted(self.seen[first + r]), dtype=torch.long)
            if len(ids):
                got = logits[r, ids]
                logits[r, ids] = torch.where(got > 0, got / self.penalty, got * self.penalty)
        tokens = self.chooser(logits, step, batch)
        for r, t in enumerate(tokens.tolist()):
            self.seen[first + r].add(int(t))
        return tokens
