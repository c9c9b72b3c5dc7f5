"""Scaled dot-product attention with grouped-query heads and a padding/causal mask."""
from __future__ import annotations

import math

import torch

from . import cpu_kernels


def in_window(q_len: int, k_len: int, window: int, device=None) -> torch.Tensor:
    """[q_len, k_len] True where the key is among the ``window`` newest the query may see.

    The last ``q_len`` keys are the queries themselves. Real tokens sit contiguously after
    left padding, so a distance in columns is a distance in positions."""
    q_col = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    return q_col - torch.arange(k_len, device=device)[None, :] < window


def visible(valid: torch.Tensor, window: int) -> torch.Tensor:
    """``valid`` [b, k_len] narrowed to what the newest token may attend to (the newest
    ``window`` keys, itself included); unchanged when ``window`` is 0 (no sliding window)."""
    if not window or window >= valid.shape[1]:
        return valid
    return valid & in_window(1, valid.shape[1], window, valid.device)


def mask_bias(valid: torch.Tensor, q_len: int, dtype: torch.dtype, window: int = 0) -> torch.Tensor:
    """Additive bias [b, 1, q_len, k_len] from ``valid`` [b, k_len] (True = a real token).

    The last ``q_len`` keys are the queries themselves, so the bias is causal among them;
    with a sliding ``window`` each query also sees only the newest ``window`` keys.
    """
    k_len = valid.shape[1]
    allowed = valid[:, None, None, :].clone()
    if q_len > 1:
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=valid.device).tril(k_len - q_len)
        allowed = allowed & causal
    if window and window < k_len:
        allowed = allowed & in_window(q_len, k_len, window, valid.device)
    neg = torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill(~allowed, neg)


# Float32 scores of one query chunk are kept under this size (a long prompt's full score
# matrix would be batch x heads x prompt^2 x 4 bytes: 23 GB for OPT-13B at batch 20, 1920).
SCORE_CHUNK_BYTES = 256 << 20


def score_rows(batch: int, heads: int, keys: int) -> int:
    """Query rows per chunk so that one chunk's float32 scores stay under the limit."""
    return max(1, SCORE_CHUNK_BYTES // (4 * batch * heads * keys))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
           return_key_mass: bool = False):
    """Attention output [b, s, H*d], computed in chunks of query rows for long inputs.

    q: [b, s, H, d]; k, v: [b, t, KV, d] with H a multiple of KV; bias: [b, 1, s, t].
    Queries are scaled before the product (no fp16 overflow); softmax runs in float32.
    With ``return_key_mass`` also the attention each key receives, summed over query heads
    and query positions: [b, KV, t].
    """
    rows = score_rows(q.shape[0], q.shape[2], k.shape[1])
    if q.shape[1] <= rows:
        return _attend_block(q, k, v, bias, return_key_mass)
    outs, mass = [], None
    for start in range(0, q.shape[1], rows):
        part = slice(start, start + rows)
        got = _attend_block(q[:, part], k, v, bias[:, :, part], return_key_mass)
        if return_key_mass:
            got, m = got
            mass = m if mass is None else mass + m
        outs.append(got)
    out = torch.cat(outs, dim=1)
    return (out, mass) if return_key_mass else out


def attend_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                  window: int = 0, rows: int | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a prompt (or a chunk of one) through torch's fused attention,
    without any [q, k]-sized mask.

    q: [b, s, H, d]; k, v: [b, t, KV, d], the last ``s`` keys being the queries' own;
    ``valid`` [b, t]. Query rows go in chunks (``rows``), each with its own boolean mask over
    only the keys it may see (up to its last query), so the causal half of the score matrix
    is never computed. Equal to ``attend(q, k, v, mask_bias(valid, s, ...))`` on real query
    rows; padding query rows are zero. With ``sinks`` [H] (a logit per query head in each
    softmax's normalizer, gpt-oss's) the probabilities are materialized in chunks of query
    rows instead (torch's fused kernels take no sink).
    """
    if sinks is not None:
        fused = _causal_with_sinks(q, k, v, valid, window, sinks)
        return fused if fused is not None else \
            _attend_prompt_sinks(q, k, v, valid, window, rows, sinks)
    return _attend_prompt_fused(q, k, v, valid, window, rows)


def _causal_with_sinks(q, k, v, valid, window: int, sinks: torch.Tensor):
    """:func:`attend_prompt` with sinks through torch's fused CPU kernel, which also returns
    each query's log normalizer ``lse``: a sink adds exp(sink) to the normalizer, so the
    output is the kernel's times exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink).
    Only a causal prompt of its own, without padding or window, float32 on a CPU (else
    None: the chunked path)."""
    b, s, heads, d = q.shape
    fused = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if (fused is None or window or k.shape[1] != s or q.device.type != "cpu"
            or q.dtype != torch.float32 or not bool(valid.all())):
        return None
    group = heads // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(group, 1)
    vt = v.transpose(1, 2).repeat_interleave(group, 1)
    out, lse = fused(qt, kt, vt, is_causal=True, scale=1.0 / math.sqrt(d))  # [b, H, s, d]
    keep = torch.sigmoid(lse - sinks.float().view(1, heads, 1))  # [b, H, s]
    return (out * keep[..., None]).transpose(1, 2).reshape(b, s, heads * d)


def _attend_prompt_sinks(q, k, v, valid, window: int, rows: int | None, sinks: torch.Tensor):
    """:func:`attend_prompt` with attention sinks: chunks of ``rows`` query rows (default:
    float32 scores under ``SCORE_CHUNK_BYTES``), each over only the keys it may see."""
    b, s, heads, d = q.shape
    t, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    rows = rows or score_rows(b, heads, t)
    offset = t - s
    out = torch.zeros(b, s, heads * d, dtype=q.dtype, device=q.device)
    for start in range(0, s, rows):
        stop = min(s, start + rows)
        first = max(0, offset + start + 1 - window) if window else 0
        end = offset + stop
        bias = _chunk_bias(valid[:, first:end], start + offset - first, stop - start, q.dtype,
                           window)
        probs = _probabilities(q[:, start:stop], k[:, first:end], bias, sinks)
        n = stop - start
        got = torch.matmul(probs.to(v.dtype).reshape(b, kv_heads, group * n, -1),
                           v[:, first:end].permute(0, 2, 1, 3))
        got = got.view(b, kv_heads, group, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, -1)
        real = valid[:, offset + start:offset + stop, None]  # padding queries: zeros
        out[:, start:stop] = torch.where(real, got, 0.0)
    return out


# the fused key mass holds about this many q-sized float32 tensors at once (repeated keys,
# zero values, the extended copies and both calls' outputs); above the budget the chunked
# path, whose scores stay under SCORE_CHUNK_BYTES, is taken instead
FUSED_MASS_COPIES = 10
FUSED_MASS_BYTES = 2 << 30


def prompt_key_mass(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, window: int = 0,
                    rows: int | None = None) -> torch.Tensor:
    """The attention each key of a prompt receives, summed over query heads and the real
    query positions: [b, KV, t] (what H2O scores its heavy hitters by).

    Shapes as :func:`attend_prompt`. A float32 prompt on the CPU with no padding, prefix or
    window goes through the fused kernel (:func:`_key_mass_fused`). Otherwise the
    probabilities are materialized in chunks of ``rows`` query rows (default: float32 scores
    under ``SCORE_CHUNK_BYTES``), each over only the keys it may see; no values are read.
    """
    b, s, heads, _ = q.shape
    t, kv_heads = k.shape[1], k.shape[2]
    if (s == t and not window and q.device.type == "cpu" and q.dtype == torch.float32
            and k.dtype == torch.float32 and bool(valid.all())
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
            and FUSED_MASS_COPIES * 4 * b * heads * t * (q.shape[-1] + 8) <= FUSED_MASS_BYTES):
        return _key_mass_fused(q, k)
    rows = rows or score_rows(b, heads, t)
    offset = t - s  # keys before the first query (a cached prefix)
    mass = torch.zeros(b, kv_heads, t, device=q.device)
    for start in range(0, s, rows):
        stop = min(s, start + rows)
        first = max(0, offset + start + 1 - window) if window else 0  # the window's oldest key
        end = offset + stop  # keys after the chunk's last query are never seen
        bias = _chunk_bias(valid[:, first:end], start + offset - first, stop - start, q.dtype,
                           window)
        real = valid[:, offset + start:offset + stop]  # padding queries add no mass
        per_query = _probabilities(q[:, start:stop], k[:, first:end], bias).sum(2)
        # [b, KV, 1, n] x [b, KV, n, keys]: the real query rows' sum
        mass[:, :, first:end] += torch.matmul(real.float()[:, None, None, :], per_query)[:, :, 0]
    return mass


def _key_mass_fused(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """:func:`prompt_key_mass` of a causal prompt with no padding, prefix or window, through
    two calls of torch's fused CPU attention (no probabilities materialized).

    Key j's mass is sum over queries i >= j of exp(q_i.k_j / sqrt(d) - lse_i), lse_i being
    query i's log normalizer. The first call returns every lse_i; the second swaps the roles
    (each key asks, the queries answer) with -lse_i as one more key dimension, so its own
    log normalizer for key j is log(mass_j). Both sequences are reversed in the second call,
    which turns "i >= j" into the kernel's causal mask. The kernel takes only values of the
    query's head size, so each call also multiplies zeros it does not need: still fewer
    passes over memory than the probabilities."""
    b, t, heads, d = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(d)
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qt = q.transpose(1, 2).contiguous()  # [b, H, t, d]
    kt = k.transpose(1, 2).repeat_interleave(group, 1)  # [b, H, t, d]
    _, lse = fused(qt, kt, torch.zeros_like(qt), is_causal=True, scale=scale)  # [b, H, t]
    # one extra dimension carries -lse; the other 7 are zeros
    extra = torch.zeros(b, heads, t, 8, dtype=q.dtype)
    asks = torch.cat([kt, extra], -1)
    asks[..., d] = 1.0
    answers = torch.cat([qt, extra], -1)
    answers[..., d] = -lse / scale
    asks, answers = asks.flip(2), answers.flip(2)
    _, log_mass = fused(asks, answers, torch.zeros_like(asks), is_causal=True, scale=scale)
    return log_mass.flip(2).exp().view(b, kv_heads, group, t).sum(2)


# a fused chunk's boolean mask [b, 1, rows, keys] stays under this many bytes, and its rows
# under FUSED_ROWS (smaller chunks skip more of the causal half, larger ones call the kernel
# fewer times)
FUSED_MASK_BYTES = 64 << 20
FUSED_ROWS = 512
# devices where masked prompt chunks of a GQA model attend over K and V repeated per query
# head (once a layer): CUDA's fused kernels that take a mask take no GQA broadcast
EXPAND_GQA_ON = ("cuda",)


def _attend_prompt_fused(q, k, v, valid, window: int, rows: int | None):
    """:func:`attend_prompt` through torch's fused attention (scores never materialized):
    query chunks, each with its boolean mask and only the keys it may see."""
    b, s, heads, d = q.shape
    t = k.shape[1]
    offset = t - s
    if offset and not window:
        # known columns that are padding in every row (a block's free columns for requests
        # that join it, the rows' common left padding): no query sees a key there, so they
        # are left out (all of the known prefix: the call is the prompt's own)
        seen = valid[:, :offset].any(0)
        lead = offset if not bool(seen.any()) else int(seen.to(torch.uint8).argmax())
        if lead:
            k, v, valid = k[:, lead:], v[:, lead:], valid[:, lead:]
            t, offset = t - lead, offset - lead
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if offset == 0 and not window and bool(valid.all()):
        # no padding, no prefix, no window: one causal call (torch's kernel skips the
        # masked blocks itself and needs no mask; equal to the chunks)
        return _sdpa(qt, kt, vt, None, causal=True).transpose(1, 2).reshape(b, s, heads * d)
    pads = _left_padding(valid) if offset == 0 and not window else None
    if pads is not None:
        # left padding only: the rows of each padding length take the causal call of their
        # real tokens alone, the call a prompt gets by itself, so that each row's floats
        # do not depend on the rows beside it (a mask would change the kernel's sums, and
        # 8-bit activations turn the last bit into a different token)
        out = torch.zeros(b, s, heads, d, dtype=q.dtype, device=q.device)
        for pad in sorted(set(pads.tolist())):
            if pad == s:
                continue  # a row of padding only: zeros
            rows = (pads == pad).nonzero()[:, 0]
            if len(rows) == b:
                got = _sdpa(qt[:, :, pad:], kt[:, :, pad:], vt[:, :, pad:], None, causal=True)
                out[:, pad:] = got.transpose(1, 2)
            else:
                got = _sdpa(qt[rows, :, pad:], kt[rows, :, pad:], vt[rows, :, pad:], None,
                            causal=True)
                out[rows, pad:] = got.transpose(1, 2)
        return out.reshape(b, s, heads * d)
    rows = min(rows or FUSED_ROWS, FUSED_ROWS, max(1, FUSED_MASK_BYTES // max(1, b * t)))
    if kt.shape[1] != heads and q.device.type in EXPAND_GQA_ON:
        # a mask rules out the flash kernel, and the other fused kernels take no GQA
        # broadcast: without this, every chunk would fall to the math kernel (scores
        # materialized, K and V repeated per chunk). Repeated once for the layer instead.
        group = heads // kt.shape[1]
        kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    out = torch.empty(b, s, heads, d, dtype=q.dtype, device=q.device)
    for start in range(0, s, rows):
        stop = min(s, start + rows)
        first = max(0, offset + start + 1 - window) if window else 0
        end = offset + stop
        mask = _chunk_allowed(valid[:, first:end], start + offset - first, stop - start, window)
        got = _sdpa(qt[:, :, start:stop], kt[:, :, first:end], vt[:, :, first:end], mask)
        real = valid[:, offset + start:offset + stop, None, None]  # padding queries: zeros
        out[:, start:stop] = torch.where(real, got.transpose(1, 2), 0.0)
    return out.reshape(b, s, heads * d)


def _left_padding(valid: torch.Tensor) -> torch.Tensor | None:
    """Each row's count of leading padding [b] when every row of ``valid`` [b, t] is padding
    then real tokens, else None."""
    pads = (~valid).sum(1)
    expected = torch.arange(valid.shape[1], device=valid.device)[None, :] >= pads[:, None]
    return pads if bool((expected == valid).all()) else None


def _sdpa(q, k, v, mask, causal: bool = False):
    """Fused attention of [b, H, n, d] queries over [b, KV, t, d] keys (GQA)."""
    import torch.nn.functional as F
    if k.shape[1] == q.shape[1]:  # no broadcast asked for: every fused kernel may take it
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=True)
    except TypeError:  # torch before 2.5: no enable_gqa
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                              v.repeat_interleave(group, 1), attn_mask=mask,
                                              is_causal=causal)


def _chunk_allowed(valid: torch.Tensor, first_query: int, n: int, window: int) -> torch.Tensor:
    """Boolean [b, 1, n, k]: real keys at or before each query (inside the window)."""
    q_col = torch.arange(first_query, first_query + n, device=valid.device)[:, None]
    k_col = torch.arange(valid.shape[1], device=valid.device)[None, :]
    allowed = k_col <= q_col
    if window:
        allowed = allowed & (q_col - k_col < window)
    return valid[:, None, None, :] & allowed


def _chunk_bias(valid: torch.Tensor, first_query: int, n: int, dtype: torch.dtype,
                window: int) -> torch.Tensor:
    """Bias [b, 1, n, k] for queries at key columns ``first_query .. first_query + n`` of the
    keys ``valid`` [b, k] covers: real keys at or before the query (inside the window)."""
    allowed = _chunk_allowed(valid, first_query, n, window)
    neg = torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=valid.device).masked_fill(~allowed, neg)


def _probabilities(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 softmax probabilities [b, KV, group, s, t] of queries [b, s, H, d] over keys
    [b, t, KV, d] with an additive ``bias`` broadcastable to [b, 1, s, t]; with ``sinks``
    [H], each head's sink logit joins the normalizer (its probability is dropped)."""
    b, s, heads, d = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    # [b, KV, group*s, d] so that one matmul serves every query head of a KV head
    qg = q.view(b, s, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * s, d)
    kt = k.permute(0, 2, 3, 1)  # [b, KV, d, t]
    # scaled before the product: q.k of a large model can pass fp16's range, q.k / sqrt(d) not
    scores = torch.matmul(qg * (1.0 / math.sqrt(d)), kt).float()
    scores = scores.view(b, kv_heads, group, s, -1) + bias[:, :, None].float()
    return _softmax(scores, sinks)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of float32 ``scores`` [b, KV, group, ..., t]; with ``sinks``
    [KV * group] (query heads in order), one more column per head holds its sink logit and
    is dropped after the softmax."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    b, kv_heads, group = scores.shape[:3]
    shape = (1, kv_heads, group) + (1,) * (scores.dim() - 3)
    sink = sinks.to(scores.device, torch.float32).view(shape).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :-1]


def _attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                  return_key_mass: bool = False):
    """One chunk of query rows of :func:`attend`."""
    b, s, heads, d = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    probs = _probabilities(q, k, bias)
    out = torch.matmul(probs.to(v.dtype).view(b, kv_heads, group * s, -1), v.permute(0, 2, 1, 3))
    out = out.view(b, kv_heads, group, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, heads * d)
    return (out, probs.sum((2, 3))) if return_key_mass else out


def attend_rows(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, bias: torch.Tensor,
                return_key_mass: bool = False, sinks: torch.Tensor | None = None):
    """Decode attention of one new token over keys and values kept token-major, as the cache
    stores them, without reordering them first.

    q: [b, 1, H, d]; k_rows, v_rows: [t, b*KV, d]; bias: additive, broadcastable to
    [b, KV, 1, t]. Returns [b, 1, H*d] (and with ``return_key_mass`` the attention each key
    receives summed over the group's query heads, [b, KV, t]). ``sinks`` [H]: each query
    head's sink logit in the normalizer (gpt-oss).
    """
    b, _, heads, d = q.shape
    t, cols, _ = k_rows.shape
    kv_heads = cols // b
    group = heads // kv_heads
    qc = q.reshape(cols, group, d)
    # a CPU kernel that reads each K and V row once (cpu_kernels); never asked on a GPU,
    # where handing it the sinks would copy them to the host (a sync a layer)
    if not return_key_mass and not q.is_cuda:
        flat = bias.float().expand(b, kv_heads, 1, t).reshape(cols, t)
        out = cpu_kernels.attend_rows(qc * (1.0 / math.sqrt(d)), k_rows, v_rows, flat,
                                      sinks=column_sinks(sinks, b))
        if out is not None:
            return out.view(b, 1, heads * d).to(q.dtype)
    scores = torch.bmm(qc * (1.0 / math.sqrt(d)), k_rows.permute(1, 2, 0)).float()
    scores = scores.view(b, kv_heads, group, t) + bias.float()
    probs = _softmax(scores, sinks)
    out = torch.bmm(probs.to(v_rows.dtype).view(cols, group, t), v_rows.permute(1, 0, 2))
    out = out.view(b, 1, heads * d)
    return (out, probs.sum(2)) if return_key_mass else out


def column_sinks(sinks: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """Sinks [H] as the CPU kernels take them: one per (column, head of its group),
    ``[batch * H]`` float32 (a column is a row's KV head; its group's heads follow)."""
    if sinks is None:
        return None
    return sinks.float().cpu().repeat(batch).contiguous()
