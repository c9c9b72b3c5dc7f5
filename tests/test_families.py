"""Llama 3.x (RoPE scaling), Mistral (sliding window), Qwen2 (q/k/v biases) and Qwen3 (q/k
norms, a head width that is not hidden/heads; YaRN RoPE): tiny random models built by
transformers, saved sharded in bf16, converted by us and run under several placements,
equal transformers' logits and greedy tokens; InfiniGen keeping everything equals the full
cache; H2O and InfiniGen stay inside a sliding window."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import hf_greedy

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.kv import InfiniGenOptions

STEPS = 16
# longer than the sliding window (12) and than the RoPE scaling's original context (32)
PROMPTS = [[1] + [(7 * i + 3) % 500 + 2 for i in range(44)],
           [1] + [(11 * i + 5) % 500 + 2 for i in range(37)]]
COMMON = dict(vocab_size=512, hidden_size=128, num_hidden_layers=3, intermediate_size=256,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=False)
FAMILIES = {
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "llama-linear-tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True,
        attention_bias=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=12)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=48)),
    # YaRN: frequencies ramped between kept and interpolated, the tables scaled
    "qwen3-yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=48, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0})),
}
PLACEMENTS = {
    "all-on-device": Placement(),
    "weights-and-cache-in-cpu-memory": Placement.from_percent([0, 100, 0, 100, 100, 0],
                                                           overlap=True),
    "mixed-with-disk-two-batches": Placement.from_percent([30, 40, 30, 40, 100, 0],
                                                       num_gpu_batches=2, overlap=True),
}
KEEP_ALL = InfiniGenOptions(alpha=math.inf, max_kv_fraction=1.0, first_layer=1)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model in fp32 from the bf16 checkpoint, our converted store)."""
    import transformers

    from flexgen_infinigen.weights.hf_convert import convert_hf

    name = request.param
    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():  # biases and norm scales start at 0 and 1: make them count
        for pname, p in model.named_parameters():
            if "bias" in pname or "norm" in pname:
                p.copy_(torch.randn_like(p) * 0.5 + ("norm" in pname))
    folder = tmp_path_factory.mktemp(name)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="300KB")
    assert (folder / "model.safetensors.index.json").is_file()  # really sharded
    ref = getattr(transformers, model_cls).from_pretrained(folder, dtype=torch.float32).eval()
    store = convert_hf(folder, folder / "store", name, progress=False)
    return name, ref, store


def _run(store, policy, kv="full", kv_options=None):
    with OffloadedLM.load(path=store, policy=policy, kv_policy=kv, kv_options=kv_options,
                          progress=False) as lm:
        out = lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)
        return out, lm.engine.kv_policy.report()


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_matches_transformers(family, placement):
    name, ref, store = family
    out, _ = _run(store, PLACEMENTS[placement])
    for row, prompt in enumerate(PROMPTS):
        tokens, logits = hf_greedy(ref, prompt, STEPS)
        assert out.token_ids[row] == tokens, name
        assert (out.logits[row] - logits).abs().max().item() < 1e-4, name


def test_infinigen_keeping_everything_equals_full(family):
    name, _, store = family
    full, _ = _run(store, Placement())
    ours, report = _run(store, PLACEMENTS["weights-and-cache-in-cpu-memory"], "infinigen",
                        {"options": KEEP_ALL})
    assert ours.token_ids == full.token_ids, name
    for a, b in zip(ours.logits, full.logits):
        assert (a - b).abs().max().item() < 1e-4, name
    assert report["kv_selected_fraction"] > 0.2


def test_store_keeps_bf16(family):
    """A bf16 checkpoint is stored in its 16 bits, not widened."""
    from flexgen_infinigen.weights.store import WeightStore

    store = WeightStore(family[2])
    assert {info["dtype"] for info in store.tensors.values()} == {"bfloat16"}
    assert store.tensor("layers.0.q_proj.weight").dtype == torch.bfloat16


def test_h2o_keeping_everything_equals_full(family):
    """H2O with a budget of the whole context: evicts only what the window hides."""
    name, _, store = family
    full, _ = _run(store, Placement())
    ours, _ = _run(store, PLACEMENTS["weights-and-cache-in-cpu-memory"], "h2o",
                   {"hh_ratio": 0.5, "recent_ratio": 0.5})
    assert ours.token_ids == full.token_ids, name
    for a, b in zip(ours.logits, full.logits):
        assert (a - b).abs().max().item() < 1e-4, name


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_sliding_window_changes_the_output(family, tmp_path):
    """The window is real: the same weights without it give other logits (so the tests above
    would see a policy that attends outside it)."""
    import json
    import shutil

    _, _, store = family
    plain = tmp_path / "no-window"
    shutil.copytree(store, plain)
    manifest = json.loads((plain / "manifest.json").read_text())
    assert manifest["config"]["sliding_window"] == 12
    manifest["config"]["sliding_window"] = 0
    (plain / "manifest.json").write_text(json.dumps(manifest))
    windowed, _ = _run(store, Placement())
    unwindowed, _ = _run(plain, Placement())
    assert (windowed.logits[0] - unwindowed.logits[0]).abs().max().item() > 1e-2


def test_oracle_keeping_everything_equals_full(family):
    from flexgen_infinigen.kv.options import SelectionOptions

    name, _, store = family
    full, _ = _run(store, Placement())
    ours, _ = _run(store, PLACEMENTS["weights-and-cache-in-cpu-memory"], "oracle",
                   {"options": SelectionOptions(max_kv_fraction=1.0, first_layer=1)})
    assert ours.token_ids == full.token_ids, name
    for a, b in zip(ours.logits, full.logits):
        assert (a - b).abs().max().item() < 1e-4, name


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_compressed_window_reads_match_on_every_tier(family):
    """The sliding window's partial read of a 4-bit cache: the same numbers whether the
    cache is on the device, in CPU memory or split with disk."""
    _, _, store = family
    outs = [_run(store, dataclasses.replace(p, compress_cache=True))[0]
            for p in PLACEMENTS.values()]
    for other in outs[1:]:
        assert other.token_ids == outs[0].token_ids
        for a, b in zip(other.logits, outs[0].logits):
            assert (a - b).abs().max().item() < 1e-4
