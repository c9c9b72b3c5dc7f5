"""Model configurations and the registry of known models."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from . import switches


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of one decoder-only transformer."""

    name: str
    family: str  # "opt" or "llama": picks the math module in flexgen_infinigen.models
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_positions: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0
    # OPT only: width of the token embedding when it differs from hidden_size (opt-350m)
    word_embed_proj_dim: int = 0
    # OPT only: pre-LayerNorm (True for every OPT except opt-350m)
    do_layer_norm_before: bool = True
    # Llama-family variants (Llama 3.x, Mistral, Qwen 2/2.5/3); defaults are plain Llama
    attn_head_dim: int = 0  # width of one head when a config says so (Qwen3); 0: hidden/heads
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)
    o_bias: bool = False  # bias on the attention output projection (Llama attention_bias)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    qk_norm_full: bool = False  # the q/k RMSNorm spans all heads at once (OLMoE), not one head
    sliding_window: int = 0  # each token sees only the newest this many keys (Mistral); 0: all
    # each layer's window when layers differ (Gemma 3: five windowed layers to one global);
    # empty: every layer has ``sliding_window``
    layer_windows: tuple = ()
    # RoPE base of the windowed layers when it is not ``rope_theta`` (Gemma 3's local
    # layers); their RoPE is never scaled
    rope_local_theta: float = 0.0
    # the attention's query scale when it is not 1/sqrt(head width) (Gemma's
    # query_pre_attn_scalar ** -0.5); 0: the usual
    query_scale: float = 0.0
    # logits = cap * tanh(logits / cap) (Gemma 2/3 configs that ask for it); 0: none
    final_logit_softcap: float = 0.0
    # mixture of experts (models/moe.py); 0 experts: every MLP is dense
    num_experts: int = 0
    experts_per_token: int = 0  # the router's top-k
    expert_intermediate_size: int = 0  # one expert's FFN width
    norm_topk_prob: bool = False  # the top-k router weights renormalised to sum to 1
    shared_expert_size: int = 0  # FFN width of a shared expert with a sigmoid gate (Qwen2-MoE)
    dense_layers: tuple = ()  # layers whose MLP is dense (intermediate_size) in a MoE model
    shared_expert_gated: bool = True  # the shared expert's sigmoid gate (Qwen2-MoE; not GLM)
    # GLM-4.5 / DeepSeek-V3 routers: sigmoid scores, the top k chosen by score plus a learned
    # bias (``router.choice_bias``) within the best ``router_topk_groups`` of
    # ``router_groups`` groups of experts (a group ranked by its two best), and the chosen
    # scores, renormalised when ``norm_topk_prob``, times ``routed_scaling``
    router_sigmoid: bool = False
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling: float = 1.0
    # RoPE on the first this many dims of each head only (GLM's partial rotary); 0: all
    rotary_dim: int = 0
    # multi-head latent attention (DeepSeek-V3, models/mla.py): the latent's width (the cache
    # holds it and the rotary key, ``rotary_dim`` wide: ``attn_head_dim`` is their sum), the
    # query's low rank (0: a full q_proj), and each head's unrotated key and value widths
    mla_kv_rank: int = 0
    mla_q_rank: int = 0
    mla_nope_dim: int = 0
    mla_v_dim: int = 0
    # kv_b_proj kept as llama.cpp splits it: W_UK^T per head (k_b_proj, [heads * kv_rank,
    # nope]) and W_UV (v_b_proj, [heads * v, kv_rank])
    mla_kv_b_split: bool = False
    # gpt-oss (models/gpt_oss.py): a learned logit per query head that takes part in each
    # softmax's normalizer and adds no value (``layers.{i}.sinks``)
    attn_sinks: bool = False
    # a bias on the router's logits (``router.bias``; gpt-oss) and on each routed expert's
    # three matrices (``experts.{e}.{m}.bias``)
    router_bias: bool = False
    expert_bias: bool = False
    # the routed experts' clamped SwiGLU (gpt-oss): gate clamped above and up on both sides
    # at ``swiglu_limit``, out = (up + 1) * gate * sigmoid(swiglu_alpha * gate); 0: plain SwiGLU
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    # Qwen3.5 / Qwen3-Next hybrids (models/qwen3_next.py): the layers whose token mixer is a
    # Gated DeltaNet recurrence (a state per row, no KV cache) instead of attention; its
    # key and value heads and their widths, and its causal convolution's kernel
    linear_layers: tuple = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv: int = 0
    # value head j reads key head j % key_heads (llama.cpp's qwen35 files, which reorder the
    # value heads so); False: key head j // (value_heads / key_heads), as Hugging Face's
    linear_value_tiled: bool = False
    # the attention output times sigmoid of a second, gate projection of its input
    # (``q_gate.weight``; the hybrids' full-attention layers)
    attn_output_gate: bool = False
    # RoPE scaling as sorted (key, value) pairs (hashable); a dict is accepted and converted
    rope_scaling: tuple = ()
    # the architecture's own name (config.json's model_type, GGUF's general.architecture);
    # empty: derived from the flags (see ``architecture``)
    model_type: str = dataclasses.field(default="", compare=False)  # a name, not math

    def __post_init__(self):
        if self.attn_head_dim * self.num_heads == self.hidden_size:
            object.__setattr__(self, "attn_head_dim", 0)  # one way to say the usual width
        # a dict, or pairs as JSON gives them back (lists), become sorted tuples
        scaling = dict(self.rope_scaling or ())
        object.__setattr__(self, "rope_scaling", tuple(sorted(scaling.items())))
        object.__setattr__(self, "dense_layers", tuple(sorted(self.dense_layers or ())))
        object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))
        object.__setattr__(self, "linear_layers", tuple(sorted(self.linear_layers or ())))
        if self.rotary_dim == self.head_dim:
            object.__setattr__(self, "rotary_dim", 0)  # one way to say "every dim"
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ConfigError(f"layer_windows has {len(self.layer_windows)} entries for "
                              f"{self.num_layers} layers")

    def window_of(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: it sees every key)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def is_linear(self, layer: int) -> bool:
        """Layer ``layer`` mixes tokens by a recurrence with a state per row (no KV cache)."""
        return layer in self.linear_layers

    @property
    def attention_layers(self) -> int:
        """How many layers keep a KV cache (the hybrids' recurrent layers keep none)."""
        return self.num_layers - len(self.linear_layers)

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct windows of the layers (one for most models)."""
        return tuple(sorted(set(self.layer_windows))) if self.layer_windows else \
            (self.sliding_window,)

    @property
    def rope(self) -> dict:
        """The RoPE scaling parameters as a dict (empty: no scaling)."""
        return dict(self.rope_scaling)

    @property
    def architecture(self) -> str:
        """What users call the model's architecture (``qwen2``, ``mistral``, ...), which the
        report shows; ``family`` is only the math module that computes it."""
        if self.model_type:
            return self.model_type
        if self.family == "opt":
            return "opt"
        if self.qk_norm:
            return "qwen3"
        if self.qkv_bias:
            return "qwen2"
        return "mistral" if self.sliding_window else "llama"

    @property
    def rope_dim(self) -> int:
        """The dims of a head that RoPE rotates."""
        return self.rotary_dim or self.head_dim

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def values_are_keys(self) -> bool:
        """A token's value is its cached key row itself (MLA's latent): the cache keeps one
        copy, not a key and a value."""
        return self.mla_kv_rank > 0

    @property
    def kv_copies(self) -> int:
        """Rows a token keeps per layer and KV head: a key and a value, or MLA's one latent."""
        return 1 if self.values_are_keys else 2

    @property
    def embed_dim(self) -> int:
        return self.word_embed_proj_dim or self.hidden_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _opt(name, hidden, layers, heads, ffn=None, **kw) -> ModelConfig:
    return ModelConfig(
        name=name, family="opt", vocab_size=50272, hidden_size=hidden,
        intermediate_size=ffn or 4 * hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=heads, max_positions=2048, tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=2, pad_token_id=1, **kw)


def _llama(name, hidden, layers, heads, kv_heads, ffn, vocab=32000, max_pos=4096,
           theta=10000.0, tie=False, bos=1, eos=2, pad=0, eps=1e-5, **kw) -> ModelConfig:
    return ModelConfig(
        name=name, family="llama", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=ffn, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        max_positions=max_pos, norm_eps=eps, rope_theta=theta, tie_word_embeddings=tie,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, **kw)


_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_L31 = dict(vocab=128256, max_pos=131072, theta=500000.0, bos=128000, eos=128001, pad=128001,
            rope_scaling=_LLAMA31_ROPE)
_QWEN25 = dict(vocab=152064, max_pos=32768, theta=1000000.0, bos=151643, eos=151643,
               pad=151643, eps=1e-6, qkv_bias=True)
_QWEN3 = dict(vocab=151936, max_pos=40960, theta=1000000.0, bos=151643, eos=151645, pad=151645,
              eps=1e-6, qk_norm=True, attn_head_dim=128)


_GLM45 = dict(vocab=151552, max_pos=131072, theta=1000000.0, bos=151329, eos=151329,
              pad=151329, qkv_bias=True, attn_head_dim=128, rotary_dim=64, experts_per_token=8,
              norm_topk_prob=True, shared_expert_gated=False, router_sigmoid=True,
              model_type="glm4_moe")
_GEMMA3_ROPE = {"rope_type": "linear", "factor": 8.0}


def _gemma3(name, hidden, layers, heads, kv_heads, head_dim, ffn, window, scalar, vocab,
            rope) -> ModelConfig:
    return ModelConfig(
        name=name, family="gemma3", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=ffn, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        max_positions=131072 if rope else 32768, norm_eps=1e-6, rope_theta=1e6,
        rope_local_theta=1e4, rope_scaling=rope, tie_word_embeddings=True, bos_token_id=2,
        eos_token_id=1, pad_token_id=0, attn_head_dim=head_dim, qk_norm=True,
        layer_windows=tuple(0 if (i + 1) % 6 == 0 else window for i in range(layers)),
        query_scale=0.0 if scalar == head_dim else scalar ** -0.5, model_type="gemma3")


def _gpt_oss(name, layers, experts) -> ModelConfig:
    return ModelConfig(
        name=name, family="gpt_oss", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_layers=layers, num_heads=64, num_kv_heads=8,
        attn_head_dim=64, max_positions=131072, norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                      "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                      "truncate": False},
        tie_word_embeddings=False, bos_token_id=199998, eos_token_id=200002,
        pad_token_id=199999, qkv_bias=True, o_bias=True,
        layer_windows=tuple(128 if i % 2 == 0 else 0 for i in range(layers)),
        num_experts=experts, experts_per_token=4, expert_intermediate_size=2880,
        norm_topk_prob=True, attn_sinks=True, router_bias=True, expert_bias=True,
        swiglu_limit=7.0, swiglu_alpha=1.702, model_type="gpt_oss")


DEFAULT_MODEL = "smollm2-135m"

KNOWN_MODELS: dict[str, ModelConfig] = {c.name: c for c in [
    _opt("opt-125m", 768, 12, 12),
    _opt("opt-350m", 1024, 24, 16, word_embed_proj_dim=512, do_layer_norm_before=False),
    _opt("opt-1.3b", 2048, 24, 32),
    _opt("opt-2.7b", 2560, 32, 32),
    _opt("opt-6.7b", 4096, 32, 32),
    _opt("opt-13b", 5120, 40, 40),
    _opt("opt-30b", 7168, 48, 56),
    _opt("opt-66b", 9216, 64, 72),
    _opt("opt-175b", 12288, 96, 96),
    _llama("llama-2-7b", 4096, 32, 32, 32, 11008),
    _llama("llama-2-13b", 5120, 40, 40, 40, 13824),
    _llama("llama-2-70b", 8192, 80, 64, 8, 28672),
    _llama("llama-3-8b", 4096, 32, 32, 8, 14336, vocab=128256, max_pos=8192, theta=500000.0,
           bos=128000, eos=128001, pad=128001),
    _llama("llama-3.1-8b", 4096, 32, 32, 8, 14336, **_L31),
    _llama("llama-3.1-70b", 8192, 80, 64, 8, 28672, **_L31),
    _llama("mistral-7b", 4096, 32, 32, 8, 14336, max_pos=32768, pad=2, sliding_window=4096),
    _llama("qwen2.5-7b", 3584, 28, 28, 4, 18944, **_QWEN25),
    _llama("qwen2.5-32b", 5120, 64, 40, 8, 27648, **_QWEN25),
    _llama("qwen3-8b", 4096, 36, 32, 8, 12288, **_QWEN3),
    _llama("qwen3-32b", 5120, 64, 64, 8, 25600, **_QWEN3),
    # mixture of experts (models/moe.py), in their published configs' shapes: for --dummy
    # weights and planning; the checkpoints load from their Hub folders or GGUF files
    _llama("qwen3-30b-a3b", 2048, 48, 32, 4, 6144, num_experts=128, experts_per_token=8,
           expert_intermediate_size=768, norm_topk_prob=True, model_type="qwen3_moe",
           **_QWEN3),
    _llama("olmoe-1b-7b", 2048, 16, 16, 16, 1024, vocab=50304, bos=50279, eos=50279, pad=1,
           num_experts=64, experts_per_token=8, expert_intermediate_size=1024, qk_norm=True,
           qk_norm_full=True, model_type="olmoe"),
    _llama("smollm2-135m", 576, 30, 9, 3, 1536, vocab=49152, max_pos=8192, theta=100000.0,
           tie=True, bos=1, eos=2, pad=2),
    # GLM-4.5-Air and GLM-4.5: sigmoid router, one shared expert, dense first layers, RoPE
    # on half of each head (their multi-token-prediction layer is not computed)
    _llama("glm-4.5-air", 4096, 46, 96, 8, 10944, **_GLM45, num_experts=128,
           expert_intermediate_size=1408, shared_expert_size=1408, dense_layers=(0,)),
    _llama("glm-4.5", 5120, 92, 96, 8, 12288, **_GLM45, num_experts=160,
           expert_intermediate_size=1536, shared_expert_size=1536, dense_layers=(0, 1, 2),
           qk_norm=True, routed_scaling=2.5),
    # DeepSeek-V3 / R1 (671B): multi-head latent attention, 256 routed experts in groups,
    # three dense layers, YaRN RoPE (40x of 4K; the scores' correction in query_scale)
    dataclasses.replace(_llama(
           "deepseek-v3", 7168, 61, 128, 1, 18432, vocab=129280, max_pos=163840, theta=10000.0,
           bos=0, eos=1, pad=1, eps=1e-6, attn_head_dim=576, rotary_dim=64,
           mla_kv_rank=512, mla_q_rank=1536, mla_nope_dim=128, mla_v_dim=128,
           query_scale=192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rope_scaling={
               "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
           num_experts=256, experts_per_token=8,
           expert_intermediate_size=2048, shared_expert_size=2048, dense_layers=(0, 1, 2),
           norm_topk_prob=True, shared_expert_gated=False, router_sigmoid=True,
           router_groups=8, router_topk_groups=4, routed_scaling=2.5,
           model_type="deepseek_v3"), family="mla"),
    # gpt-oss: 128-token windows on every other layer (the first windowed), attention sinks,
    # biased router and experts with the clamped SwiGLU, YaRN RoPE (32x of 4K)
    *[_gpt_oss(name, layers, experts) for name, layers, experts in (
        ("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128))],
    # Qwen3-Next-80B-A3B: three Gated DeltaNet layers to one gated attention layer, 512
    # routed experts and a gated shared expert, RoPE on a quarter of each head
    ModelConfig(name="qwen3-next-80b-a3b", family="qwen3_next", vocab_size=151936,
                hidden_size=2048, intermediate_size=5120, num_layers=48, num_heads=16,
                num_kv_heads=2, attn_head_dim=256, max_positions=262144, norm_eps=1e-6,
                rope_theta=1e7, tie_word_embeddings=False, bos_token_id=151643,
                eos_token_id=151645, pad_token_id=151643, qk_norm=True, rotary_dim=64,
                attn_output_gate=True,
                linear_layers=tuple(i for i in range(48) if (i + 1) % 4),
                linear_key_heads=16, linear_value_heads=32, linear_key_dim=128,
                linear_value_dim=128, linear_conv=4, num_experts=512, experts_per_token=10,
                expert_intermediate_size=512, shared_expert_size=512, norm_topk_prob=True,
                model_type="qwen3_next"),
    # Gemma 3 (text), its published shapes: five windowed layers to one global
    *[_gemma3(name, *shape) for name, shape in {
        "gemma-3-1b": (1152, 26, 4, 1, 256, 6912, 512, 256, 262144, {}),
        "gemma-3-4b": (2560, 34, 8, 4, 256, 10240, 1024, 256, 262208, _GEMMA3_ROPE),
        "gemma-3-12b": (3840, 48, 16, 8, 256, 15360, 1024, 256, 262208, _GEMMA3_ROPE),
        "gemma-3-27b": (5376, 62, 32, 16, 128, 21504, 1024, 168, 262208, _GEMMA3_ROPE),
    }.items()],
]}


class ConfigError(ValueError):
    """A bad user input, reported as one line that names the fix."""


def read_text(path: str, flag: str) -> str:
    """The text of a user-given file, or one error naming ``flag`` when it is unreadable or
    empty."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read {flag} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{flag} {path} is not UTF-8 text (a binary file?); give a text "
                          "file") from None
    if not text.strip():
        raise ConfigError(f"{flag} {path} is empty")
    return text


def get_config(name: str) -> ModelConfig:
    key = name.lower()
    if key.startswith("facebook/"):
        key = key.split("/", 1)[1]
    if key not in KNOWN_MODELS:
        raise ConfigError(
            f"unknown model {name!r}; give a Hugging Face Hub name (org/name, or "
            "org/name:QUANT for a GGUF repo), a .gguf file, a checkpoint folder, or one of: "
            f"{', '.join(KNOWN_MODELS)} (or pass --path to a converted weight store)")
    return KNOWN_MODELS[key]


CACHE_ENV = switches.CACHE.name


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder: the argument, else ``$FLEXGEN_INFINIGEN_CACHE``, else ~/.cache/..."""
    if cache_dir is not None:
        return Path(cache_dir)
    return switches.CACHE.get() or Path.home() / ".cache" / "flexgen_infinigen"


def writable_folder(folder: str | os.PathLike) -> Path:
    """``folder`` in the cache (the cache itself, or a folder in it), created now; one error
    naming the fix when it cannot be written: a file in its place, a read-only disk, no
    permission."""
    folder = Path(folder)
    fix = (f"point ${CACHE_ENV} at a writable folder (it is "
           f"{switches.CACHE.raw() or 'unset: ~/.cache/flexgen_infinigen'})")
    for above in (folder, *folder.parents):
        if above.exists():
            if not above.is_dir():
                raise ConfigError(f"the cache folder {folder} cannot be made: {above} is a "
                                  f"file, not a folder; {fix}")
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the cache folder {folder} "
                          f"({e.strerror or type(e).__name__}); {fix}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"the cache folder {folder} is not writable (a read-only disk, or "
                          f"not yours); {fix}")
    return folder
