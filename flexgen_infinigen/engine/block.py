"""What one block of the schedule holds while it runs, as values the step loop is given: the
block's mode (:class:`BlockMode`, fixed for the block), one iteration's pass over some of its
GPU batches (:class:`Pass`), and the block's state (:class:`Block`: each GPU batch's inputs and
outputs, the KV caches, the offloaded hidden states)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.attention import mask_bias, visible
from ..kv.base import KVCache, PromptRecorder
from ..memory.split_tensor import SplitTensor
from .prefill_cache import Prefilled


@dataclass
class BatchState:
    """One GPU batch of a block: its inputs for the current token and its outputs so far."""

    ids: torch.Tensor  # [b, s] tokens fed at this iteration
    valid: torch.Tensor  # [b, length] True for real (not padding) tokens, inputs included
    positions: torch.Tensor  # [b, s] position ids of the inputs
    pos_enc: object = None  # the family's encoding of ``positions`` (rotary cos/sin)
    bias: torch.Tensor | None = None  # additive attention mask [b, 1, s, length]
    visible: torch.Tensor | None = None  # [b, length]: keys the newest token may see
    # (pos_enc, bias, visible) of each window when the layers' windows differ (Gemma 3);
    # empty: every layer takes the three above
    by_window: dict = field(default_factory=dict)
    hidden: object = None
    logits: torch.Tensor | None = None
    handoff: torch.Tensor | None = None  # the last layer's attention input, for the next rank

    def attention_inputs(self, window: int):
        """(pos_enc, bias, visible) for a layer with sliding window ``window``."""
        return self.by_window.get(window) or (self.pos_enc, self.bias, self.visible)

    def prepare(self, family, cfg, dtype: torch.dtype) -> "BatchState":
        """What every layer of this iteration shares: position encodings and the mask bias."""
        # per window the layers have: the family's positions of that kind of layer (Gemma 3's
        # windowed layers have their own RoPE base); decode's mask (one query row; a
        # prompt's is built per chunk by attend_prompt); what the newest token may attend
        # to (the KV policies select among these only)
        inputs = {window: (family.encode_positions(cfg, self.positions, window),
                           mask_bias(self.valid, 1, dtype, window)
                           if self.ids.shape[1] == 1 else None,
                           visible(self.valid, window))
                  for window in cfg.windows}
        self.pos_enc, self.bias, self.visible = inputs[cfg.window_of(0)]
        self.by_window = inputs if len(inputs) > 1 else {}
        return self

    def advance(self, new: torch.Tensor, family, cfg, dtype: torch.dtype) -> None:
        """The next token ``new`` [b] as input: one more column, at each row's next
        position (its visible columns so far)."""
        dev = self.valid.device
        self.ids = new.view(-1, 1).to(dev)
        self.positions = self.valid.long().sum(-1, keepdim=True)
        self.valid = torch.cat([self.valid, torch.ones_like(self.valid[:, :1])], dim=1)
        self.prepare(family, cfg, dtype)


@dataclass
class Step:
    """One iteration of a block: the token chosen for every GPU batch, its wall time, and
    the logits when asked for."""

    index: int  # 0 is the prefill
    tokens: list[torch.Tensor]  # per GPU batch, [b] on the CPU
    seconds: float
    logits: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class BlockMode:
    """How a block runs, decided when it starts.

    ``record``: the prefill only, each layer's prompt q and k handed to it instead of kept
    (calibration); ``prefilled``: the caches filled from this kept prefill of the same
    prompts instead of running it; ``capture``: this block's prefill kept there;
    ``prefill_chunk``: prompt tokens per chunk through a layer."""

    record: PromptRecorder | None = None
    prefilled: Prefilled | None = None
    capture: Prefilled | None = None
    prefill_chunk: int = 1 << 30


@dataclass(frozen=True)
class Pass:
    """One iteration over some of the block's GPU batches (all of them, or one pipeline
    micro-batch), every stage in the zig-zag order."""

    decode: bool
    batches: tuple[int, ...]
    mode: BlockMode

    @property
    def first(self) -> int:
        return self.batches[0]


@dataclass
class PrefixKV:
    """What a block's prefill starts from: every row's keys and values of the block's first
    ``length`` columns (left padding included, as zeros), by (layer, GPU batch), ``[b,
    length, KV, d]`` each. The prefill then computes only the columns after them, attending
    to these as to its own earlier keys (:mod:`.prefix_pages` keeps them across requests)."""

    length: int
    kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Block:
    """The running block's state: per GPU batch its :class:`BatchState`, per (stage, GPU
    batch) of an attention stage its KV cache, which stage holds each layer's attention,
    and the buffers hidden states are offloaded into (reused from stage to stage)."""

    states: list[BatchState] = field(default_factory=list)
    caches: dict[tuple[int, int], KVCache] = field(default_factory=dict)
    attention_stage: dict[int, int] = field(default_factory=dict)  # layer -> its stage
    activations: dict[tuple, SplitTensor] = field(default_factory=dict)
    prefix: PrefixKV | None = None  # the prefill's known first columns
    pending: list[torch.Tensor] = field(default_factory=list)  # next step's input per batch

    def next_cache(self, layer: int, batch: int) -> KVCache | None:
        """The cache of layer ``layer + 1`` for ``batch``, when it runs in this process."""
        following = self.attention_stage.get(layer + 1)
        return None if following is None else self.caches[(following, batch)]

    # ---- between two steps of a running block -----------------------------------------------
    def restart_row(self, batch: int, row: int, token: int) -> None:
        """Row ``row`` of GPU batch ``batch`` starts over as a new sequence whose first token
        is ``token``, fed at the next step at position 0. Every column the row had becomes
        invisible to it (its ``valid`` is cleared), so its attention, positions and the KV
        policies' choices see only what comes after; the caches keep their columns. A new
        request's prompt then goes in one token a step (the caller's sampler gives the
        rest), in the steps the other rows decode, each layer's weights read once for all
        of them."""
        self.states[batch].valid[row] = False
        self.pending[batch][row] = token
        for (_, b), cache in self.caches.items():
            if b == batch:
                cache.restart_row(row)

    def place_row(self, batch: int, row: int, start: int, token: int) -> None:
        """Row ``row`` of GPU batch ``batch`` holds a sequence in its columns from ``start`` on
        (their keys and values in the caches already: :mod:`.join`); it sees only those, and
        feeds ``token`` at the next step, at the position after them."""
        valid = self.states[batch].valid
        valid[row] = False
        valid[row, start:] = True
        self.pending[batch][row] = token

    def columns(self) -> int:
        """Columns the caches hold: the prompt width and the steps fed since."""
        return self.states[0].valid.shape[1]

    def cached_kv(self, layer: int, batch: int, rows: list[int] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``layer``'s keys and values of GPU batch ``batch`` as its cache holds them,
        every column so far (``[b, columns, KV, d]`` each, on the CPU; only ``rows`` of the
        batch where given); None where the cache does not hold them exactly (4-bit) or the
        layer is not this process's."""
        stage = self.attention_stage.get(layer)
        if stage is None:
            return None
        valid = self.states[batch].valid
        # after a step is yielded the cache holds a column for each of ``valid``'s
        reader = self.caches[(stage, batch)].prompt_reader(*valid.shape[::-1])
        if reader is None:
            return None
        k, v = reader()
        if rows is not None:  # only those cross to the host
            k, v = k[rows], v[rows]
        return k.cpu(), v.cpu()
