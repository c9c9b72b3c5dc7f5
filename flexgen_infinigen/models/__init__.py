"""Model families: each is a small module of math with the same functions (:class:`Family`).

The engine and the KV policies call only these; they never ask which family they run.
``family_of(cfg)`` gives the module of ``cfg.family``.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..config import ModelConfig
from . import gemma3, gpt_oss, llama, mla, opt, qwen3_next


@runtime_checkable
class Family(Protocol):
    """What every family module provides (a module is the implementation: its functions
    take no ``self``). ``w`` is a stage's weights by the names :meth:`stage_weights` gives
    (a mixture-of-experts stage's may carry its expert runner, :data:`.moe.RUNNER`)."""

    # the weights the query alone needs (InfiniGen's rehearsal keeps these on the device)
    QUERY_WEIGHTS: tuple[str, ...]
    # q and k are plain affine maps of the attention input, so that InfiniGen's skew can be
    # folded into W_Q and W_K (else it is applied to the q and k the math gives)
    SKEW_FOLDS_INTO_WEIGHTS: bool
    # a decode step of this family may take the compiled layer call of
    # ``kernels/c/decode_layer.c`` (whose math is this family's)
    FUSED_DECODE: bool

    def weight_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every weight of the model by its name in the weight store."""
        ...

    def stage_weights(self, cfg: ModelConfig, layer: int = 0) -> dict[str, list[str]]:
        """The weight names each stage kind (embed, attn, mlp, head) uses; those of layer
        ``layer`` (a model may mix dense and mixture-of-experts layers) without their
        ``layers.{i}.`` prefix."""
        ...

    def encode_positions(self, cfg: ModelConfig, positions: torch.Tensor,
                         window: int = 0) -> object:
        """What the attention of every layer with sliding window ``window`` (0: none) takes
        of ``positions`` [b, s] (``pos_enc``)."""
        ...

    def embed(self, cfg: ModelConfig, w: dict, ids: torch.Tensor,
              positions: torch.Tensor) -> torch.Tensor:
        ...

    def attn_input(self, cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
        """The attention's input from the hidden state (what InfiniGen's rehearsal
        multiplies)."""
        ...

    def query(self, cfg: ModelConfig, w: dict, x: torch.Tensor, pos_enc) -> torch.Tensor:
        """q [b, s, heads, d] of the attention input ``x``, positions applied."""
        ...

    def attn_qkv(self, cfg: ModelConfig, w: dict, x: torch.Tensor, pos_enc
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [b, s, heads, d], k and v [b, s, kv heads, d] of the attention input ``x``."""
        ...

    def attn_out(self, cfg: ModelConfig, w: dict, h: torch.Tensor,
                 attn: torch.Tensor) -> torch.Tensor:
        """The hidden state after attention, from ``h`` before it and the heads' ``attn``."""
        ...

    def mlp(self, cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
        """The hidden state after the MLP (the residual included)."""
        ...

    def head(self, cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
        """The logits of the hidden state ``h``."""
        ...

    def attention_sinks(self, cfg: ModelConfig, w: dict) -> torch.Tensor | None:
        """A logit per query head [H] that joins each softmax's normalizer with no value
        (gpt-oss's sinks), from an attention stage's weights; None: no sinks."""
        ...

    def recurrent_state_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """One row's state of a layer in ``cfg.linear_layers``, by name (float32; the
        engine holds it like a KV cache); empty for a family without such layers."""
        ...

    def recurrent_mix(self, cfg: ModelConfig, w: dict, h: torch.Tensor,
                      state: dict[str, torch.Tensor], valid: torch.Tensor
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The hidden state after a recurrent layer's token mixing of ``h`` [b, s, D]
        (``valid`` [b, s]) and the rows' states after its last token, from ``state`` (a
        batch dim before :meth:`recurrent_state_shapes`'s)."""
        ...


FAMILIES: dict[str, Family] = {"opt": opt, "llama": llama, "gemma3": gemma3, "mla": mla,
                               "gpt_oss": gpt_oss, "qwen3_next": qwen3_next}


def family_of(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.family]
