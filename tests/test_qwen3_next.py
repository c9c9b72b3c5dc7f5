"""The Qwen3.5 / Qwen3-Next hybrids: tiny random models built by transformers (Qwen3.5 dense,
and Qwen3-Next with its fused DeltaNet projections and a mixture of experts), saved,
converted by us and run under several placements, equal transformers' greedy tokens and
logits: Gated DeltaNet layers (causal convolution, the gated delta rule, the gated output
norm) between gated full-attention layers (q/k norms, partial RoPE). The DeltaNet's state
after a chunked prompt equals the token-by-token recurrence's; it is held in the tiers and
its bytes are counted in the ledger and the memory plan; a row that takes another prompt
(a join) or starts over carries that sequence's state and nothing of the old one."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import hf_greedy

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.engine.memory_plan import plan
from flexgen_infinigen.kv import InfiniGenOptions
from flexgen_infinigen.models import qwen3_next
from flexgen_infinigen.weights.hf_config import config_from_hf

STEPS = 10
# the first spans two of the prefill's 64-token chunks; the second is left-padded beside it
PROMPTS = [[2] + [(7 * i + 3) % 290 + 3 for i in range(92)],
           [2] + [(11 * i + 5) % 290 + 3 for i in range(14)]]
BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=512,
            bos_token_id=2, eos_token_id=1, pad_token_id=0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
           shared_expert_intermediate_size=32)
PLACEMENTS = {
    "all-on-device": Placement(),
    "weights-and-state-in-cpu-memory": Placement.from_percent([0, 100, 0, 100, 100, 0],
                                                           overlap=True),
    "mixed-with-disk-two-batches": Placement.from_percent([30, 40, 30, 40, 100, 0],
                                                       num_gpu_batches=2, overlap=True),
}


def _build(folder, kind: str):
    """(transformers model in fp32, our converted store) of a tiny hybrid whose norms,
    decays and step sizes are drawn so that each counts."""
    import transformers
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from flexgen_infinigen.weights.hf_convert import convert_hf

    torch.manual_seed(0)
    if kind == "qwen3_5":
        cls, config = Qwen3_5ForCausalLM, Qwen3_5TextConfig(**BASE)
    else:
        cls, config = transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig(**BASE,
                                                                                    **MOE)
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    model.save_pretrained(folder)
    ref = cls.from_pretrained(folder, dtype=torch.float32).eval()
    return ref, convert_hf(folder, folder / "store", f"{kind}-tiny", progress=False)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def hybrid(request, tmp_path_factory):
    return _build(tmp_path_factory.mktemp(request.param), request.param)


def _run(store, policy, kv="full", kv_options=None, prompts=PROMPTS):
    with OffloadedLM.load(path=store, policy=policy, kv_policy=kv, kv_options=kv_options,
                          progress=False) as lm:
        return lm.generate(prompts, STEPS, stop_token_id=None, keep_logits=True)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_matches_transformers(hybrid, placement):
    ref, store = hybrid
    out = _run(store, PLACEMENTS[placement])
    for row, prompt in enumerate(PROMPTS):
        tokens, logits = hf_greedy(ref, prompt, STEPS)
        assert out.token_ids[row] == tokens
        assert (out.logits[row] - logits).abs().max().item() < 1e-4


def test_the_recurrence_and_the_gate_count(hybrid):
    """The check above would pass on a model whose DeltaNet layers or attention gates did
    nothing: both move the reference's logits."""
    ref, _ = hybrid
    _, logits = hf_greedy(ref, PROMPTS[0], 2)
    layers = ref.model.layers
    deltanet = next(layer for layer in layers if hasattr(layer, "linear_attn"))
    attention = next(layer for layer in layers if hasattr(layer, "self_attn"))
    with torch.no_grad():
        saved = deltanet.linear_attn.out_proj.weight.clone()
        deltanet.linear_attn.out_proj.weight.zero_()
        _, no_recurrence = hf_greedy(ref, PROMPTS[0], 2)
        deltanet.linear_attn.out_proj.weight.copy_(saved)
        q = attention.self_attn.q_proj.weight
        saved = q.clone()
        gates = q.view(BASE["num_attention_heads"], 2, BASE["head_dim"], -1)
        gates[:, 1].fill_(0)  # every gate sigmoid(0) = 1/2
        _, half_gate = hf_greedy(ref, PROMPTS[0], 2)
        q.copy_(saved)
    # ten times the tolerance the comparison with transformers holds to
    assert (logits - no_recurrence).abs().max() > 1e-3
    assert (logits - half_gate).abs().max() > 1e-3


def test_infinigen_keeping_everything_equals_the_full_cache(hybrid):
    """InfiniGen selects on the attention layers only (the DeltaNet layers keep no rows to
    select) and, keeping every row, gives the full cache's tokens."""
    _, store = hybrid
    full = _run(store, Placement())
    every = {"options": InfiniGenOptions(alpha=math.inf, max_kv_fraction=1.0, first_layer=1)}
    kept = _run(store, PLACEMENTS["weights-and-state-in-cpu-memory"], "infinigen", every)
    assert kept.token_ids == full.token_ids
    assert max((a - b).abs().max().item() for a, b in zip(kept.logits, full.logits)) < 1e-4
    some = {"options": InfiniGenOptions(max_kv_fraction=0.3, select_from_mb=0.0)}
    partial = _run(store, Placement(), "infinigen", some)
    assert len(partial.token_ids[0]) == STEPS


def _random_weights(cfg, layer: int) -> dict:
    torch.manual_seed(1)
    shapes = qwen3_next.weight_shapes(cfg)
    prefix = f"layers.{layer}."
    w = {n[len(prefix):]: torch.randn(s) * 0.3 for n, s in shapes.items()
         if n.startswith(prefix)}
    w["linear.A"] = -torch.rand_like(w["linear.A"])
    return w


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 150])
def test_chunked_prefill_state_equals_token_by_token(length):
    """The state (convolution and matrices) after a prompt computed in chunks equals the one
    after feeding it one token at a time, from a state that is not zero, with a padded row."""
    cfg = config_from_hf({**BASE, "model_type": "qwen3_5_text"}, "t")
    w = _random_weights(cfg, cfg.linear_layers[0])
    torch.manual_seed(2)
    h = torch.randn(2, length, cfg.hidden_size)
    valid = torch.ones(2, length, dtype=torch.bool)
    valid[1, :length // 3] = False  # left padding leaves the state as it was
    start = {name: torch.randn(2, *shape) * 0.1
             for name, shape in qwen3_next.recurrent_state_shapes(cfg).items()}
    whole, chunked = qwen3_next.recurrent_mix(cfg, w, h, start, valid)
    state, outs = start, []
    for t in range(length):
        out, state = qwen3_next.recurrent_mix(cfg, w, h[:, t:t + 1], state, valid[:, t:t + 1])
        outs.append(out)
    for name in state:
        assert torch.allclose(chunked[name], state[name], atol=1e-5), name
    assert torch.allclose(whole, torch.cat(outs, 1), atol=1e-5)


def test_a_decode_steps_rearranged_rule_equals_the_recurrence():
    """A decode step's delta rule (``delta_rule_step``: the output and correction from one
    product with the entering matrix) equals the recurrence as written (``delta_rule_steps``),
    and the convolution of one token (its taps summed) equals ``conv1d``'s, through the layer:
    a token-by-token prompt above goes through both."""
    torch.manual_seed(4)
    b, heads, dk, dv = 3, 4, 8, 12
    q, k = (qwen3_next._l2norm(torch.randn(b, 1, heads, dk)) for _ in range(2))
    v, matrix = torch.randn(b, 1, heads, dv), torch.randn(b, heads, dk, dv)
    g, beta = -torch.rand(b, 1, heads), torch.rand(b, 1, heads)
    want_out, want = qwen3_next.delta_rule_steps(q, k, v, g, beta, matrix.clone())
    got_out, got = qwen3_next.delta_rule_step(q, k, v, g, beta, matrix.clone())
    assert torch.allclose(got_out, want_out, atol=1e-5) and torch.allclose(got, want, atol=1e-5)
    assert (want - matrix).abs().max() > 0.1  # the step moved the matrix


def _state_bytes(cfg) -> int:
    return 4 * sum(math.prod(s) for s in qwen3_next.recurrent_state_shapes(cfg).values())


def test_state_is_held_in_the_tiers_and_counted(hybrid):
    """With the cache (and so the states) in CPU memory, copied as over a GPU's link: the
    ledger's KV bytes are the attention layers' rows plus each DeltaNet layer's state read
    at every decode step and written after the prompt and every step; the memory plan's
    cache bytes are the attention caches plus one state per row and layer."""
    _, store = hybrid
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], host_in_place=False)
    prompt = PROMPTS[1]
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        cfg = lm.cfg
        lm.generate([prompt], STEPS, stop_token_id=None)
        moved = lm.tiers.bytes_moved
        planned = plan(cfg, policy, torch.float32, len(prompt), STEPS)
    linear, state = len(cfg.linear_layers), _state_bytes(cfg)
    row = 2 * cfg.attention_layers * cfg.kv_dim * 4
    kv_read = row * sum(len(prompt) + i - 1 for i in range(1, STEPS))
    kv_written = row * (len(prompt) + STEPS - 1)
    assert moved["host->device"]["kv_cache"] == kv_read + (STEPS - 1) * linear * state
    assert moved["device->host"]["kv_cache"] == kv_written + STEPS * linear * state
    caches = 2 * cfg.attention_layers * (len(prompt) + STEPS) * cfg.kv_dim * 4
    assert sum(planned["kv_cache"].values()) == caches + linear * state


def test_a_row_that_joins_or_restarts_carries_its_own_state(hybrid):
    """Between two steps of a running block, row 0 takes a prompt prefilled alone and row 1
    starts over from one token: each then generates what that sequence generates alone (a
    state left from the row's old sequence would change it)."""
    _, store = hybrid
    with OffloadedLM.load(path=store, policy=Placement(gpu_batch_size=2), progress=False) as lm:
        engine, joiner = lm.engine, PROMPTS[1][:9]
        ids = torch.tensor([PROMPTS[0][:30], PROMPTS[0][30:60]])
        batches = [(ids, torch.ones_like(ids, dtype=torch.bool))]
        rows = {0: [], 1: []}
        steps = engine.generate_block(batches, 12, lambda x, i, b: x.argmax(-1))
        for i, step in enumerate(steps):
            if i == 2:
                assert engine.can_join(len(joiner))
                rows[0].append(engine.join_row(0, 0, joiner, lambda x: int(x.argmax())))
                engine.restart_row(0, 1, 7)
                rows[1].append(7)
            elif i > 2:
                for r in rows:
                    rows[r].append(int(step.tokens[0][r]))
        alone = lm.generate([joiner, [7]], 10, stop_token_id=None)
    assert len(rows[0]) == 10 and rows[0] == alone.token_ids[0]
    assert rows[1][1:] == alone.token_ids[1][:len(rows[1]) - 1]


def test_configs_read_and_refuse():
    """The multimodal Qwen3.5 config reads as its text model; a DeltaNet field it does not
    know is refused by name; Qwen3-Next's default layer pattern is every fourth full."""
    text = {**BASE, "model_type": "qwen3_5_text"}
    wrapped = {"model_type": "qwen3_5", "text_config": text, "vision_config": {},
               "image_token_id": 5, "tie_word_embeddings": False}
    assert config_from_hf(wrapped, "t") == config_from_hf(text, "t")
    cfg = config_from_hf({**BASE, **MOE, "model_type": "qwen3_next"}, "t")
    assert cfg.linear_layers == (0, 1, 2) and cfg.attention_layers == 1
    assert cfg.rotary_dim == 4 and cfg.num_experts == 4 and cfg.shared_expert_size == 32
    with pytest.raises(ConfigError, match="linear_new_thing"):
        config_from_hf({**text, "linear_new_thing": 1}, "t")
    with pytest.raises(ConfigError, match="hidden_act"):
        config_from_hf({**text, "hidden_act": "gelu"}, "t")
