"""A decode step of a Llama-family layer on a CPU as one compiled call
(``kernels/c/decode_layer.c``): the argument block, its scratch buffers, and the few pointers
a step sets.

A :class:`LayerCall` is made once per stage and batch from the stage's weights as loaded
(float32 rows, or 4-bit/8-bit codes with float32 or float16 scales: ``PackedWeight``, in CPU
memory); ``ok`` is False when a weight is in a form the kernels do not read. A step then sets
the hidden state, the rotary encoding, the mask and the cache row, and makes one foreign
call, so Python's cost per layer is a handful of attribute writes whatever the layer's size.

What the call runs is a mode of :data:`IN`, :data:`ATTEND`, :data:`OUT` and :data:`MLP`:
the input half (norm, projections, rotation), attention over rows the call reads in place
(:meth:`LayerCall.read_rows_in_place`, which a KV cache points at its own rows), the output
half (o-projection and residual) and the MLP. A KV cache's own part of the call (InfiniGen's
chosen rows and the next layer's speculation) extends the block through its ``sel`` field and
its ``select_step`` slot (:mod:`..kv.infinigen.fused_select`).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Protocol

import torch

from ..config import ModelConfig
from .layer_args import ATTEND, IN, MLP, OUT, LayerArgs, point_linear

__all__ = ["ATTEND", "IN", "MLP", "OUT", "LayerCall", "StepState"]


class StepState(Protocol):
    """What a decode step gives the call (the engine's per-batch state)."""

    valid: torch.Tensor  # [b, length + 1]
    visible: torch.Tensor  # [b, length + 1]: keys the new token may see
    bias: torch.Tensor | None  # [b, 1, 1, length + 1]
    pos_enc: object  # (cos, sin) of the new token's position


class LayerCall:
    """One stage's compiled call for one batch: the argument block and its scratch buffers.

    ``kind``: "attn", "mlp" or "layer" (both); ``w``: the stage's weights as loaded."""

    def __init__(self, lib, cfg: ModelConfig, kind: str, w: dict, batch: int):
        self.lib, self.cfg, self.kind, self.batch = lib, cfg, kind, batch
        self.weights = tuple(w.values())  # kept alive: the block holds their pointers
        a = self.args = LayerArgs()
        b, h, kv, d = batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        a.B, a.H, a.KV, a.D = b, h, kv, d
        a.hidden, a.inter, a.eps = cfg.hidden_size, cfg.intermediate_size, cfg.norm_eps
        self.ok = True
        self.q4 = bool(lib.decode_layer_q4_ready())
        self.count = None  # the row count of a cache read in place (read_rows_in_place)
        names = []
        if kind in ("attn", "layer"):
            a.attn_norm = w["attn_norm.weight"].data_ptr()
            names += ["q", "k", "v", "o"]
        if kind in ("mlp", "layer"):
            a.mlp_norm = w["mlp_norm.weight"].data_ptr()
            names += ["gate", "up", "down"]
        for n in names:
            if not point_linear(getattr(a, n), w[f"{n}_proj.weight"], w.get(f"{n}_proj.bias"),
                           self.q4):
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
        self.buffers: dict[str, torch.Tensor] = {}
        self._allocate({"lin": b * h * d, "mid": b * hidden, "x2": b * hidden, "g": b * f,
                        "u": b * f})

    def _allocate(self, sizes: dict[str, int]) -> None:
        for n, size in sizes.items():
            t = torch.empty(size, dtype=torch.float32)
            self.buffers[n] = t
            setattr(self.args, n, t.data_ptr())

    def read_rows_in_place(self, k_rows: torch.Tensor, v_rows: torch.Tensor, max_len: int,
                           first_visible: Callable[[int], int],
                           on_row_written: Callable[[], None] | None) -> None:
        """Attention inside the call, over a cache's rows where they are: ``k_rows`` and
        ``v_rows`` ``[max_len, b * KV, d]`` float32 (the call writes the new token's row
        there); ``first_visible(length)``: the oldest row the new token sees;
        ``on_row_written``: counts the row the call wrote, as the cache's own write would."""
        a, cfg, b = self.args, self.cfg, self.batch
        a.st, a.sc = k_rows.stride(0), k_rows.stride(1)
        a.kc, a.vc = k_rows.data_ptr(), v_rows.data_ptr()
        self.rows = (k_rows, v_rows)
        self.first_visible = first_visible
        self.count = on_row_written
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self._allocate({"x": b * cfg.hidden_size, "q_rot": b * h * d, "kn": b * kv * d,
                        "vn": b * kv * d, "attn": b * h * d, "bias_rows": b * kv * max_len})

    def run(self, mode: int) -> None:
        self.args.nthreads = torch.get_num_threads()
        if not self.lib.decode_layer(ctypes.byref(self.args), mode):
            raise RuntimeError("decode_layer: a linear kernel refused its inputs")

    def point_step(self, h: torch.Tensor, state: StepState | None) -> torch.Tensor:
        """Point the block at this step's input and encoding; the output tensor."""
        a = self.args
        out = torch.empty_like(h)
        a.h, a.h_out = h.data_ptr(), out.data_ptr()
        if state is not None:
            cos, sin = state.pos_enc
            a.cos, a.sin = cos.data_ptr(), sin.data_ptr()
        return out

    def point_mask(self, state: StepState) -> None:
        """This step's position and mask, for attention over every visible row."""
        a = self.args
        length = state.visible.shape[1] - 1
        a.position, a.first = length, self.first_visible(length)
        a.bias, a.bias_stride = state.bias.data_ptr(), state.bias.shape[-1]

    def count_row(self) -> None:
        """The new token's row, written into the cache by the call, counted as the
        per-operation path's cache write counts it."""
        if self.count is not None:
            self.count()

    @property
    def mlp_mode(self) -> int:
        """MLP when the stage is a whole layer."""
        return MLP if self.kind == "layer" else 0

    def whole_layer(self, h: torch.Tensor, state: StepState) -> torch.Tensor:
        """The stage in one call, attention over every visible row read in place."""
        out = self.point_step(h, state)
        self.point_mask(state)
        self.run(IN | ATTEND | OUT | self.mlp_mode)
        self.count_row()
        return out

    def attention_inputs(self, h: torch.Tensor, state: StepState):
        """x [b, 1, hidden] and the rotated q [b, 1, H, d], k and v [b, 1, KV, d] (fresh
        tensors: the policy may keep them)."""
        a, cfg, b = self.args, self.cfg, self.batch
        x = torch.empty_like(h)
        q = torch.empty(b, 1, cfg.num_heads, cfg.head_dim)
        k = torch.empty(b, 1, cfg.num_kv_heads, cfg.head_dim)
        v = torch.empty_like(k)
        a.x, a.q_rot, a.kn, a.vn = x.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr()
        self.point_step(h, state)
        a.h_out = None
        self.run(IN)
        for n in ("x", "q_rot", "kn", "vn"):  # a later step in one call reads its buffers
            if n in self.buffers:
                setattr(a, n, self.buffers[n].data_ptr())
        return x, q, k, v

    def attention_output(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The o-projection and its residual (and the MLP, for a whole layer)."""
        attn = attn.float().contiguous()
        out = self.point_step(h, None)
        self.args.attn = attn.data_ptr()
        self.run(OUT | self.mlp_mode)
        return out

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        out = self.point_step(h, None)
        self.run(MLP)
        return out
