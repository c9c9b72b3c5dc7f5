"""A decode step of a Llama-family layer on a CPU as one compiled call
(``kernels/decode_layer.c``), instead of a few hundred torch operations and kernel calls.

The engine asks :class:`FusedDecode` first for every attention, MLP or whole-layer stage of a
decode step. What a stage gets is decided once per stage and batch (its *plan*), from what
is loaded, never per step:

- **Everything fused** (one call): the layer's weights are float32 rows, or 4-bit/8-bit codes
  with float32 or float16 scales (``PackedWeight``), kept in CPU memory; the KV cache is the
  full cache (``kv/full.py``) in CPU memory as floats, read in place; the next layer's cache
  speculates on nothing (a full cache) and is in this process. The call normalizes,
  projects, rotates, writes the new token into the cache, attends over every row, projects
  out, adds the residual and runs the MLP.
- **InfiniGen in the call** (one call): an InfiniGen cache in CPU memory as floats (not for
  q/k norms: the call's speculation query has none); the
  call attends over the rows the previous layer chose (or every row, a step read whole) and
  speculates for the next layer (:mod:`.fused_select`, ``kernels/decode_select.c``).
- **Around the policy's attention** (two calls): any other KV policy (a 4-bit cache, H2O ...)
  or an InfiniGen step the call does not take. The first call gives the attention input and
  the rotated q, k, v; the policy speculates and attends as it does on the per-operation path;
  the second call runs the o-projection, the residual and the MLP.
- **Not at all** (``plan`` is None: the per-operation path): another family or a variant the
  kernel does not compute (a MoE layer's MLP stage, which has its own call:
  :mod:`.fused_moe`), a GPU, a dtype
  other than float32, weights off the CPU or in a form the kernels do not read (e.g. 4-bit
  codes in groups the 4-bit kernel does not take), more than ``MAX_BATCH`` rows, no
  compiler, or ``FLEXGEN_INFINIGEN_FUSED=0``.

The argument block (a ``ctypes.Structure``) is built once per plan; a step sets the few
pointers that change (hidden state, rotary encoding, mask, the cache row), so Python's cost
per layer is a handful of attribute writes and one foreign call, whatever the layer's size.
"""
from __future__ import annotations

import ctypes
import os

import torch

from ..config import ModelConfig
from ..kv.base import KVCache
from ..kv.full import FullCache
from .cpu_kernels import library
from .fused_args import ATTEND, IN, MLP, OUT, _Args, _linear
from .tiers import DEVICE

ENV = "FLEXGEN_INFINIGEN_FUSED"
MAX_BATCH = 16  # rows a decode step's linear kernels are written for (cpu_layers)
def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def supports(cfg: ModelConfig, dtype: torch.dtype, is_cuda: bool) -> bool:
    """Whether a model of this config may take the fused step at all (decided at load)."""
    return (enabled() and not is_cuda and dtype == torch.float32
            and cfg.family == "llama"
            and cfg.q_dim == cfg.num_heads * cfg.head_dim and cfg.head_dim % 8 == 0
            and cfg.head_dim <= 256 and cfg.num_heads % cfg.num_kv_heads == 0
            and cfg.num_heads // cfg.num_kv_heads <= 16)


class LayerPlan:
    """One stage's fused call for one batch: the argument block and its scratch buffers."""

    def __init__(self, lib, cfg: ModelConfig, kind: str, w: dict, batch: int,
                 cache: KVCache | None, whole: bool, next_cache: KVCache | None = None,
                 selects: bool = False):
        self.lib, self.cfg, self.kind, self.batch = lib, cfg, kind, batch
        self.weights = tuple(w.values())  # kept alive: the block holds their pointers
        self.whole = whole  # attention inside the call (the full cache, read in place)
        self.select = None  # InfiniGen's layer inside the call (fused_select), when it takes it
        a = self.args = _Args()
        b, h, kv, d = batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        a.B, a.H, a.KV, a.D = b, h, kv, d
        a.hidden, a.inter, a.eps = cfg.hidden_size, cfg.intermediate_size, cfg.norm_eps
        self.ok = True
        q4 = bool(lib.decode_layer_q4_ready())
        names = []
        if kind in ("attn", "layer"):
            a.attn_norm = w["attn_norm.weight"].data_ptr()
            names += ["q", "k", "v", "o"]
        if kind in ("mlp", "layer"):
            a.mlp_norm = w["mlp_norm.weight"].data_ptr()
            names += ["gate", "up", "down"]
        for n in names:
            if not _linear(getattr(a, n), w[f"{n}_proj.weight"], w.get(f"{n}_proj.bias"), q4):
                self.ok = False
                return
        for n in ("attn_norm.weight", "mlp_norm.weight", "q_norm.weight", "k_norm.weight"):
            t = w.get(n)
            if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.float32
                                  or not t.is_contiguous()):
                self.ok = False
                return
        if kind in ("attn", "layer") and cfg.qk_norm:  # q and k norms (Qwen3, OLMoE)
            a.q_norm, a.k_norm = (w[f"{n}_norm.weight"].data_ptr() for n in ("q", "k"))
            a.qk_full = int(cfg.qk_norm_full)
        hidden, f = cfg.hidden_size, cfg.intermediate_size
        self.buffers = {"lin": b * h * d, "mid": b * hidden, "x2": b * hidden, "g": b * f,
                        "u": b * f}
        if whole or selects:
            self.buffers.update(x=b * hidden, q_rot=b * h * d, kn=b * kv * d, vn=b * kv * d,
                                attn=b * h * d, bias_rows=b * kv * cache.spec.max_len)
            self._point_cache(cache)
        self.buffers = {n: torch.empty(size, dtype=torch.float32)
                        for n, size in self.buffers.items()}
        for n, t in self.buffers.items():
            setattr(a, n, t.data_ptr())
        if selects:
            from .fused_select import SelectPlan
            made = SelectPlan(self, cache, next_cache, q4)
            self.select = made if made.ok else None

    def _point_cache(self, cache) -> None:
        """The cache's rows where they are (a full cache, or InfiniGen's in CPU memory)."""
        a = self.args
        k, v = cache.k.view(), cache.v.view()
        a.st, a.sc = k.stride(0), k.stride(1)
        a.kc, a.vc = k.data_ptr(), v.data_ptr()
        self.first_visible = cache.spec.first_visible
        # the new token's row crosses what the per-operation path's cache write counts
        seg = cache.k.segments[0]
        self.count = None if seg.tier == DEVICE else (
            cache.spec.tiers, 2 * self.batch * self.cfg.kv_dim * 4)

    def _call(self, mode: int) -> None:
        self.args.nthreads = torch.get_num_threads()
        if not self.lib.decode_layer(ctypes.byref(self.args), mode):
            raise RuntimeError("decode_layer: a linear kernel refused its inputs")

    def _step(self, h: torch.Tensor, state) -> torch.Tensor:
        """Point the block at this step's input and encoding; the output tensor."""
        a = self.args
        out = torch.empty_like(h)
        a.h, a.h_out = h.data_ptr(), out.data_ptr()
        if state is not None:
            cos, sin = state.pos_enc
            a.cos, a.sin = cos.data_ptr(), sin.data_ptr()
        return out

    def whole_layer(self, h: torch.Tensor, state) -> torch.Tensor:
        """The stage in one call, attention over the full cache included."""
        out = self._step(h, state)
        self.point_mask(state)
        self._call(IN | ATTEND | OUT | (MLP if self.kind == "layer" else 0))
        self.count_row()
        return out

    def point_mask(self, state) -> None:
        """This step's position and mask, for attention over every visible row."""
        a = self.args
        length = state.visible.shape[1] - 1
        a.position, a.first = length, self.first_visible(length)
        a.bias, a.bias_stride = state.bias.data_ptr(), state.bias.shape[-1]

    def count_row(self) -> None:
        """The new token's row, written into the cache by the call, counted as the
        per-operation path's cache write counts it."""
        if self.count is not None:
            tiers, n = self.count
            tiers.count("device->host", "kv_cache", n)

    def attention_inputs(self, h: torch.Tensor, state):
        """x [b, 1, hidden] and the rotated q [b, 1, H, d], k and v [b, 1, KV, d] (fresh
        tensors: the policy may keep them)."""
        a, cfg, b = self.args, self.cfg, self.batch
        x = torch.empty_like(h)
        q = torch.empty(b, 1, cfg.num_heads, cfg.head_dim)
        k = torch.empty(b, 1, cfg.num_kv_heads, cfg.head_dim)
        v = torch.empty_like(k)
        a.x, a.q_rot, a.kn, a.vn = x.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr()
        self._step(h, state)
        a.h_out = None
        self._call(IN)
        return x, q, k, v

    def attention_output(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The o-projection and its residual (and the MLP, for a whole layer)."""
        attn = attn.float().contiguous()
        out = self._step(h, None)
        self.args.attn = attn.data_ptr()
        self._call(OUT | (MLP if self.kind == "layer" else 0))
        return out

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        out = self._step(h, None)
        self._call(MLP)
        return out


class FusedDecode:
    """The engine's fused decode stages: their plans, made at the first decode step."""

    def __init__(self, lib, cfg: ModelConfig):
        self.lib, self.cfg = lib, cfg
        self.plans: dict[tuple[int, int], LayerPlan | None] = {}

    @classmethod
    def for_model(cls, cfg: ModelConfig, dtype: torch.dtype, is_cuda: bool):
        """The fused step for this model, or None (it then never runs: decided at load)."""
        if not supports(cfg, dtype, is_cuda):
            return None
        lib = library()
        if lib is None or not hasattr(lib, "decode_layer"):
            return None
        lib.decode_layer.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.decode_layer.restype = ctypes.c_int
        lib.decode_layer_q4_ready.restype = ctypes.c_int
        return cls(lib, cfg)

    def reset(self) -> None:
        """A new block: caches and batch sizes are new, plans are remade."""
        self.plans.clear()

    def plan(self, j: int, k: int, kind: str, w: dict, batch: int, resident: bool,
             cache: KVCache | None, next_cache: KVCache | None, hands_off: bool):
        """Stage ``j``'s plan for batch ``k``, made once; None: the per-operation path."""
        key = (j, k)
        if key in self.plans:
            return self.plans[key]
        plan = None
        # a MoE model's attention stages only: its MLPs (routed experts, or dense among
        # them) run on the per-operation path, a decode step's experts in their own call
        # (cpu_layers.moe_experts)
        moe_mlp = bool(self.cfg.num_experts) and kind != "attn"
        if resident and 0 < batch <= MAX_BATCH and not moe_mlp:
            whole = (kind != "mlp" and type(cache) is FullCache and cache.in_place
                     and cache.k.dtype == torch.float32 and not hands_off
                     and (next_cache is None
                          or type(next_cache).speculate is KVCache.speculate))
            from .fused_select import takes
            selects = (kind != "mlp" and not whole and not hands_off
                       and takes(cache, next_cache, self.cfg.qk_norm))
            made = LayerPlan(self.lib, self.cfg, kind, w, batch, cache, whole, next_cache,
                             selects)
            plan = made if made.ok else None
        self.plans[key] = plan
        return plan

