"""Skewing: per layer and KV head, an orthogonal matrix that concentrates q into few columns.

For a head with calibration queries Q (tokens x head_dim), Q = U S V^T and A = V:
Q A = U S puts most of each query's magnitude in the first columns, while
(q A)(k A)^T = q k^T leaves attention unchanged. Grouped-query heads share one A
per KV head (computed from the stacked queries of the group), since q and k must
be skewed alike. V is also the eigenvector basis of Q^T Q, so what is stored is the
query Gram matrix (and the key Gram matrix, for ranking columns by q and k together); the
skew, the ranking and the partial columns follow from it at load time, and a prompt's own
Gram matrix can be blended in per request (``--calibration prompt``).

Only the speculation uses the skew: the partial keys are ``k A[:, cols]`` and the partial
query ``q A[:, cols]``; the KV cache itself holds the model's own keys.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...kernels import cpu_kernels
from ..base import PolicyContext
from .calibration_text import TEXT as DEFAULT_CALIBRATION

SKEW_DIR = "infinigen"  # what `python -m flexgen_infinigen.calibrate` stores: every run uses it
KEPT_DIR = "infinigen-calibrations"  # a run's own calibration, kept for runs like it
CALIBRATION_FORMAT = 1  # raise when calibrate() changes what it computes (kept ones go stale)
CALIBRATION_TOKENS = 4096


def query_gram(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Mean q q^T per KV head ``[..., KV, d, d]`` from queries ``[..., n, H, d]`` (the query
    heads of a group pooled, since a group shares one projection)."""
    *lead, n, h, d = q.shape
    g = q.reshape(*lead, n, kv_heads, h // kv_heads, d).transpose(-3, -4)
    g = g.reshape(*lead, kv_heads, n * (h // kv_heads), d).double()
    return g.transpose(-1, -2) @ g / max(g.shape[-2], 1)


def key_gram(k: torch.Tensor) -> torch.Tensor:
    """Mean k k^T per KV head ``[..., KV, d, d]`` from keys ``[..., n, KV, d]``."""
    g = k.transpose(-2, -3).double()
    return g.transpose(-1, -2) @ g / max(g.shape[-2], 1)


def projection(gram_q: torch.Tensor, gram_k: torch.Tensor | None, ratio: float,
               column_score: str = "q") -> torch.Tensor:
    """The skewed columns kept for speculation, as a projection ``[..., d, r]``.

    The skew A is the eigenvector basis of the query Gram matrix (the right singular vectors
    of the queries), so q A concentrates each query's magnitude in few columns. Columns are
    ranked by the query energy they carry (``q``), or by query energy times key energy along
    the same direction (``qk``: what a score q.k loses when the column is dropped).
    """
    d = gram_q.shape[-1]
    r = max(1, round(ratio * d))
    energy, basis = torch.linalg.eigh(gram_q.double())  # ascending
    score = energy.clamp(min=0)
    if column_score == "qk" and gram_k is not None:
        key_energy = ((gram_k.double() @ basis) * basis).sum(-2).clamp(min=0)
        score = score * key_energy
    keep = score.topk(r, dim=-1).indices.sort(-1).values  # [..., r]
    return basis.gather(-1, keep[..., None, :].expand(*basis.shape[:-1], r)).float()


@dataclass
class Skew:
    """Per layer and KV head, the calibration queries' and keys' Gram matrices
    ``gram_q``, ``gram_k`` [L, KV, d, d], from which skew and partial columns follow."""

    gram_q: torch.Tensor
    gram_k: torch.Tensor
    meta: dict

    def projections(self, ratio: float, column_score: str = "q") -> torch.Tensor:
        """``[L, KV, d, r]``: the kept skewed columns of each layer and KV head."""
        return projection(self.gram_q, self.gram_k, ratio, column_score)

    def save(self, store_path: str | os.PathLike, name: str = SKEW_DIR,
             replace: bool = True) -> Path:
        """Write into a weight store's folder ``name``, atomically (a temporary folder, then
        a rename): an interrupted write never leaves a skew that loads. ``replace=False``
        leaves one already there as it is."""
        dest = Path(store_path) / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            np.save(tmp / "gram_q.npy", self.gram_q.double().numpy(), allow_pickle=False)
            np.save(tmp / "gram_k.npy", self.gram_k.double().numpy(), allow_pickle=False)
            (tmp / "meta.json").write_text(json.dumps(self.meta, indent=1))
            if dest.exists() and replace:
                shutil.rmtree(dest)
            if not dest.exists():
                os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    @classmethod
    def load(cls, store_path: str | os.PathLike, name: str = SKEW_DIR) -> "Skew | None":
        """The skew stored in the store's folder ``name``, or None (none stored, or one
        written by an older version)."""
        folder = Path(store_path) / name
        if not all((folder / n).is_file() for n in ("meta.json", "gram_q.npy", "gram_k.npy")):
            return None
        read = lambda n: torch.from_numpy(np.load(folder / n, allow_pickle=False))  # noqa: E731
        try:
            return cls(read("gram_q.npy"), read("gram_k.npy"),
                       json.loads((folder / "meta.json").read_text()))
        except (OSError, ValueError):  # being replaced by another process: as if absent
            return None


def compute_skew(records: dict[int, list], num_layers: int, kv_heads: int) -> Skew:
    """Query and key Gram matrices of every layer from the recorded prompt tokens. A pipeline
    rank records only its own layers: the others get identity matrices, never used."""
    grams = {}
    for layer, rows in records.items():
        q = torch.cat([r[0] for r in rows])  # [n, H, d]
        k = torch.cat([r[1] for r in rows])  # [n, KV, d]
        grams[layer] = query_gram(q, kv_heads), key_gram(k)
    some = next(iter(grams.values()))[0]
    absent = torch.eye(some.shape[-1], dtype=some.dtype).expand(some.shape).clone()
    gq = [grams[i][0] if i in grams else absent for i in range(num_layers)]
    gk = [grams[i][1] if i in grams else absent for i in range(num_layers)]
    return Skew(torch.stack(gq), torch.stack(gk), {})


def calibration_key(ctx: PolicyContext, text: str | None,
                    max_tokens: int = CALIBRATION_TOKENS) -> str:
    """The name a run's calibration is kept under in its weight store: a hash of all it
    depends on (the text, the model, the placement with its weight compression, the
    dtype, the device and the thread count), so that a run loads only the matrices it would
    have computed itself (the same numbers, so the same tokens)."""
    # "policy": the placement's old name, kept so that kept calibrations keep their keys
    what = {"format": CALIBRATION_FORMAT, "model": ctx.cfg.name, "layers": ctx.cfg.num_layers,
            "text": hashlib.sha256((text or DEFAULT_CALIBRATION).encode()).hexdigest(),
            "max_tokens": max_tokens, "policy": dataclasses.asdict(ctx.placement),
            "dtype": str(ctx.dtype), "device": ctx.tiers.device.type,
            "threads": torch.get_num_threads()}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]


def kept_calibration(store_path, key: str) -> "Skew | None":
    return Skew.load(store_path, f"{KEPT_DIR}/{key}")


def keep_calibration(skew: Skew, store_path, key: str) -> bool:
    """Keep a run's calibration in its store for later runs like it; False (nothing kept)
    where the store cannot be written."""
    try:
        skew.save(store_path, f"{KEPT_DIR}/{key}", replace=False)
    except OSError:
        return False
    return True


def calibrate(ctx: PolicyContext, text: str | None = None,
              max_tokens: int = CALIBRATION_TOKENS) -> Skew:
    """Run the model's prefill on calibration text and compute the skew (weights unchanged)."""
    cfg = ctx.cfg
    ids = ctx.tokenizer.encode(text or DEFAULT_CALIBRATION) if ctx.tokenizer is not None else []
    source = "built-in text" if text is None else "calibration file"
    if len(ids) < 2:  # dummy weights have no tokenizer, and a vocabulary without words makes
        # nothing of the text: seeded random tokens in the vocabulary
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(10, cfg.vocab_size, (512,), generator=gen).tolist()
        source = "random tokens (no tokenizer, or no tokens in the text)"
    ids = ids[:min(max_tokens, cfg.max_positions - 1)]
    records: dict[int, list] = {}

    def record(layer: int, q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor) -> None:
        keep = valid.cpu()
        records.setdefault(layer, []).append((q.float().cpu()[keep], k.float().cpu()[keep]))

    ctx.run_prompt(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool), record)
    skew = compute_skew(records, cfg.num_layers, cfg.num_kv_heads)
    skew.meta.update({"source": source, "tokens": len(ids), "model": cfg.name})
    return skew


def project_per_head(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """``[b, n, KV, r]``: rows ``x`` ``[b, n, KV, d]`` times their KV head's projection
    ``[b, KV, d, r]``. The calibrated projection is one ``[KV, d, r]`` expanded over the batch
    (stride 0), or there is one sequence: then one product per KV head, nothing expanded
    (an einsum would copy it b times at every call, and costs twice a product's time)."""
    fused = cpu_kernels.project_heads(x, projection)  # float32 on a CPU: one kernel call
    if fused is not None:
        return fused
    b, n, kv, d = x.shape
    if projection.stride(0) != 0 and b > 1:
        return torch.einsum("bnkd,bkdr->bnkr", x, projection)
    rows = x.permute(2, 0, 1, 3).reshape(kv, b * n, d)
    out = torch.bmm(rows, projection[0])  # [KV, b * n, r]
    return out.view(kv, b, n, -1).permute(1, 2, 0, 3)
