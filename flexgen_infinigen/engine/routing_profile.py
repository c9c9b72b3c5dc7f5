"""A mixture-of-experts model's routing profile: how often each routed expert was read.

A run with ``--record-routing FILE`` counts, per MoE layer and expert, the stage executions
that read the expert (a stage reads an expert once for all its tokens and GPU batches, so
the count is the number of times the expert's bytes were needed; the reads that count are
:class:`~.experts.CountedRead`). A later run with ``--experts-profile FILE`` places each
layer's most-read experts on the fastest tiers (:mod:`.expert_homes`): with
``--experts-percent 10 90`` the device holds the tenth of each layer's experts that the
profile read most.

The file is JSON: ``{"model": name, "num_experts": E, "layers": {"i": [count per expert]}}``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..config import ConfigError, ModelConfig


def save(path: str | os.PathLike, cfg: ModelConfig, counts: dict[tuple[int, int], int],
         ) -> None:
    """Write ``counts`` ((layer, expert) -> reads) for ``cfg``: every MoE layer, every
    expert (zero where never read); through a temporary file, so a stopped run leaves none."""
    from ..models.moe import is_moe_layer

    layers = {str(i): [counts.get((i, e), 0) for e in range(cfg.num_experts)]
              for i in range(cfg.num_layers) if is_moe_layer(cfg, i)}
    out = {"model": cfg.name, "num_experts": cfg.num_experts, "layers": layers}
    tmp = Path(f"{path}.part")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, path)


def expert_order(path: str | os.PathLike, cfg: ModelConfig) -> dict[int, list[int]]:
    """Per MoE layer, its experts most read first (ties: the lower index first), from the
    profile at ``path``; one error naming the mismatch when it is not this model's."""
    from ..models.moe import is_moe_layer

    try:
        data = json.loads(Path(path).read_text())
        layers = {int(k): [int(c) for c in v] for k, v in data["layers"].items()}
        experts = int(data["num_experts"])
    except FileNotFoundError:
        raise ConfigError(f"--experts-profile {path}: no such file (write one with "
                          f"--record-routing {path})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"--experts-profile {path} is not a routing profile ({e}); write "
                          f"one with --record-routing") from None
    moe = {i for i in range(cfg.num_layers) if is_moe_layer(cfg, i)}
    if experts != cfg.num_experts or set(layers) != moe or \
            any(len(v) != experts for v in layers.values()):
        raise ConfigError(f"--experts-profile {path} was recorded for {data.get('model')} "
                          f"({experts} experts, {len(layers)} MoE layers), not {cfg.name} "
                          f"({cfg.num_experts} experts, {len(moe)} MoE layers): record one "
                          f"for this model with --record-routing")
    return {i: sorted(range(experts), key=lambda e: (-v[e], e)) for i, v in layers.items()}
