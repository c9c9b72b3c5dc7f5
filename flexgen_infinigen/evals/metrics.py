"""Scoring text through the real decode path (teacher forcing)."""
from __future__ import annotations

import math

import torch


def teacher_forced_nll(lm, prefixes: list[list[int]],
                       continuations: list[list[int]]) -> torch.Tensor:
    """Negative log-likelihood [prompts, steps] of each continuation token.

    The prefix is prefilled; then the continuation is fed one token at a time through
    the decode path with the engine's policies active, and each step's logits score
    the next continuation token.
    """
    steps = min(map(len, continuations))
    out = lm.generate(prefixes, steps, stop_token_id=None, keep_logits=True,
                      forced=[c[:steps] for c in continuations])
    nll = []
    for logits, cont in zip(out.logits, continuations):
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll.append(-logp[torch.arange(steps), torch.tensor(cont[:steps])])
    return torch.stack(nll)


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(nll.float().mean().item())
