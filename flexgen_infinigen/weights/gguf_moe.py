"""Mixture-of-experts GGUF files: ``qwen3moe``, ``qwen2moe``, ``olmoe``, ``glm4moe``,
``deepseek2``, ``gpt-oss`` (its experts' biases ``[experts, out]`` cut like the matrices,
its router's bias read) and ``llama`` with experts (Mixtral), read into the same per-expert
store tensors a Hugging Face folder gives. ``glm4moe``'s and ``deepseek2``'s routers are sigmoid
(:data:`SIGMOID_ROUTERS`: their choice bias ``exp_probs_b``, groups, weight scale and
ungated shared experts are read; the others keep the rules below).

llama.cpp writes a MoE layer's routed experts as three fused 3-D tensors,
``blk.N.ffn_{gate,up,down}_exps.weight``, each ``[experts, out, in]`` (GGUF lists the dims
the other way round), or gate and up as one ``ffn_gate_up_exps`` (an expert's gate rows, then
its up rows). Expert ``e`` is rows ``e * out`` to ``(e + 1) * out`` of the tensor seen as a
matrix, and a quantized row is a whole number of blocks, so cutting the tensor along its
expert axis hands each expert exactly its own codes: nothing is requantized.
The router is ``ffn_gate_inp``; Qwen2-MoE's shared expert is ``ffn_{gate,up,down}_shexp``
behind the sigmoid gate ``ffn_gate_inp_shexp`` (one row, written 1-D or ``[1, hidden]``).

The config comes from the metadata, read as llama.cpp reads it (``{arch}.`` prefixed):
``expert_count``, ``expert_used_count``, ``expert_feed_forward_length`` (else the dense
width, divided by the top-k for the Qwen MoE types as llama.cpp does),
``expert_shared_feed_forward_length`` (else the dense width), ``expert_weights_norm``
(else the architecture's rule: Qwen3-MoE and Mixtral renormalise the top-k weights,
Qwen2-MoE and OLMoE do not), ``leading_dense_block_count`` and
``interleave_moe_layer_step`` (only every step-th block sparse, as Hugging Face's
``decoder_sparse_step``). A block with a dense ``ffn_gate`` and no router is a dense layer
(Qwen's ``mlp_only_layers``); the two keys must agree with that. Any other expert or MoE
field, a non-softmax router, a weight scale and a tensor count or shape that disagrees with
the metadata are each one error naming it, before anything is written.
"""
from __future__ import annotations

import re

from ..config import ConfigError, ModelConfig

# GGUF architecture -> (our model_type, top-k weights renormalised when the file is silent)
MOE_ARCHITECTURES = {"qwen3moe": ("qwen3_moe", True), "qwen2moe": ("qwen2_moe", False),
                     "olmoe": ("olmoe", False), "llama": ("mixtral", True),
                     "glm4moe": ("glm4_moe", True), "deepseek2": ("deepseek_v3", True),
                     "gpt-oss": ("gpt_oss", True), "qwen35moe": ("qwen3_5_moe_text", True),
                     "qwen3next": ("qwen3_next", True)}
# architectures with one shared expert behind a sigmoid gate (its width in
# expert_shared_feed_forward_length; Qwen2-MoE files may leave it to feed_forward_length)
GATED_SHARED = ("qwen2moe", "qwen35moe", "qwen3next")
# what llama.cpp divides the dense width by when a Qwen MoE file has no expert width
_WIDTH_BY_TOP_K = ("qwen3moe", "qwen2moe")
# metadata read here (after the ``{arch}.`` prefix); any other key naming experts or MoE
# layers changes the math in a way this runtime does not compute, and is refused by name
READ = frozenset({"expert_count", "expert_used_count", "expert_feed_forward_length",
                  "expert_shared_feed_forward_length", "expert_shared_count",
                  "expert_weights_norm", "expert_weights_scale", "expert_gating_func",
                  "leading_dense_block_count", "interleave_moe_layer_step",
                  "expert_group_count", "expert_group_used_count"})
HINTS = ("expert", "moe", "dense", "sparse")
SOFTMAX, SIGMOID = 1, 2  # llama.cpp's gating function numbers (0: unset)
# architectures whose router is GLM-4.5's: sigmoid scores chosen with exp_probs_b, groups,
# a weight scale, shared experts without a gate (llama.cpp's default gating: sigmoid)
SIGMOID_ROUTERS = ("glm4moe", "deepseek2")

# fused expert tensors -> the matrices each expert's run of rows holds, in order (llama.cpp's
# --fuse-gate-up-exps writes gate and up as one tensor, each expert's gate rows first)
FUSED = {"ffn_gate_exps": ("gate_proj",), "ffn_up_exps": ("up_proj",),
         "ffn_down_exps": ("down_proj",), "ffn_gate_up_exps": ("gate_proj", "up_proj")}
LAYER_NAMES = {"ffn_gate_inp": "router", "ffn_gate_inp_shexp": "shared_expert_gate",
               "ffn_gate_shexp": "shared_expert.gate_proj",
               "ffn_up_shexp": "shared_expert.up_proj",
               "ffn_down_shexp": "shared_expert.down_proj"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def has_experts(reader, arch: str) -> bool:
    """Whether the file is a MoE model (an expert count, or fused expert tensors)."""
    return bool(_field(reader, f"{arch}.expert_count")) or any(
        (m := _BLOCK_RE.fullmatch(t.name)) and m.group(2) in FUSED for t in reader.tensors)


def _refuse_unread(reader, arch: str, source: str) -> None:
    prefix = arch + "."
    for key in reader.fields:
        rest = key[len(prefix):] if key.startswith(prefix) else ""
        if rest and rest not in READ and any(h in rest for h in HINTS):
            raise ConfigError(f"GGUF {source}: metadata field {key!r} is not computed by this "
                              f"runtime (its MoE GGUF types: {', '.join(MOE_ARCHITECTURES)}, "
                              "with a softmax top-k router)")


def _top_k(reader, arch: str, experts: int, source: str) -> int:
    key = f"{arch}.expert_used_count"
    used = _field(reader, key, 0)
    if isinstance(used, list):  # one per layer: this runtime takes one top-k for all
        if len(set(used) - {0}) > 1:
            raise ConfigError(f"GGUF {source}: {key} differs between layers ({sorted(set(used))})"
                              ", which this runtime does not compute")
        used = max(used, default=0)
    if not 0 < int(used) <= experts:
        raise ConfigError(f"GGUF {source}: {key} = {used}, {arch}.expert_count = {experts}; "
                          "the file needs a top-k between 1 and the number of experts")
    return int(used)


def _dense_layers(reader, arch: str, layers: int, source: str) -> tuple[int, ...]:
    """Blocks without a router: dense MLPs. ``leading_dense_block_count`` must agree."""
    routed = {int(m.group(1)) for t in reader.tensors
              if (m := _BLOCK_RE.fullmatch(t.name)) and m.group(2) == "ffn_gate_inp"}
    dense = tuple(i for i in range(layers) if i not in routed)
    if len(dense) == layers:
        raise ConfigError(f"GGUF {source} says it has experts, but no block has a router "
                          "(ffn_gate_inp); the file is incomplete or not a MoE model")
    leading = _field(reader, f"{arch}.leading_dense_block_count")
    if leading is not None and dense[:int(leading)] != tuple(range(int(leading))):
        raise ConfigError(f"GGUF {source}: {arch}.leading_dense_block_count = {leading}, but "
                          f"blocks {list(range(int(leading)))} are not all dense; the file "
                          "disagrees with its metadata")
    step = int(_field(reader, f"{arch}.interleave_moe_layer_step", 1) or 1)
    wrong = [i for i in range(layers) if (i + 1) % step and i not in dense]
    if wrong:  # every step-th block is sparse (Hugging Face's decoder_sparse_step), no other
        raise ConfigError(f"GGUF {source}: {arch}.interleave_moe_layer_step = {step}, but block "
                          f"{wrong[0]} has a router; the file disagrees with its metadata")
    return dense


def experts_from_gguf(reader, arch: str, source: str, layers: int) -> dict:
    """The mixture-of-experts fields of our config (none for a file without experts) for
    the model's ``layers`` blocks; one error for a field the runtime does not compute or
    metadata that cannot be right."""
    if arch not in MOE_ARCHITECTURES:
        return {}
    p = arch + "."
    _refuse_unread(reader, arch, source)
    if arch == "llama" and not has_experts(reader, arch):
        return {}
    experts = int(_field(reader, p + "expert_count", 0))
    if experts <= 0:
        raise ConfigError(f"GGUF {source} holds fused expert tensors but no {p}expert_count "
                          "> 0; the file disagrees with its metadata")
    top_k = _top_k(reader, arch, experts, source)
    gating = _field(reader, p + "expert_gating_func")
    if arch in SIGMOID_ROUTERS:
        return _sigmoid_router(reader, arch, source, experts, top_k, gating, layers)
    for key in ("expert_group_count", "expert_group_used_count"):  # a sigmoid router's
        if _field(reader, p + key) not in (None, 0, 1):
            raise ConfigError(f"GGUF {source}: metadata field {p + key!r} is not computed by "
                              f"this runtime for {arch} (groups of experts: "
                              f"{', '.join(SIGMOID_ROUTERS)} only)")
    if gating not in (None, 0, SOFTMAX):
        raise ConfigError(f"GGUF {source}: {p}expert_gating_func = {gating} is not computed by "
                          "this runtime (it computes softmax routers only)")
    scale = _field(reader, p + "expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise ConfigError(f"GGUF {source}: {p}expert_weights_scale = {scale} is not computed "
                          "by this runtime (it computes unscaled router weights only)")
    model_type, renormalise = MOE_ARCHITECTURES[arch]
    dense_width = int(_field(reader, p + "feed_forward_length", 0))
    width = int(_field(reader, p + "expert_feed_forward_length", 0)) or (
        dense_width // top_k if arch in _WIDTH_BY_TOP_K else dense_width)
    out = dict(model_type=model_type, num_experts=experts, experts_per_token=top_k,
               expert_intermediate_size=width,
               norm_topk_prob=bool(_field(reader, p + "expert_weights_norm", renormalise)),
               dense_layers=_dense_layers(reader, arch, layers, source))
    shared = _field(reader, p + "expert_shared_count")
    if arch in GATED_SHARED:
        if shared not in (None, 1):
            raise ConfigError(f"GGUF {source}: {p}expert_shared_count = {shared}; this "
                              f"runtime computes {arch} with one shared expert")
        out["shared_expert_size"] = int(
            _field(reader, p + "expert_shared_feed_forward_length", 0)) or dense_width
    elif shared or _field(reader, p + "expert_shared_feed_forward_length"):
        raise ConfigError(f"GGUF {source}: {p}expert_shared_* (a shared expert) is not "
                          f"computed by this runtime for {arch}; only "
                          f"{', '.join(GATED_SHARED)} have one")
    return out


def _sigmoid_router(reader, arch: str, source: str, experts: int, top_k: int, gating,
                    layers: int) -> dict:
    """GLM-4.5's and DeepSeek-V3's MoE fields (see :data:`SIGMOID_ROUTERS`)."""
    p = arch + "."
    # a deepseek2 file without it is DeepSeek-V2's softmax router (llama.cpp's rule)
    if gating not in ((SIGMOID,) if arch == "deepseek2" else (None, 0, SIGMOID)):
        raise ConfigError(f"GGUF {source}: {p}expert_gating_func = {gating}; this runtime "
                          f"computes {arch} with the sigmoid router of DeepSeek-V3 and GLM-4.5 "
                          "only (DeepSeek-V2's softmax router is not computed)")
    groups = int(_field(reader, p + "expert_group_count", 0) or 1)
    best = int(_field(reader, p + "expert_group_used_count", 0) or 1)
    if experts % groups or not 0 < best <= groups or experts // groups < 2:
        raise ConfigError(f"GGUF {source}: {p}expert_group_count = {groups} (using {best}) "
                          f"does not cut {experts} experts into groups of two or more")
    width = int(_field(reader, p + "expert_feed_forward_length", 0))
    return dict(model_type=MOE_ARCHITECTURES[arch][0], num_experts=experts,
                experts_per_token=top_k, expert_intermediate_size=width,
                norm_topk_prob=bool(_field(reader, p + "expert_weights_norm", True)),
                dense_layers=_dense_layers(reader, arch, layers, source),
                shared_expert_size=width * int(_field(reader, p + "expert_shared_count", 0) or 0),
                shared_expert_gated=False, router_sigmoid=True, router_groups=groups,
                router_topk_groups=best,
                routed_scaling=float(_field(reader, p + "expert_weights_scale", 1.0) or 1.0))


def store_names(block: int, part: str, cfg: ModelConfig,
                kind: str = "weight") -> list[str] | None:
    """The store names a MoE tensor ``blk.{block}.{part}.{kind}`` becomes (one per expert
    for a fused tensor: gpt-oss's expert biases ``[experts, out]`` too), or None when
    ``part`` is not a MoE tensor (or the model has no such bias)."""
    if kind == "bias" and not (cfg.expert_bias if part in FUSED else cfg.router_bias):
        return None
    if cfg.num_experts and part in FUSED:
        return [f"layers.{block}.experts.{e}.{m}.{kind}"
                for e in range(cfg.num_experts) for m in FUSED[part]]
    if cfg.num_experts and part in LAYER_NAMES:
        return [f"layers.{block}.{LAYER_NAMES[part]}.{kind}"]
    return None


# the metadata that sizes each MoE tensor, for the error naming a disagreement
_SIZED_BY = (("router.", "expert_count"), ("experts.", "expert_feed_forward_length"),
             ("shared_expert_gate", "embedding_length"),
             ("shared_expert.", "expert_shared_feed_forward_length"))


def is_moe_key(key: str) -> bool:
    """A store tensor of a MoE layer's MLP other than its norm (router, experts, shared)."""
    return any(f".{part}" in key for part in ("router.", "experts.", "shared_expert"))


def check_shape(name: str, shape: tuple[int, ...], keys: list[str], expected: dict,
                cfg: ModelConfig, source: str) -> tuple[int, ...]:
    """The shape each store tensor of GGUF tensor ``name`` gets; one error when the file's
    shape disagrees with the metadata (an expert count or width)."""
    want = expected[keys[0]]
    if len(keys) > 1 and keys[0].endswith(".bias"):  # fused biases: [experts, out]
        if len(shape) != 2 or shape[0] != cfg.num_experts:
            raise ConfigError(f"GGUF {source}: tensor {name!r} has shape {shape}, not one "
                              f"bias row for each of expert_count = {cfg.num_experts} experts; "
                              "the file disagrees with its metadata")
        shape = shape[1:]
    elif len(keys) > 1:  # a fused tensor: [experts, out (of each matrix, in turn), in]
        if len(shape) != 3 or shape[0] != cfg.num_experts:
            count = shape[0] if len(shape) == 3 else "no expert axis"
            raise ConfigError(f"GGUF {source}: tensor {name!r} holds {count} experts, but its "
                              f"metadata says expert_count = {cfg.num_experts}; the file "
                              "disagrees with its metadata")
        per = len(keys) // cfg.num_experts  # matrices an expert's rows hold
        shape = (shape[1] // per, shape[2]) if shape[1] % per == 0 else shape[1:]
    elif keys[0].endswith("shared_expert_gate.weight") and shape == want[1:]:
        shape = want  # written 1-D ([hidden]) by llama.cpp: one row
    if shape != want:
        field = next(f for part, f in _SIZED_BY if part in keys[0])
        fields = field if field == "embedding_length" else f"{field}, embedding_length"
        raise ConfigError(f"GGUF {source}: tensor {name!r} has {'experts of ' * (len(keys) > 1)}"
                          f"shape {shape}, but its metadata ({fields}) "
                          f"implies {want}; the file disagrees with its metadata")
    return shape
