"""A 4-bit KV cache in KIVI's layout (Liu et al., 2024): keys quantized per channel, values per
token, and the newest tokens kept in float.

Keys have outlier channels: a few of the head's dimensions are large for every token. Groups
along a token's channels (the runtime's ``--compress-cache``) then share a scale with an
outlier and blur every other channel; groups along the token axis, one scale and minimum per
channel for ``group`` consecutive tokens, do not. Values have no such channels and are
quantized per token, in groups of ``group`` channels. A key group can only be quantized once
its ``group`` tokens exist, so the newest tokens stay in float: at least ``window`` of them and
fewer than ``window + group`` (the oldest whole group is quantized when the float rows reach
``window + group``). A prompt is attended to in float during prefill, as the other caches do.

Codes are two 4-bit values a byte; each group's scale and minimum are float16. Decode
attention reads the codes expanded to floats, plus the float rows and the new token.
"""
from __future__ import annotations

import argparse

import torch

from ..config import ConfigError
from ..kernels.attention import attend_rows
from ..memory.tiers import DEVICE
from .base import CacheSpec, KVCache, KVPolicy, Loaded
from .full import to_rows

GROUP = 32  # tokens per key group, channels per value group (KIVI's setting)
WINDOW = 128  # float tokens at least (KIVI's residual length)
LEVELS = 15  # 4 bits


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes of ``x`` with one float16 minimum and scale per slice along
    ``dim`` (the group's axis): (codes uint8 0..15 shaped like ``x``, minimum, scale) with
    ``dim`` kept as size 1."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    lo16 = lo.to(torch.float16)
    scale16 = ((hi - lo16.float()) / LEVELS).to(torch.float16)
    step = scale16.float()
    codes = torch.where(step > 0, (x.float() - lo16.float()) / step.clamp_min(1e-30),
                        torch.zeros((), dtype=torch.float32))
    return codes.round_().clamp_(0, LEVELS).to(torch.uint8), lo16, scale16


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes a byte along the last dimension (even index in the low half)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8,
                      device=packed.device)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


class KiviCache(KVCache):
    """One layer's keys and values for one GPU batch in KIVI's layout, rows ``[0, quantized)``
    as codes and ``[quantized, length)`` in float."""

    inline = True  # nothing moves between tiers: load and store run on the compute thread

    def __init__(self, spec: CacheSpec, group: int = GROUP, window: int = WINDOW):
        if spec.window:
            raise ConfigError("--kv-policy kivi keeps every token: it does not run models with "
                              "a sliding window (use --kv-policy full)")
        d, cols = spec.head_dim, spec.batch_size * spec.kv_heads
        if d % 2 or d % min(group, d):
            raise ConfigError(f"--kivi-group {group} must divide the head size {d}")
        self.spec, self.group, self.window = spec, group, window
        self.vgroup = min(group, d)
        groups = spec.max_len // group + 1
        t = spec.tiers
        self.k_codes = t.empty(DEVICE, (spec.max_len, cols, d // 2), torch.uint8)
        self.v_codes = t.empty(DEVICE, (spec.max_len, cols, d // 2), torch.uint8)
        self.k_min, self.k_scale = (t.empty(DEVICE, (groups, cols, d), torch.float16)
                                    for _ in range(2))
        self.v_min, self.v_scale = (t.empty(DEVICE, (spec.max_len, cols, d // self.vgroup),
                                            torch.float16) for _ in range(2))
        floats = window + group
        self.k_float, self.v_float = (t.empty(DEVICE, (floats, cols, d), spec.dtype)
                                      for _ in range(2))
        self.quantized = self.length = 0

    # ---- storing ----------------------------------------------------------------------------
    def store_prompt(self, q, k, v, valid) -> None:
        k, v = to_rows(k), to_rows(v)
        n = k.shape[0]
        self.quantized = self.length = 0
        whole = max(0, (n - self.window) // self.group) * self.group
        self._quantize(k[:whole], v[:whole])
        rest = n - whole
        self.k_float[:rest] = k[whole:]
        self.v_float[:rest] = v[whole:]
        self.length = n

    def store_token(self, k_new, v_new, position: int) -> None:
        if position != self.length:
            raise RuntimeError(f"kivi cache: token {position} stored after {self.length} rows")
        f = self.length - self.quantized
        self.k_float[f] = to_rows(k_new)[0]
        self.v_float[f] = to_rows(v_new)[0]
        self.length += 1
        if f + 1 == self.window + self.group:  # the oldest whole group leaves the float rows
            g = self.group
            self._quantize(self.k_float[:g], self.v_float[:g])
            self.k_float[:f + 1 - g] = self.k_float[g:f + 1].clone()
            self.v_float[:f + 1 - g] = self.v_float[g:f + 1].clone()

    def _quantize(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows ``k``/``v`` ``[n, cols, d]`` (``n`` a multiple of the group) after the codes."""
        n = k.shape[0]
        if n == 0:
            return
        rows, g = slice(self.quantized, self.quantized + n), self.group
        cols, d = k.shape[1:]
        codes, lo, scale = quantize(k.reshape(n // g, g, cols, d), dim=1)
        self.k_codes[rows] = pack(codes.reshape(n, cols, d))
        first = self.quantized // g
        self.k_min[first:first + n // g] = lo[:, 0]
        self.k_scale[first:first + n // g] = scale[:, 0]
        codes, lo, scale = quantize(v.reshape(n, cols, d // self.vgroup, self.vgroup), dim=3)
        self.v_codes[rows] = pack(codes.reshape(n, cols, d))
        self.v_min[rows], self.v_scale[rows] = lo[..., 0], scale[..., 0]
        self.quantized += n

    # ---- reading ----------------------------------------------------------------------------
    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cached row's key and value as attention reads them, ``[length, cols, d]``."""
        n, g, dtype = self.quantized, self.group, self.spec.dtype
        cols, d = self.k_codes.shape[1], self.spec.head_dim
        k = unpack(self.k_codes[:n]).float().view(n // g, g, cols, d)
        k = (k * self.k_scale[:n // g, None].float() + self.k_min[:n // g, None].float())
        v = unpack(self.v_codes[:n]).float().view(n, cols, d // self.vgroup, self.vgroup)
        v = v * self.v_scale[:n, ..., None].float() + self.v_min[:n, ..., None].float()
        f = self.length - n
        keys = torch.cat([k.reshape(n, cols, d).to(dtype), self.k_float[:f]])
        values = torch.cat([v.reshape(n, cols, d).to(dtype), self.v_float[:f]])
        return keys, values

    def load(self, length: int) -> Loaded:
        return Loaded.later()

    def attend(self, loaded: Loaded, q, k_new, v_new, valid, bias, sinks=None) -> torch.Tensor:
        length = valid.shape[1] - q.shape[1]
        if length != self.length:
            raise RuntimeError(f"kivi cache: attention after {length} rows, {self.length} held")
        keys, values = self.dequantized()
        keys = torch.cat([keys, to_rows(k_new)])
        values = torch.cat([values, to_rows(v_new)])
        return attend_rows(q, keys, values, bias)

    def bytes_by_tier(self) -> dict[str, int]:
        held = (self.k_codes, self.v_codes, self.k_min, self.k_scale, self.v_min, self.v_scale,
                self.k_float, self.v_float)
        return {DEVICE: sum(t.numel() * t.element_size() for t in held)}

    def stored_bytes(self) -> int:
        """Bytes of the rows held now: codes, their groups' minimum and scale, and the float
        rows counted as float16 (as the fp16 cache they are compared with)."""
        n, d, cols = self.quantized, self.spec.head_dim, self.k_codes.shape[1]
        codes = 2 * n * cols * d // 2
        scales = 2 * 2 * (n // self.group * cols * d + n * cols * d // self.vgroup)
        floats = 2 * (self.length - n) * cols * d * 2
        return codes + scales + floats


class KiviPolicy(KVPolicy):
    name = "kivi"
    summary = ("every token read, stored in 4 bits in KIVI's layout: keys per channel over "
               "groups of tokens, values per token, the newest tokens in float")
    plannable = False  # the cost model knows the float and the runtime's 4-bit caches only

    def __init__(self, group: int = GROUP, window: int = WINDOW):
        if group < 2 or group % 2:
            raise ConfigError(f"--kivi-group must be an even number of 2 or more (got {group})")
        if window < 0:
            raise ConfigError(f"--kivi-window must be 0 or more (got {window})")
        self.group, self.window = group, window
        self.caches: list[KiviCache] = []

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("KIVI 4-bit cache (with --kv-policy kivi)")
        g.add_argument("--kivi-group", type=int, default=GROUP,
                       help="tokens sharing a key channel's scale; channels sharing a value's")
        g.add_argument("--kivi-window", type=int, default=WINDOW,
                       help="the newest tokens kept in float (at least this many)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "KiviPolicy":
        return cls(args.kivi_group, args.kivi_window)

    def check_placement(self, cpu_cache_compute: bool) -> None:
        if cpu_cache_compute:
            raise ConfigError("--kv-policy kivi keeps its cache where attention runs; drop "
                              "--cpu-cache-compute")

    def make_cache(self, spec: CacheSpec) -> KVCache:
        cache = KiviCache(spec, self.group, self.window)
        if spec.layer == 0 and spec.batch == 0:
            self.caches = []  # a new block's caches
        self.caches.append(cache)
        return cache

    def report(self) -> dict:
        """With ``relative_kv_size``: the bytes its rows take over an fp16 cache's (one copy
        where the values are the keys: KIVI keeps keys and values apart even then, as each
        is quantized its own way)."""
        out = {"kv_policy": self.name, "kivi_group": self.group, "kivi_window": self.window}
        rows = sum(c.length * c.k_codes.shape[1] * c.spec.head_dim
                   * (1 if c.spec.values_are_keys else 2) for c in self.caches)
        if rows:
            out["relative_kv_size"] = sum(c.stored_bytes() for c in self.caches) / (2 * rows)
        return out
