"""Skewing: per layer and KV head, an orthogonal matrix that concentrates q into few columns.

For a head with calibration queries Q (tokens x head_dim), Q = U S V^T and A = V:
Q A = U S puts most of each query's magnitude in the first columns, while
(q A)(k A)^T = q k^T leaves attention unchanged. Grouped-query heads share one A
per KV head (computed from the stacked queries of the group), since q and k must
be skewed alike. The column importance used to pick the partial columns is kept
beside A, so the ratio can be chosen at load time.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..kv.base import CacheSpec, KVCache, KVPolicy

SKEW_DIR = "infinigen"

# The default calibration text (written for this project): plain English prose, so that
# no external file is needed. A real corpus (--calibration FILE) is better.
DEFAULT_CALIBRATION = (
    "The river town woke slowly in the grey light of early spring. Bakers were the first to "
    "stir, pulling trays of bread from ovens that had burned since before dawn, and the smell "
    "drifted down the narrow streets toward the water. By seven the ferry had made its first "
    "crossing, carrying farmers with crates of eggs, a schoolteacher reading a newspaper, and "
    "two boys who should have been in class. The mayor, a careful man who kept a ledger of "
    "every promise he had ever made, walked along the quay and counted the boats. There were "
    "fewer than last year. The fishing had been poor, the prices low, and several families had "
    "moved to the city, where the factories paid in cash every Friday. In the library, an old "
    "woman named Marta sorted letters that had arrived from abroad. Some were from former "
    "residents who wrote about their new lives: the size of the buildings, the noise of the "
    "trains, the strange food, and the loneliness of crowded places. Others asked for news of "
    "relatives or for copies of records that had been lost in the flood of 1921. Marta "
    "answered each one by hand. She believed that a town was held together less by its roads "
    "and bridges than by the stories its people told about it, and she meant to keep those "
    "stories alive. In the afternoon the wind turned, clouds gathered over the hills, and the "
    "first rain of the season fell on the roofs. Children ran home from school holding their "
    "coats over their heads. The ferryman tied his boat to the post, lit his pipe, and "
    "watched the river rise. Scientists have long studied how rivers shape the land around "
    "them. Water carries sediment from the mountains to the sea, depositing it where the "
    "current slows, and over thousands of years these deposits build fertile plains. "
    "Engineers, meanwhile, try to control floods with levees and dams, but every structure "
    "changes the river in ways that are hard to predict. A dam that protects one town may "
    "starve another of the silt its fields depend on. Economists add another layer: the cost "
    "of protection must be weighed against the value of what is protected, and those values "
    "change as people move. The questions are technical, political and moral at once, which "
    "is why they are rarely settled for long. "
)


@dataclass
class Skew:
    """``matrices`` [L, KV, d, d] (orthogonal) and ``column_scores`` [L, KV, d]."""

    matrices: torch.Tensor
    column_scores: torch.Tensor
    meta: dict

    def columns(self, ratio: float) -> torch.Tensor:
        """Indices [L, KV, r] of the ``ratio * head_dim`` most important skewed columns."""
        d = self.column_scores.shape[-1]
        r = max(1, round(ratio * d))
        return self.column_scores.topk(r, dim=-1).indices.sort(-1).values

    def save(self, store_path: str | os.PathLike) -> Path:
        """Write next to a weight store, atomically (temporary folder, then rename)."""
        dest = Path(store_path) / SKEW_DIR
        tmp = Path(store_path) / f".{SKEW_DIR}.partial-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            np.save(tmp / "matrices.npy", self.matrices.float().numpy(), allow_pickle=False)
            np.save(tmp / "column_scores.npy", self.column_scores.float().numpy(),
                    allow_pickle=False)
            (tmp / "meta.json").write_text(json.dumps(self.meta, indent=1))
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    @classmethod
    def load(cls, store_path: str | os.PathLike) -> "Skew | None":
        folder = Path(store_path) / SKEW_DIR
        if not (folder / "meta.json").is_file():
            return None
        read = lambda n: torch.from_numpy(np.load(folder / n, allow_pickle=False))  # noqa: E731
        return cls(read("matrices.npy"), read("column_scores.npy"),
                   json.loads((folder / "meta.json").read_text()))


class _Recorder(KVCache):
    """A cache that only records the prompt's (valid) queries and keys."""

    def __init__(self, spec: CacheSpec, sink: dict):
        self.spec, self.sink = spec, sink

    def store_prompt(self, q, k, v, valid) -> None:
        keep = valid.cpu()
        self.sink.setdefault(self.spec.layer, []).append(
            (q.float().cpu()[keep], k.float().cpu()[keep]))

    def load(self, length):
        raise RuntimeError("calibration runs the prompt only")

    attend = store_token = load


class CalibrationPolicy(KVPolicy):
    name = "calibration"

    def __init__(self):
        self.records: dict[int, list] = {}

    def make_cache(self, spec: CacheSpec) -> KVCache:
        return _Recorder(spec, self.records)


def compute_skew(records: dict[int, list], num_layers: int, num_heads: int, kv_heads: int,
                 column_score: str = "q") -> Skew:
    """SVD of each KV head's stacked calibration queries -> A, and column importance.

    ``column_score``: "q" ranks skewed columns by summed |qA| (what the paper's code does);
    "qk" adds summed |kA| as well.
    """
    group = num_heads // kv_heads
    mats, scores = [], []
    for layer in range(num_layers):
        q = torch.cat([r[0] for r in records[layer]])  # [n, H, d]
        k = torch.cat([r[1] for r in records[layer]])  # [n, KV, d]
        n, _, d = q.shape
        q = q.view(n, kv_heads, group, d).permute(1, 2, 0, 3).reshape(kv_heads, group * n, d)
        _, _, vh = torch.linalg.svd(q.double(), full_matrices=False)
        a = vh.transpose(-1, -2).float()  # [KV, d, d], columns = right singular vectors
        score = (q @ a).abs().sum(1)
        if column_score == "qk":
            score = score + (k.permute(1, 0, 2) @ a).abs().sum(1)
        mats.append(a)
        scores.append(score)
    return Skew(torch.stack(mats), torch.stack(scores), {"column_score": column_score})


def calibrate(lm, text: str | None = None, max_tokens: int = 1024,
              column_score: str = "q") -> Skew:
    """Run the model's prefill on calibration text and compute the skew (weights unchanged)."""
    cfg = lm.cfg
    if lm.tokenizer is not None:
        ids = lm.tokenizer.encode(text or DEFAULT_CALIBRATION)
        source = "built-in text" if text is None else "calibration file"
    else:  # dummy weights have no tokenizer: seeded random tokens in the vocabulary
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(10, cfg.vocab_size, (512,), generator=gen).tolist()
        source = "random tokens (no tokenizer)"
    ids = ids[:min(max_tokens, cfg.max_positions - 1)]
    recorder = CalibrationPolicy()
    engine = lm.engine
    saved = engine.kv_policy
    engine.kv_policy = recorder
    try:
        lm.generate([ids], 1, stop_token_id=None)
    finally:
        engine.kv_policy = saved
    skew = compute_skew(recorder.records, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                        column_score)
    skew.meta.update({"source": source, "tokens": len(ids), "model": cfg.name})
    return skew
