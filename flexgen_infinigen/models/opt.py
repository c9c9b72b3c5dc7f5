"""OPT math: learned positions (offset 2), LayerNorm, ReLU MLP, tied output head."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..memory.codes import lookup
from ..kernels.layers import linear
from .llama import recurrent_mix, recurrent_state_shapes  # noqa: F401

POSITION_OFFSET = 2


def _has_final_norm(cfg: ModelConfig) -> bool:
    return cfg.do_layer_norm_before


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.embed_dim
    shapes = {"embed.weight": (cfg.vocab_size, e),
              "pos_embed.weight": (cfg.max_positions + POSITION_OFFSET, h)}
    if e != h:
        shapes["project_in.weight"] = (h, e)
        shapes["project_out.weight"] = (e, h)
    if _has_final_norm(cfg):
        shapes["final_norm.weight"] = (h,)
        shapes["final_norm.bias"] = (h,)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for name, shape in [("attn_norm", (h,)), ("mlp_norm", (h,))]:
            shapes[p + name + ".weight"] = shape
            shapes[p + name + ".bias"] = shape
        for name, (rows, cols) in [("q_proj", (h, h)), ("k_proj", (h, h)), ("v_proj", (h, h)),
                                   ("o_proj", (h, h)), ("fc1", (f, h)), ("fc2", (h, f))]:
            shapes[p + name + ".weight"] = (rows, cols)
            shapes[p + name + ".bias"] = (rows,)
    return shapes


def stage_weights(cfg: ModelConfig, layer: int = 0) -> dict[str, list[str]]:
    wb = lambda *names: [f"{n}.{t}" for n in names for t in ("weight", "bias")]  # noqa: E731
    proj = cfg.embed_dim != cfg.hidden_size
    return {
        "embed": ["embed.weight", "pos_embed.weight"] + (["project_in.weight"] if proj else []),
        "attn": wb("attn_norm", "q_proj", "k_proj", "v_proj", "o_proj"),
        "mlp": wb("mlp_norm", "fc1", "fc2"),
        "head": (wb("final_norm") if _has_final_norm(cfg) else [])
        + (["project_out.weight"] if proj else []) + ["embed.weight"],
    }


# the weights the query alone needs (InfiniGen's rehearsal keeps these on the device)
QUERY_WEIGHTS = ("q_proj.weight", "q_proj.bias")


def _ln(x, w, name, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], w[name + ".weight"], w[name + ".bias"], eps)


def embed(cfg: ModelConfig, w: dict, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = lookup(w["embed.weight"], ids)
    if "project_in.weight" in w:
        x = linear(x, w["project_in.weight"])
    return x + lookup(w["pos_embed.weight"], positions + POSITION_OFFSET)


def encode_positions(cfg: ModelConfig, positions: torch.Tensor, window: int = 0):
    return None  # learned positions are added by ``embed``


def attn_input(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    return _ln(h, w, "attn_norm") if cfg.do_layer_norm_before else h


# q and k are plain affine maps of the input: an orthogonal skew folds into W_Q, W_K and biases
SKEW_FOLDS_INTO_WEIGHTS = True
# the compiled decode call is Llama's layer (RMSNorm, RoPE, SwiGLU): OPT runs per operation
FUSED_DECODE = False


def query(cfg: ModelConfig, w: dict, x: torch.Tensor, pos_enc) -> torch.Tensor:
    b, s, _ = x.shape
    return linear(x, w["q_proj.weight"], w["q_proj.bias"]).view(b, s, cfg.num_heads,
                                                                   cfg.head_dim)


def attn_qkv(cfg: ModelConfig, w: dict, x: torch.Tensor, pos_enc):
    b, s, _ = x.shape
    shape = (b, s, cfg.num_heads, cfg.head_dim)
    q = query(cfg, w, x, pos_enc)
    k = linear(x, w["k_proj.weight"], w["k_proj.bias"]).view(shape)
    v = linear(x, w["v_proj.weight"], w["v_proj.bias"]).view(shape)
    return q, k, v


def attn_out(cfg: ModelConfig, w: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    h = h + linear(attn, w["o_proj.weight"], w["o_proj.bias"])
    return h if cfg.do_layer_norm_before else _ln(h, w, "attn_norm")


def mlp(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    x = _ln(h, w, "mlp_norm") if cfg.do_layer_norm_before else h
    x = F.relu(linear(x, w["fc1.weight"], w["fc1.bias"]))
    x = linear(x, w["fc2.weight"], w["fc2.bias"])
    h = h + x
    return h if cfg.do_layer_norm_before else _ln(h, w, "mlp_norm")


def head(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    if _has_final_norm(cfg):
        h = _ln(h, w, "final_norm")
    if "project_out.weight" in w:
        h = linear(h, w["project_out.weight"])
    return linear(h, w["embed.weight"])


def attention_sinks(cfg: ModelConfig, w: dict) -> None:
    """No attention sinks."""
    return None
