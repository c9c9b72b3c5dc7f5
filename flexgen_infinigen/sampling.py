"""Choosing the next token: greedy, or temperature with top-k, nucleus (top-p) and min-p
sampling; before the choice, a row's logits may be moved by a per-token bias and by
penalties on the tokens it already has.

The order, for every row (the library's ``generate``, ``batch`` and each row of a server
block alike):

1. ``repetition_penalty`` (:class:`RepetitionPenalty`, as transformers does it): a logit of a
   token in the prompt or in what was generated is divided by it where positive, multiplied
   where negative;
2. ``logit_bias``: each listed token's value is added to its logit (OpenAI's);
3. ``presence_penalty`` and ``frequency_penalty`` (OpenAI's definition): a token generated
   ``c`` times so far loses ``presence * (c > 0) + frequency * c`` from its logit. Only
   generated tokens count, not the prompt's (as OpenAI and vLLM count them);
4. temperature 0: the largest logit (greedy). Otherwise the logits are divided by the
   temperature, then ``top_k`` keeps the ``k`` largest (ties at the ``k``-th kept; -1 or 0
   keeps all), ``top_p`` the smallest set whose mass reaches ``p``, and ``min_p`` the tokens
   whose probability is at least ``min_p`` times the largest one's (transformers' order:
   temperature, top-k, top-p, min-p); a token is drawn from what is left.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

TOP_P_FLOOR = 2.0 ** -126  # float32's smallest normal: a smaller top_p rounds to 0 there
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1  # what torch.Generator.manual_seed takes
PENALTY_LIMIT = 2.0  # OpenAI's range for presence and frequency penalties: -2 to 2
BIAS_LIMIT = 100.0  # OpenAI's range for a logit bias: -100 to 100
# the fields of a model's generation_config.json that become a request's defaults (vLLM's)
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0  # > 1: tokens already in the sequence are less likely
    top_k: int = -1  # -1 or 0: every token
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

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
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ConfigError(f"--top-k must be an integer >= 0, or -1 (0 and -1 = off), got "
                              f"{self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"--min-p must be in [0, 1] (0 = off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, name) <= PENALTY_LIMIT:
                raise ConfigError(f"--{name.replace('_', '-')} must be from -2 to 2, got "
                                  f"{getattr(self, name)}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or \
                    not -BIAS_LIMIT <= bias <= BIAS_LIMIT:
                raise ConfigError(f"--logit-bias takes token ids >= 0 with values from -100 "
                                  f"to 100, got {token!r}: {bias!r}")
        return self

    @property
    def moves_logits(self) -> bool:
        """Whether the logits change before the choice: a greedy row that moves none is the
        plain argmax."""
        return self.repetition_penalty != 1.0 or bool(self.logit_bias) or \
            self.presence_penalty != 0 or self.frequency_penalty != 0


def probabilities(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """What a row draws from: logits [b, vocab] (float32) after temperature, top-k, top-p
    and min-p, normalised. Rows whose scaled logits overflow are the caller's (greedy)."""
    scaled = logits / config.temperature
    k = config.top_k
    if 0 < k < scaled.shape[-1]:
        kth = scaled.topk(k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if config.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        drop = before >= config.top_p
        drop[:, 0] = False  # the most likely token is always kept
        sorted_p = sorted_p.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    if config.min_p > 0:  # relative to the most likely token, which is always kept
        probs = probs.masked_fill(probs < config.min_p * probs.amax(-1, keepdim=True), 0)
    return probs / probs.sum(-1, keepdim=True)


class Sampler:
    """The choice for a block (the engine calls it with GPU batch ``batch``'s logits at step
    ``step``). It keeps what each row has generated since its block's first step, for the
    presence and frequency penalties: GPU batches are equal, so row ``r`` of batch ``k`` is
    the same row at every step."""

    def __init__(self, config: SamplingConfig):
        self.config = config
        self.generator = torch.Generator().manual_seed(config.seed)
        self._bias = None
        if config.logit_bias:
            ids, values = zip(*config.logit_bias)
            self._bias = (torch.tensor(ids, dtype=torch.long),
                          torch.tensor(values, dtype=torch.float32))
        self._counting = config.presence_penalty != 0 or config.frequency_penalty != 0
        self._counts: dict[int, list[dict[int, int]]] = {}  # batch -> row -> token -> count

    def __call__(self, logits: torch.Tensor, step: int = 0, batch: int = 0) -> torch.Tensor:
        """Token ids [b] from last-position logits [b, vocab] (computed on the CPU in float32)."""
        logits = logits.float().cpu()
        if self._bias is not None or self._counting:
            logits = self._moved(logits.clone(), step, batch)
        tokens = self._choose(logits)
        if self._counting:
            for counts, t in zip(self._counts[batch], tokens.tolist()):
                counts[t] = counts.get(t, 0) + 1
        return tokens

    def _moved(self, logits: torch.Tensor, step: int, batch: int) -> torch.Tensor:
        if self._bias is not None:
            ids, values = self._bias
            logits[:, ids] += values
        if self._counting:
            if step == 0 or batch not in self._counts:  # a new block: nothing generated yet
                self._counts[batch] = [{} for _ in range(logits.shape[0])]
            c = self.config
            for r, counts in enumerate(self._counts[batch]):
                if counts:
                    ids = torch.tensor(list(counts), dtype=torch.long)
                    n = torch.tensor(list(counts.values()), dtype=torch.float32)
                    logits[r, ids] -= c.presence_penalty + c.frequency_penalty * n
        return logits

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        if self.config.temperature == 0:
            return logits.argmax(-1)
        # a temperature so small that the scaled logits overflow (softmax would be NaN): its
        # limit, the greedy choice
        greedy = ~torch.isfinite((logits / self.config.temperature).amax(-1))
        probs = probabilities(logits.masked_fill(greedy[:, None], 0), self.config)
        # a greedy row draws from any valid distribution (its draw is replaced below): a
        # temperature that is 0 in float32 makes its probabilities 0/0
        probs = torch.where(greedy[:, None], 1.0 / probs.shape[-1], probs)
        drawn = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        return torch.where(greedy, logits.argmax(-1), drawn)


def row_chooser(config: SamplingConfig, prompt: list[int]):
    """One row's chooser (a server request's): its sampler, inside the repetition penalty
    over its ``prompt`` when it has one. Call it with that row's logits [1, vocab] and
    ``batch`` 0."""
    sampler = Sampler(config)
    if config.repetition_penalty == 1.0:
        return sampler
    return RepetitionPenalty(sampler, [prompt], 1, config.repetition_penalty)


def generation_defaults(folder) -> dict:
    """The sampling defaults a model ships in its ``generation_config.json`` (vLLM's fields:
    :data:`GENERATION_DEFAULTS`), for the fields a request leaves out; {} without the file.
    A value the sampler would refuse is left out (the request's own default applies)."""
    path = Path(folder) / "generation_config.json" if folder is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    out = {}
    for name in GENERATION_DEFAULTS:
        value = data.get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if name == "top_k" and not isinstance(value, int):
            continue
        try:
            SamplingConfig(**{name: value}).validate()
        except Exception:  # noqa: BLE001 - a value out of range: not a default
            continue
        out[name] = value
    return out


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
