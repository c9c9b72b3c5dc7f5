"""Scaled dot-product attention with grouped-query heads and a padding/causal mask."""
from __future__ import annotations

import math

import torch


def mask_bias(valid: torch.Tensor, q_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive bias [b, 1, q_len, k_len] from ``valid`` [b, k_len] (True = a real token).

    The last ``q_len`` keys are the queries themselves, so the bias is causal among them.
    """
    k_len = valid.shape[1]
    allowed = valid[:, None, None, :].clone()
    if q_len > 1:
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=valid.device).tril(k_len - q_len)
        allowed = allowed & causal
    neg = torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill(~allowed, neg)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
           return_probs: bool = False):
    """Attention output [b, s, H*d].

    q: [b, s, H, d]; k, v: [b, t, KV, d] with H a multiple of KV; bias: [b, 1, s, t].
    Scores and softmax run in float32.
    """
    b, s, heads, d = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    # [b, KV, group*s, d] so that one matmul serves every query head of a KV head
    qg = q.view(b, s, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * s, d)
    kt = k.permute(0, 2, 3, 1)  # [b, KV, d, t]
    scores = torch.matmul(qg, kt).float() * (1.0 / math.sqrt(d))
    scores = scores.view(b, kv_heads, group, s, -1) + bias[:, :, None].float()
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(v.dtype).view(b, kv_heads, group * s, -1), v.permute(0, 2, 1, 3))
    out = out.view(b, kv_heads, group, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, heads * d)
    return (out, probs) if return_probs else out
