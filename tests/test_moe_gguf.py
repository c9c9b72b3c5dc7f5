"""Mixture-of-experts GGUF files (qwen3moe, qwen2moe, olmoe, and llama with experts, i.e.
Mixtral): tiny random transformers models written the way llama.cpp lays them out (routed
experts fused into 3-D ``ffn_*_exps`` tensors, Qwen2-MoE's shared expert and its gate), as
float32 and with quantized experts. Converted, each expert is its own store tensor holding
exactly its rows of the file (quantized ones as their blocks), and the model gives
transformers' greedy tokens and logits (on the dequantized weights for the quantized file)
with the experts in CPU memory or on disk, with the full cache and with InfiniGen keeping
everything. Files whose expert tensors disagree with their metadata, and MoE fields the
runtime does not compute, are one error each before anything is written."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from conftest import hf_greedy
from gguf_header import add_model_metadata

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.kv import InfiniGenOptions

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

STEPS = 5
PROMPTS = [[1] + [(7 * i + 3) % 200 + 2 for i in range(13)],
           [1] + [(11 * i + 5) % 200 + 2 for i in range(9)]]
COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, intermediate_size=96,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              tie_word_embeddings=False, num_experts_per_tok=2, rms_norm_eps=1e-6)
QWEN3 = dict(num_experts=8, moe_intermediate_size=32, head_dim=32)
# name: (GGUF architecture, transformers config and model class, config fields, metadata
# the file adds beyond llama.cpp's usual keys)
FAMILIES = {
    # a dense block among MoE blocks; the top-k renormalised (qwen3moe's rule)
    "qwen3moe": ("qwen3moe", "Qwen3Moe", dict(QWEN3, norm_topk_prob=True, mlp_only_layers=[1]),
                 {}),
    # the file says so: top-k not renormalised, block 0 dense
    "qwen3moe-unnormalised": ("qwen3moe", "Qwen3Moe",
                              dict(QWEN3, norm_topk_prob=False, mlp_only_layers=[0]),
                              {"expert_weights_norm": False, "leading_dense_block_count": 1}),
    "qwen2moe": ("qwen2moe", "Qwen2Moe",
                 dict(num_experts=6, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False), {}),
    "olmoe": ("olmoe", "Olmoe", dict(num_experts=8, intermediate_size=32, num_key_value_heads=4,
                                     norm_topk_prob=False), {}),
    "mixtral": ("llama", "Mixtral", dict(num_local_experts=8, intermediate_size=64), {}),
    # GLM-4.5: sigmoid router with exp_probs_b in the best 2 of 4 groups, scaled; an ungated
    # shared expert; a dense first block; RoPE on half of each head; a drafting (MTP) block
    # past the model's, which is not read
    "glm4moe": ("glm4moe", "Glm4Moe",
                dict(n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=1,
                     n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
                     head_dim=24, partial_rotary_factor=0.5),
                {"expert_feed_forward_length": 32, "expert_shared_count": 1,
                 "leading_dense_block_count": 1, "expert_gating_func": 2,
                 "expert_weights_scale": 2.5, "expert_weights_norm": True,
                 "expert_group_count": 4, "expert_group_used_count": 2,
                 "rope.dimension_count": 12, "nextn_predict_layers": 1}),
}
EXPERT_TYPE = {"qwen3moe": "Q8_0", "qwen3moe-unnormalised": "Q4_0", "qwen2moe": "Q4_0",
               "olmoe": "Q8_0", "mixtral": "Q4_0", "glm4moe": "Q8_0"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
          "mlp.shared_experts.up_proj": "ffn_up_shexp",
          "mlp.shared_experts.down_proj": "ffn_down_shexp",
          "mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}
CPU_MEMORY = Placement.from_percent([100, 0, 100, 0, 100, 0], expert_gpu_percent=0,
                                 expert_cpu_percent=100)
ON_DISK = Placement.from_percent([100, 0, 100, 0, 100, 0], expert_gpu_percent=0,
                              expert_cpu_percent=0)
KEEP_ALL = InfiniGenOptions(alpha=math.inf, max_kv_fraction=1.0, first_layer=1)


def _tiny(name: str):
    import transformers

    _, cls, extra, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForCausalLM")(
        getattr(transformers, f"{cls}Config")(**{**COMMON, **extra})).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "bias" in pname or "norm" in pname:  # start at 0 and 1: make them count
                p.copy_(torch.randn_like(p) * 0.5 + ("norm" in pname))
            elif pname.endswith("mlp.gate.weight"):  # routes far apart (no near-ties)
                p.copy_(torch.randn_like(p))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # GLM's: zeros at first
                b.copy_(torch.randn_like(b) * 0.3)
    return model


def _fused(state: dict, arch: str = "") -> dict:
    """transformers' tensors under llama.cpp's names; experts as ``[experts, out, in]``."""
    out = {}
    names = {**_LAYER, "post_attention_layernorm": "post_attention_norm"} \
        if arch == "glm4moe" else _LAYER
    for name, t in state.items():
        name = name.removeprefix("model.")
        if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            out[{"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = t
            continue
        _, i, rest = name.split(".", 2)
        if rest == "mlp.experts.gate_up_proj":  # [experts, 2 * width, hidden]: gate, then up
            width = t.shape[1] // 2
            out[f"blk.{i}.ffn_gate_exps.weight"] = t[:, :width]
            out[f"blk.{i}.ffn_up_exps.weight"] = t[:, width:]
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{i}.ffn_down_exps.weight"] = t
        else:
            if rest in names:  # a name whose last part is not weight/bias
                out[f"blk.{i}.{names[rest]}"] = t
                continue
            part, kind = rest.rsplit(".", 1)
            out[f"blk.{i}.{names[part]}.{kind}"] = t
    return out


def write_moe_gguf(model, name: str, path, expert_type: str | dict | None = None,
                   meta: dict | None = None, drop: tuple = (), per_expert: bool = False,
                   gate_up: bool = False) -> None:
    """``model`` as llama.cpp's converter lays out a MoE GGUF of its architecture; with
    ``expert_type`` (one type, or one per fused tensor kind: ``{"ffn_down_exps": ...}``),
    the routed experts quantized by ``gguf``'s quantizer (random codes for the K-quants it
    cannot make) and the model's expert weights replaced by what the file encodes. ``meta``
    overrides metadata keys (under the architecture's prefix), ``drop`` leaves keys out;
    ``per_expert`` writes the old Mixtral layout, one tensor per expert; ``gate_up`` fuses
    each layer's gate and up experts into one ``ffn_gate_up_exps`` (llama.cpp's
    --fuse-gate-up-exps)."""
    from flexgen_infinigen.weights.gguf_convert import permute_rotary

    arch, _, _, family_meta = FAMILIES[name]
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    drafting = family_meta.get("nextn_predict_layers", 0)
    add_model_metadata(w, c, arch, "llama", extra_blocks=drafting)
    keys = {"expert_count": getattr(c, "num_experts", None) or c.num_local_experts,
            "expert_used_count": c.num_experts_per_tok, **family_meta}
    if arch in ("qwen3moe", "qwen2moe"):
        keys["expert_feed_forward_length"] = c.moe_intermediate_size
    if arch == "qwen2moe":
        keys["expert_shared_feed_forward_length"] = c.shared_expert_intermediate_size
    for key, value in {**keys, **(meta or {})}.items():
        if key in drop:
            continue
        add = {bool: w.add_bool, float: w.add_float32}.get(type(value), w.add_uint32)
        add(f"{arch}.{key}", value)
    state = model.state_dict()
    tensors = _fused(state, arch)
    last = c.num_hidden_layers - 1
    for d in range(drafting):  # a drafting block: the last block's tensors and its own
        n = c.num_hidden_layers + d
        tensors.update({k.replace(f"blk.{last}.", f"blk.{n}."): v for k, v in tensors.items()
                        if k.startswith(f"blk.{last}.")})
        tensors[f"blk.{n}.nextn.eh_proj.weight"] = torch.zeros(c.hidden_size, 2 * c.hidden_size)
    if gate_up:
        for i in range(c.num_hidden_layers):
            if f"blk.{i}.ffn_gate_exps.weight" in tensors:
                tensors.pop(f"blk.{i}.ffn_up_exps.weight")
                gate = tensors.pop(f"blk.{i}.ffn_gate_exps.weight")
                tensors[f"blk.{i}.ffn_gate_up_exps.weight"] = state[
                    f"model.layers.{i}.mlp.experts.gate_up_proj"]
                assert gate.shape[1] * 2 == tensors[f"blk.{i}.ffn_gate_up_exps.weight"].shape[1]
    for out, t in tensors.items():
        values = t.float().numpy()
        if arch == "llama" and out.split(".")[-2] in ("attn_q", "attn_k"):
            values = permute_rotary(values, c.num_attention_heads if "attn_q" in out
                                    else c.num_key_value_heads)
        if out.endswith("ffn_gate_inp_shexp.weight"):
            values = values.reshape(-1)  # llama.cpp's shape: one row, 1-D
        if per_expert and "_exps" in out:
            for e, one in enumerate(values):
                w.add_tensor(out.replace("_exps.", f".{e}."), np.ascontiguousarray(one))
            continue
        if expert_type is None or "_exps" not in out:
            w.add_tensor(out, np.ascontiguousarray(values))
            continue
        kind = expert_type.get(out.split(".")[2]) if isinstance(expert_type, dict) \
            else expert_type
        qtype = gguf.GGMLQuantizationType[kind]
        try:
            raw = quantize(values.reshape(-1, values.shape[-1]), qtype)
        except NotImplementedError:  # K-quants: random codes, weights about 0.05 in size
            from test_gguf_codes import random_blocks

            raw = random_blocks(kind, math.prod(values.shape[:-1]), values.shape[-1],
                                seed=len(out), scale=2e-3)
        w.add_tensor(out, raw.reshape(*values.shape[:-1], -1), raw_dtype=qtype)
        with torch.no_grad():  # the reference computes what the file encodes
            t.copy_(torch.from_numpy(dequantize(raw, qtype).reshape(values.shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, {format: (transformers model, GGUF path, converted store)})."""
    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    name = request.param
    folder = tmp_path_factory.mktemp(name)
    built = {}
    for fmt, kind in (("float", None), ("quantized", EXPERT_TYPE[name])):
        model = _tiny(name)
        path = folder / f"{fmt}.gguf"
        write_moe_gguf(model, name, path, kind)
        built[fmt] = (model, path, convert_gguf(path, folder / f"{fmt}-store", progress=False))
    return name, built


def _generate(store, policy, kv="full", kv_options=None):
    with OffloadedLM.load(path=store, policy=policy, kv_policy=kv, kv_options=kv_options,
                          progress=False) as lm:
        out = lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)
        return out, lm.tiers.bytes_moved, lm.cfg


@contextlib.contextmanager
def experts_inputs_rounded(model, kinds: dict):
    """transformers' routed experts with their products' inputs rounded as the GGUF block
    kernels round them, where the experts stay the file's blocks (types outside
    ``gguf_codes.MOE_CODES``): 8-bit codes per block of the type's values (32, or 256 for
    the K-quants). The fused experts are not ``nn.Linear`` layers, which
    ``conftest.inputs_rounded`` rounds: their ``F.linear`` is swapped while they run.
    ``kinds``: the type of the gate and up experts (``gate``) and of the down ones (``down``)."""
    from flexgen_infinigen.memory.codes import BLOCK_FORMS
    from flexgen_infinigen.weights.gguf_codes import MOE_CODES

    plain = torch.nn.functional.linear
    hidden = model.config.hidden_size

    def rounded(x, weight, bias=None):
        kind = kinds["gate"] if weight.shape[-1] == hidden else kinds["down"]
        if kind in MOE_CODES:
            return plain(x, weight, bias)
        b = x.float().reshape(-1, BLOCK_FORMS[kind][1])
        amax = b.abs().amax(1, keepdim=True)
        q = torch.round(b * torch.where(amax > 0, 127 / amax, 0))
        return plain((q * (amax / 127)).reshape(x.shape).to(x.dtype), weight, bias)

    def swap(*_):
        torch.nn.functional.linear = rounded

    def restore(*_):
        torch.nn.functional.linear = plain

    experts = [layer.mlp.experts for layer in model.model.layers
               if hasattr(layer.mlp, "experts")]
    handles = [h for e in experts for h in (e.register_forward_pre_hook(swap),
                                            e.register_forward_hook(restore))]
    # the eager implementation: the one whose products are F.linear calls
    was = [getattr(e.config, "_experts_implementation", None) for e in experts]
    for e in experts:
        e.config._experts_implementation = "eager"
    try:
        yield model
    finally:
        restore()
        for e, impl in zip(experts, was):
            e.config._experts_implementation = impl
        for h in handles:
            h.remove()


def _assert_matches(out, model, kind=None):
    """Greedy tokens and logits equal transformers' (run on the values the file encodes, for
    ``kind``: the experts' GGUF type, or one per fused tensor kind; None: float experts)."""
    kinds = {} if kind is None else {"gate": kind, "down": kind} if isinstance(kind, str) \
        else {"gate": kind["ffn_gate_exps"], "down": kind["ffn_down_exps"]}
    with experts_inputs_rounded(model, kinds) if kinds else contextlib.nullcontext():
        want = [hf_greedy(model, prompt, STEPS) for prompt in PROMPTS]
    for row, (tokens, logits) in enumerate(want):
        assert out.token_ids[row] == tokens
        tol = 2e-3 * logits.abs().max().item() if kinds else 1e-4
        assert (out.logits[row] - logits).abs().max().item() < tol


@pytest.mark.parametrize("fmt", ["float", "quantized"])
@pytest.mark.parametrize("experts", ["cpu-memory", "disk"])
def test_matches_transformers(family, fmt, experts):
    """Greedy tokens and logits equal transformers', the experts read as routed from CPU
    memory or from disk (the rest on the compute device)."""
    name, built = family
    model, _, store = built[fmt]
    out, moved, cfg = _generate(store, CPU_MEMORY if experts == "cpu-memory" else ON_DISK)
    assert cfg.num_experts == FAMILIES[name][2].get("num_experts", 8)
    assert moved["host->device"]["weights"] == 0
    # float experts are copied to the compute device as routed; quantized ones in CPU memory
    # are multiplied where they are (the CPU kernels read the codes), so none move there
    in_place = fmt == "quantized" and experts == "cpu-memory"
    assert (moved["host->device"]["experts"] > 0) != in_place
    assert (moved["disk->host"]["experts"] > 0) == (experts == "disk")
    _assert_matches(out, model, EXPERT_TYPE[name] if fmt == "quantized" else None)


@pytest.mark.parametrize("fmt", ["float", "quantized"])
def test_infinigen_keeping_everything_matches(family, fmt):
    name, built = family
    model, _, store = built[fmt]
    out, _, _ = _generate(store, CPU_MEMORY, "infinigen", {"options": KEEP_ALL})
    _assert_matches(out, model, EXPERT_TYPE[name] if fmt == "quantized" else None)


@pytest.mark.parametrize("family", ["qwen2moe", "mixtral"], indirect=True)
@pytest.mark.parametrize("fmt", ["float", "quantized"])
def test_expert_bytes_equal_the_routers_choices(family, fmt):
    """Experts on disk, two GPU batches: the expert bytes read from disk and brought to the
    device are the experts transformers' routers chose (the union over the block, per layer
    and iteration) times one expert's bytes as the runtime holds it (float32, or the file's
    codes with their scales); the other weights never move."""
    from test_moe import expert_reads

    from flexgen_infinigen.weights.store import WeightStore

    name, built = family
    model, _, store = built[fmt]
    prompts = [p[:10] for p in PROMPTS]  # equal lengths: no padding tokens to route
    policy = Placement.from_percent([100, 0, 100, 0, 100, 0], num_gpu_batches=2,
                                 expert_gpu_percent=0, expert_cpu_percent=0)
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        out = lm.generate(prompts, STEPS, stop_token_id=None, keep_logits=True)
        moved, cfg = lm.tiers.bytes_moved, lm.cfg
    ws = WeightStore(store)
    layer = max(set(range(cfg.num_layers)) - set(cfg.dense_layers))
    mats = [f"layers.{layer}.experts.0.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    per_expert = sum(ws.packed(k).nbytes if fmt == "quantized" else
                     math.prod(ws.tensors[k]["shape"]) * 4 for k in mats)
    used = expert_reads(model, prompts, out.token_ids, STEPS)
    assert 0 < used < STEPS * (cfg.num_layers - len(cfg.dense_layers)) * cfg.num_experts
    assert moved["disk->host"]["experts"] == used * per_expert
    assert moved["host->device"]["experts"] == used * per_expert
    assert moved["host->device"]["weights"] == moved["disk->host"]["weights"] == 0


@pytest.mark.parametrize("family", ["qwen2moe"], indirect=True)
def test_experts_placed_whole_across_tiers(family):
    """--experts-percent 25 50 (the rest on disk): each expert lives whole in one tier, the
    first of a layer on the device, the next in CPU memory, the rest on disk; the memory
    plan's expert bytes per tier are what the loaded experts hold; experts on disk come to
    the CPU as their codes (multiplied as read, never expanded to floats); greedy tokens and
    logits equal transformers'."""
    from flexgen_infinigen.engine import memory_plan
    from flexgen_infinigen.memory.codes import PackedWeight
    from flexgen_infinigen.engine.expert_homes import expert_of
    from flexgen_infinigen.memory.tiers import DEVICE, DISK, HOST, TIERS

    name, built = family
    model, _, store = built["quantized"]
    policy = Placement.from_percent([100, 0, 100, 0, 100, 0], expert_gpu_percent=25,
                                 expert_cpu_percent=50)
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        out = lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)
        cfg, moved, weights = lm.cfg, lm.tiers.bytes_moved, lm.engine.weights
        held, homes = {t: 0 for t in TIERS}, {}
        for n, t in weights.items():
            if expert_of(n) is None:
                continue
            tiers = {s.tier for s in t.segments}
            assert len(tiers) == 1, n  # never split
            homes.setdefault(expert_of(n), set()).update(tiers)
            for tier, b in t.bytes_by_tier().items():
                held[tier] += b
        disk_expert = next(t for n, t in weights.items()
                           if expert_of(n) and t.segments[0].tier == DISK)
        assert isinstance(disk_expert.read_for_compute(), PackedWeight)
        plan = memory_plan.plan(cfg, policy, torch.float32, len(PROMPTS[0]), STEPS,
                                device=torch.device("cpu"),
                                layouts=lm.weight_layouts)
    assert all(len(h) == 1 for h in homes.values())
    e = cfg.num_experts
    quarter, half = round(e * 0.25), round(e * 0.75) - round(e * 0.25)
    for (layer, expert), (tier,) in homes.items():
        assert tier == (DEVICE if expert < quarter else HOST if expert < quarter + half
                        else DISK), (layer, expert)
    assert plan["experts"] == held
    assert moved["disk->host"]["experts"] > 0 and moved["host->device"]["weights"] == 0
    _assert_matches(out, model, EXPERT_TYPE[name])


def test_config_and_expert_tensors(family):
    """The config is the transformers model's; every expert is its own store tensor, and a
    quantized expert holds exactly its rows of the file's blocks (codes unchanged)."""
    from flexgen_infinigen.weights.store import WeightStore

    name, built = family
    model, path, store = built["quantized"]
    hf, ws = model.config, WeightStore(store)
    cfg = ws.config
    assert cfg.model_type == hf.model_type
    assert (cfg.experts_per_token, cfg.norm_topk_prob) == (2, bool(hf.norm_topk_prob)
                                                           if hf.model_type != "mixtral"
                                                           else True)
    shared = getattr(hf, "shared_expert_intermediate_size", 0) or \
        getattr(hf, "n_shared_experts", 0) * getattr(hf, "moe_intermediate_size", 0)
    assert cfg.shared_expert_size == shared
    dense = getattr(hf, "mlp_only_layers", None) or range(getattr(hf, "first_k_dense_replace", 0))
    assert set(cfg.dense_layers) == set(dense)
    assert cfg.num_layers == hf.num_hidden_layers  # a drafting block is not one of them
    assert cfg.qk_norm_full == (name == "olmoe")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    layer = 2  # an MoE layer in every family
    for part, matrix in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        t = tensors[f"blk.{layer}.ffn_{part}_exps.weight"]
        assert t.tensor_type.name == EXPERT_TYPE[name]
        rows = np.asarray(t.data).reshape(cfg.num_experts, -1, np.asarray(t.data).shape[-1])
        for e in range(cfg.num_experts):
            key = f"layers.{layer}.experts.{e}.{matrix}.weight"
            assert ws.format(key) == EXPERT_TYPE[name]
            assert np.array_equal(ws.load(key).reshape(rows[e].shape), rows[e]), key
    assert not any(f"layers.{i}.experts.0.up_proj.weight" in ws.tensors for i in cfg.dense_layers)


def test_report_names_the_experts_format(family):
    """The report's weights line gives the experts' format apart from the other MLPs'."""
    from flexgen_infinigen.cli.report import build_report

    name, built = family
    with OffloadedLM.load(path=built["quantized"][2], policy=CPU_MEMORY, progress=False) as lm:
        out = lm.generate(PROMPTS[:1], 1, stop_token_id=None)
        formats = build_report(lm, out, "cpu")["weight_formats"]
    assert formats["by_class"]["experts"] == [EXPERT_TYPE[name]]
    assert formats["by_class"]["router"] == ["F32"]
    assert f"{EXPERT_TYPE[name]} (experts)" in formats["summary"]


# --- bad input ----------------------------------------------------------------------------

BAD = {
    "count": (dict(meta={"expert_count": 6}), "holds 8 experts"),
    "width": (dict(meta={"expert_feed_forward_length": 48}), "expert_feed_forward_length"),
    "leading-dense": (dict(meta={"leading_dense_block_count": 2}),
                      "leading_dense_block_count"),
    "top-k": (dict(meta={"expert_used_count": 9}), "expert_used_count"),
    "not-computed-field": (dict(meta={"expert_group_count": 2}), "qwen3moe.expert_group_count"),
    "sigmoid-router": (dict(meta={"expert_gating_func": 2}), "expert_gating_func"),
    "weight-scale": (dict(meta={"expert_weights_scale": 2.5}), "expert_weights_scale"),
}


@pytest.mark.parametrize("kind", [None, "Q8_0"])
def test_gate_and_up_fused_in_one_tensor(kind, tmp_path):
    """llama.cpp's ``ffn_gate_up_exps`` (each expert's gate rows, then its up rows) gives
    the same per-expert store tensors, codes unchanged, and transformers' tokens."""
    from flexgen_infinigen.weights.gguf_convert import convert_gguf
    from flexgen_infinigen.weights.store import WeightStore

    model = _tiny("qwen3moe")
    path = tmp_path / "gate-up.gguf"
    write_moe_gguf(model, "qwen3moe", path, kind, gate_up=True)
    fused = {t.name: t for t in gguf.GGUFReader(path).tensors}["blk.2.ffn_gate_up_exps.weight"]
    store = convert_gguf(path, tmp_path / "store", progress=False)
    ws, data = WeightStore(store), np.asarray(fused.data)
    halves = data.reshape(8, 2, 32, data.shape[-1])  # [expert, gate | up, rows, row]
    for e in (0, 5):
        for j, m in enumerate(("gate_proj", "up_proj")):
            stored = ws.load(f"layers.2.experts.{e}.{m}.weight")
            assert np.array_equal(np.asarray(stored).reshape(halves[e, j].shape), halves[e, j])
    out, _, _ = _generate(store, ON_DISK)
    _assert_matches(out, model, kind)


def test_k_quant_experts(tmp_path):
    """Experts as a Q4_K_M file holds them (gate and up Q4_K, down Q6_K: 256-value super-
    blocks, 4-bit codes in groups of 32 and 8-bit ones in groups of 16) give transformers'
    tokens on the weights the codes encode, with the experts in CPU memory or on disk."""
    import transformers

    from flexgen_infinigen.weights.gguf_convert import convert_gguf
    from flexgen_infinigen.weights.store import WeightStore

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{
        **COMMON, "hidden_size": 256, "num_hidden_layers": 2, "head_dim": 64,
        "num_experts": 4, "moe_intermediate_size": 256, "norm_topk_prob": True})).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(torch.randn_like(p) * 0.5 + 1)
            elif pname.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    path = tmp_path / "k.gguf"
    kinds = {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K"}
    write_moe_gguf(model, "qwen3moe", path, kinds)
    store = convert_gguf(path, tmp_path / "store", progress=False)
    ws = WeightStore(store)
    assert ws.format("layers.1.experts.3.up_proj.weight") == "Q4_K"
    assert ws.format("layers.1.experts.3.down_proj.weight") == "Q6_K"
    for policy in (CPU_MEMORY, ON_DISK):
        out, _, _ = _generate(store, policy)
        _assert_matches(out, model, kinds)


def test_sparse_step(tmp_path):
    """Only every second block sparse (transformers' decoder_sparse_step, the file's
    interleave_moe_layer_step): blocks 0 and 2 dense, and transformers' tokens and logits."""
    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    model = _tiny("qwen3moe")
    model = type(model)(type(model.config)(**{**model.config.to_dict(), "mlp_only_layers": [],
                                              "decoder_sparse_step": 2})).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(torch.randn_like(p) * 0.5 + 1)
    path = tmp_path / "step.gguf"
    write_moe_gguf(model, "qwen3moe", path, meta={"interleave_moe_layer_step": 2})
    store = convert_gguf(path, tmp_path / "store", progress=False)
    out, _, cfg = _generate(store, CPU_MEMORY)
    assert cfg.dense_layers == (0, 2)
    _assert_matches(out, model)
    with pytest.raises(ConfigError, match="interleave_moe_layer_step = 3"):
        write_moe_gguf(model, "qwen3moe", path, meta={"interleave_moe_layer_step": 3})
        convert_gguf(path, tmp_path / "store3", progress=False)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_file_is_one_error_before_writing(case, tmp_path):
    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    kwargs, words = BAD[case]
    path = tmp_path / "bad.gguf"
    write_moe_gguf(_tiny("qwen3moe"), "qwen3moe", path, **kwargs)
    with pytest.raises(ConfigError, match=words) as err:
        convert_gguf(path, tmp_path / "store", progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "store").exists() and not list(tmp_path.glob(".store.partial-*"))


def test_old_per_expert_mixtral_file_is_one_error(tmp_path):
    """A Mixtral GGUF from before the fused layout (``blk.N.ffn_gate.E.weight``, one tensor
    per expert) is one error saying how to get a file this runtime reads."""
    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    path = tmp_path / "old.gguf"
    write_moe_gguf(_tiny("mixtral"), "mixtral", path, per_expert=True)
    with pytest.raises(ConfigError, match="current llama.cpp") as err:
        convert_gguf(path, tmp_path / "store", progress=False)
    assert "\n" not in str(err.value) and "ffn_" in str(err.value)
    assert not (tmp_path / "store").exists()


def test_mixtral_without_expert_count_is_one_error(tmp_path):
    """A llama file with fused expert tensors but no expert count says so."""
    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    path = tmp_path / "mixtral.gguf"
    write_moe_gguf(_tiny("mixtral"), "mixtral", path, drop=("expert_count",))
    with pytest.raises(ConfigError, match="expert_count") as err:
        convert_gguf(path, tmp_path / "store", progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "store").exists()
