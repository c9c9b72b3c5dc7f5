"""Building an engine: pick the device and dtype, find the weights, place them on the tiers."""
from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config import ConfigError, ModelConfig, get_config
from ..models import family_of
from ..models.moe import is_expert_weight, plain_experts
from ..placement import Placement
from ..weights.sources import DummySource, StoreSource
from ..weights.store import WeightStore
from ..memory.codes import CodeLayout
from ..switches import GGUF_BLOCKS
from .expert_homes import home_split
from ..guards import raise_if_interrupted
from ..memory.split_tensor import SplitTensor
from ..memory.tiers import Tiers

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA GPU is visible; "
                          "use --device cpu or --device auto")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cuda or cpu (got {name!r})")
    return torch.device(name)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)} (got {name!r})")
    return DTYPES[name]


def model_config(model: str | None, path: str | None = None, shapes_only: bool = False
                 ) -> ModelConfig:
    """The config of what a command was pointed at (a store, a GGUF or HF path, a Hub name, a
    registry name, else the default model), without converting or reading any weight (a Hub
    checkpoint fetches its config.json only; a Hub GGUF comes whole, its config is inside).
    ``shapes_only`` (``--dummy``, planning): a registry alias (``facebook/opt-13b``) is the
    registry's, not the Hub's."""
    from ..config import DEFAULT_MODEL
    from ..weights.local_model import is_model_path, source_config

    if path:
        if not Path(path).exists():
            raise ConfigError(f"weight folder {path} does not exist; convert a checkpoint "
                              "with `python -m flexgen_infinigen.convert` or use --dummy")
        return WeightStore(path).config
    if is_model_path(model, shapes_only=shapes_only):
        return source_config(model)
    return get_config(model or DEFAULT_MODEL)


def find_weights(model: str | None, path: str | None, dummy: bool, seed: int = 0,
                 progress: bool = True):
    """(config, source, store or None) for a model name, a GGUF file, a Hugging Face folder or
    Hub name (converted into the cache on first use), a store folder, or dummy weights (in a
    registry model's shapes, or a Hub repo's from its config.json)."""
    from ..weights.local_model import is_model_path, store_for

    if dummy and model is not None and path is None and is_model_path(model, shapes_only=True) \
            and not Path(model).expanduser().exists():
        cfg = model_config(model, shapes_only=True)  # a Hub repo's shapes: its config.json
        return cfg, DummySource(cfg, seed), None
    if is_model_path(model, shapes_only=dummy or path is not None):
        if path is not None or dummy:
            raise ConfigError(f"--model {model} names weights (a file, folder or Hub repo); drop "
                              f"{'--path' if path is not None else '--dummy'}")
        model, path = None, str(store_for(model, progress=progress))
    if dummy:
        if model is None:
            raise ConfigError("--dummy needs --model NAME to know the shapes")
        cfg = get_config(model)
        return cfg, DummySource(cfg, seed), None
    if path is None:
        if model is not None and get_config(model).name != "smollm2-135m":
            raise ConfigError(
                f"no weights for {model}: pass --path to a weight store converted with "
                "`python -m flexgen_infinigen.convert`, or --dummy for random weights")
        from ..weights.embedded import default_model_store
        path = default_model_store(progress=progress)
    if not Path(path).exists():
        raise ConfigError(f"weight folder {path} does not exist; convert a checkpoint with "
                          "`python -m flexgen_infinigen.convert` or use --dummy")
    store = WeightStore(path)
    cfg = store.config
    if model is not None and get_config(model).name != cfg.name:
        known = get_config(model)
        if family_of(known).weight_shapes(known) != family_of(cfg).weight_shapes(cfg):
            raise ConfigError(f"--model {model} does not match the store at {path} "
                              f"(which holds {cfg.name}); drop --model or fix --path")
    store.check(family_of(cfg).weight_shapes(cfg))
    return cfg, StoreSource(store), store


def weight_layouts(source, cfg: ModelConfig, native: bool = True) -> dict[str, CodeLayout]:
    """(code bits, group, float16 scales, block type) of each weight the source keeps as a
    quantized file's codes. ``native`` (a CPU computes): the types the CPU kernels read as
    stored stay the file's blocks (a layout with ``kind``); else (a GPU) they become codes."""
    layout = getattr(source, "layout", None)
    if layout is None:
        return {}
    native = native and GGUF_BLOCKS.get()
    # experts the compiled MoE call never reads (biases, gpt-oss's clamped SwiGLU) are
    # multiplied by the GGUF kernels as stored, as dense weights are
    experts = native and not plain_experts(cfg)
    found = {n: layout(n, native=native, native_experts=experts)
             for n in family_of(cfg).weight_shapes(cfg)}
    return {n: lay for n, lay in found.items() if lay is not None}


def place_weights(cfg: ModelConfig, source, policy: Placement, tiers: Tiers, dtype: torch.dtype,
                  progress: bool = True, names: set[str] | None = None,
                  expert_order: dict[int, list[int]] | None = None,
                  layouts: dict[str, CodeLayout] | None = None) -> dict[str, SplitTensor]:
    """Every weight (or those in ``names``: one pipeline rank's), split along its rows across
    the tiers as the policy's percentages say. Routed experts are tensors of their own kind
    (``experts``), placed whole by the policy's ``expert_split`` (``--experts-percent``,
    :mod:`.expert_homes`; ``expert_order``: a routing profile's order, most used first), and
    the bytes they move are counted apart. Weights a quantized file brought are placed as their
    codes (one tensor's codes built at a time; ``--compress-weight`` changes nothing then),
    or, for a CPU, as the file's blocks, read where the file lies (``layouts``: the form of
    each, :func:`weight_layouts`); floats in ``dtype`` (4-bit with ``--compress-weight``)."""
    shapes = family_of(cfg).weight_shapes(cfg)
    if names is not None:
        shapes = {n: s for n, s in shapes.items() if n in names}
    if layouts is None:
        layouts = weight_layouts(source, cfg, native=not tiers.is_cuda)
    compress = policy.compress_weight and not layouts
    placed = {}
    for name, shape in tqdm(shapes.items(), desc="placing weights", unit="tensor",
                            disable=not progress, leave=False):
        raise_if_interrupted()
        expert = is_expert_weight(name)
        split = home_split(name, policy.expert_split, cfg.num_experts, expert_order) \
            if expert else policy.weight_split
        tensor = SplitTensor(tiers, shape, dtype, split,
                              "experts" if expert else "weights",
                              compress=compress, pin=policy.pin_weight,
                              layout=layouts.get(name))
        data = source(name, shape, layouts.get(name)) if name in layouts else \
            source(name, shape)
        tensor.write(data if name in layouts else data.to(dtype), src_tier="host")
        del data
        placed[name] = tensor
    tiers.reset_counters()
    return placed
