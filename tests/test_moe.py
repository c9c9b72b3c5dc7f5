"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE): tiny random checkpoints
built by transformers, saved as the Hub writes them (one safetensors tensor per expert
matrix), converted by us and run under several placements: tokens and logits equal
transformers'; InfiniGen keeping everything equals the full cache; the routed experts' bytes
moved between tiers equal a count made from transformers' own router choices."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import hf_greedy

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.kv import InfiniGenOptions

STEPS = 6
PROMPTS = [[1] + [(7 * i + 3) % 200 + 2 for i in range(13)],
           [1] + [(11 * i + 5) % 200 + 2 for i in range(9)]]
COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, intermediate_size=96,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              tie_word_embeddings=False, num_experts_per_tok=2)
QWEN3 = dict(num_experts=8, moe_intermediate_size=32, head_dim=24)
# name: (config class, model class, config fields, layers whose router is zero: every token
# ties between all experts there)
FAMILIES = {
    # a dense layer (mlp_only_layers) among MoE layers, the top-k renormalised
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(QWEN3, norm_topk_prob=True, mlp_only_layers=[1]), ()),
    # top-k not renormalised; layer 0 dense by the sparse step, layer 1 ties everywhere
    "qwen3_moe-ties": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                       dict(QWEN3, norm_topk_prob=False, decoder_sparse_step=2,
                            num_hidden_layers=4), (1,)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=8, intermediate_size=48), ()),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=6, moe_intermediate_size=32,
                       shared_expert_intermediate_size=80, norm_topk_prob=False), ()),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_experts=8, intermediate_size=32, norm_topk_prob=False), ()),
    # GLM-4.5: sigmoid scores chosen with a bias in the best 2 of 4 groups, scaled; a shared
    # expert without gate; a dense first layer; RoPE on half of each head; q/k norms and
    # q/k/v biases
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=1,
                      n_group=4, topk_group=2, routed_scaling_factor=2.5,
                      first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
                      head_dim=24, partial_rotary_factor=0.5), ()),
    # DeepSeek-V3: multi-head latent attention (a 40-dim cached row: a 32-dim latent and an
    # 8-dim rotary key, interleaved), a low-rank query, the same router as GLM-4.5
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=1,
                         n_group=4, topk_group=2, routed_scaling_factor=2.5,
                         first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24,
                         qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                         num_key_value_heads=4), ()),
}
PLACEMENTS = {
    "all-on-device": Placement(),
    "weights-and-cache-in-cpu-memory": Placement.from_percent([0, 100, 0, 100, 100, 0],
                                                           overlap=True),
    "weights-on-disk": Placement.from_percent([0, 0, 100, 0, 100, 0]),
    "mixed-with-disk-two-batches": Placement.from_percent([30, 40, 30, 40, 100, 0],
                                                       num_gpu_batches=2, overlap=True),
    # hidden states kept off the device between stages: a decode step's MoE MLP reads every
    # GPU batch's back for the block's one pass and keeps each one's result apart again
    "activations-offloaded-two-batches": Placement.from_percent([100, 0, 100, 0, 0, 100],
                                                             num_gpu_batches=2),
}
KEEP_ALL = InfiniGenOptions(alpha=math.inf, max_kv_fraction=1.0, first_layer=1)


def _routers(model):
    """Every MoE layer's router module, by layer."""
    return {i: layer.mlp.gate for i, layer in enumerate(model.model.layers)
            if hasattr(getattr(layer, "mlp", None), "gate")
            and hasattr(layer.mlp.gate, "top_k")} or {
        i: layer.block_sparse_moe.gate for i, layer in enumerate(model.model.layers)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model in fp32, our converted store)."""
    import transformers

    from flexgen_infinigen.weights.hf_convert import convert_hf

    name = request.param
    config_cls, model_cls, extra, tied = FAMILIES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "bias" in pname or "norm" in pname:  # start at 0 and 1: make them count
                p.copy_(torch.randn_like(p) * 0.5 + ("norm" in pname))
        for i, router in _routers(model).items():  # routes far apart (no near-ties) ...
            router.weight.copy_(torch.randn_like(router.weight) * (0 if i in tied else 1))
            if hasattr(router, "e_score_correction_bias"):  # a buffer, zeros at first
                router.e_score_correction_bias.copy_(
                    torch.randn_like(router.e_score_correction_bias) * 0.3)
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    ref = getattr(transformers, model_cls).from_pretrained(folder, dtype=torch.float32).eval()
    store = convert_hf(folder, folder / "store", name, progress=False)
    return name, ref, store


def _run(store, policy, kv="full", kv_options=None, prompts=PROMPTS, steps=STEPS):
    with OffloadedLM.load(path=store, policy=policy, kv_policy=kv, kv_options=kv_options,
                          progress=False) as lm:
        out = lm.generate(prompts, steps, stop_token_id=None, keep_logits=True)
        moved = {link: dict(kinds) for link, kinds in lm.tiers.bytes_moved.items()}
        return out, lm.engine.kv_policy.report(), moved, lm.engine.cfg


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_matches_transformers(family, placement):
    name, ref, store = family
    out, _, _, _ = _run(store, PLACEMENTS[placement])
    for row, prompt in enumerate(PROMPTS):
        tokens, logits = hf_greedy(ref, prompt, STEPS)
        assert out.token_ids[row] == tokens, name
        assert (out.logits[row] - logits).abs().max().item() < 1e-4, name


def test_infinigen_keeping_everything_equals_full(family):
    name, _, store = family
    full, _, _, _ = _run(store, Placement())
    ours, report, _, _ = _run(store, PLACEMENTS["weights-and-cache-in-cpu-memory"],
                              "infinigen", {"options": KEEP_ALL})
    assert ours.token_ids == full.token_ids, name
    for a, b in zip(ours.logits, full.logits):
        assert (a - b).abs().max().item() < 1e-4, name
    assert report["kv_selected_fraction"] > 0.2


def test_converted_config_and_layers(family):
    """The store holds one tensor per expert matrix, dense layers a dense MLP."""
    from flexgen_infinigen.weights.store import WeightStore

    name, ref, store = family
    cfg = WeightStore(store).config
    hf = ref.config
    assert cfg.model_type == hf.model_type and cfg.experts_per_token == 2
    names = set(WeightStore(store).tensors)
    for i in range(len(ref.model.layers)):
        moe = i in _routers(ref)
        assert (f"layers.{i}.router.weight" in names) == moe, (name, i)
        assert (f"layers.{i}.experts.0.down_proj.weight" in names) == moe, (name, i)
        assert (f"layers.{i}.gate_proj.weight" in names) != moe, (name, i)
    assert cfg.norm_topk_prob == bool(getattr(hf, "norm_topk_prob", True))


def expert_reads(ref, prompts, token_ids, steps: int) -> int:
    """How many expert reads a run of ``steps`` iterations over ``prompts`` (equal lengths,
    one block) takes, counted from transformers' own router choices on the tokens the run
    produced (``token_ids``): per MoE layer and iteration, the union of the experts every row
    was routed to (each expert read once a stage, shared by the block's GPU batches)."""
    return sum(expert_read_counts(ref, prompts, token_ids, steps).values())


def expert_read_counts(ref, prompts, token_ids, steps: int) -> dict[tuple[int, int], int]:
    """:func:`expert_reads` per (layer, expert): the iterations that read the expert."""
    counts: dict[tuple[int, int], int] = {}
    for i, per_iteration in routed_sets(ref, prompts, token_ids, steps).items():
        for used in per_iteration:
            for e in used:
                counts[(i, e)] = counts.get((i, e), 0) + 1
    return counts


def routed_sets(ref, prompts, token_ids, steps: int) -> dict[int, list[set[int]]]:
    """Per MoE layer and iteration, the experts any row was routed to, from transformers'
    own router choices on the tokens the run produced."""
    routers = _routers(ref)
    choices = {i: [] for i in routers}  # layer -> per prompt, the top-k indices per position
    hooks = [r.register_forward_hook(lambda m, a, o, i=i: choices[i].append(o[2]))
             for i, r in routers.items()]
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            ref(torch.tensor([prompt + token_ids[row][:steps - 1]]))
    for h in hooks:
        h.remove()
    length = len(prompts[0])
    # iteration 0 routes every prompt token, iteration t the t-th fed token, of both rows
    positions = [range(length)] + [[length + t - 1] for t in range(1, steps)]
    return {i: [{int(e) for per_row in choices[i] for p in pos for e in per_row[p]}
                for pos in positions] for i in routers}


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"], indirect=True)
@pytest.mark.parametrize("tier", ["cpu-memory", "disk"])
def test_expert_bytes_equal_the_routers_choices(family, tier):
    """Experts read per step are those the tokens were routed to, each once per stage of a
    block (both GPU batches share it): the bytes counted as ``experts`` equal that count from
    transformers' own router choices, and the other weights are read whole once a step."""
    name, ref, store = family
    prompts = [p[:10] for p in PROMPTS]  # equal lengths: no padding tokens to route
    percent = [0, 100, 0, 100, 100, 0] if tier == "cpu-memory" else [0, 0, 0, 100, 100, 0]
    policy = Placement.from_percent(percent, num_gpu_batches=2, overlap=True)
    out, _, moved, cfg = _run(store, policy, prompts=prompts)
    used = expert_reads(ref, prompts, out.token_ids, STEPS)
    per_expert = 3 * cfg.expert_intermediate_size * cfg.hidden_size * 4  # float32
    assert used < STEPS * len(_routers(ref)) * cfg.num_experts  # some experts were not read
    assert moved["host->device"]["experts"] == used * per_expert
    assert moved["disk->host"]["experts"] == (used * per_expert if tier == "disk" else 0)
    from flexgen_infinigen.models import family_of
    from flexgen_infinigen.models.moe import is_expert_weight
    dense = sum(math.prod(s) * 4 for n, s in family_of(cfg).weight_shapes(cfg).items()
                if not is_expert_weight(n))
    assert moved["host->device"]["weights"] == STEPS * dense


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"], indirect=True)
@pytest.mark.parametrize("on_device", [0, 50])
def test_experts_multiplied_in_cpu_memory(family, on_device):
    """``--cpu-expert-compute``, the CPU standing in for a GPU (its CPU memory copied as over
    a link), the other weights on the device, two GPU batches: tokens and logits equal
    transformers'. At decode no expert crosses the link: the experts' bytes moved are the
    prompt's fetches of experts in CPU memory alone, counted from transformers' router
    choices; what crosses instead is, for each decode stage that routed a token to an
    expert in CPU memory, the block's rows and their routing there and the sum back."""
    name, ref, store = family
    prompts = [p[:10] for p in PROMPTS]  # equal lengths: no padding tokens to route
    policy = Placement.from_percent([100, 0, 100, 0, 100, 0], num_gpu_batches=2,
                                 expert_gpu_percent=on_device, expert_cpu_percent=100 - on_device,
                                 host_in_place=False, cpu_expert_compute=True)
    out, _, moved, cfg = _run(store, policy, prompts=prompts)
    for row, prompt in enumerate(prompts):
        tokens, logits = hf_greedy(ref, prompt, STEPS)
        assert out.token_ids[row] == tokens, name
        assert (out.logits[row] - logits).abs().max().item() < 1e-4, name
    first_host = cfg.num_experts * on_device // 100  # experts by index: the first on device
    sets = routed_sets(ref, prompts, out.token_ids, STEPS)
    per_expert = 3 * cfg.expert_intermediate_size * cfg.hidden_size * 4  # float32
    prompt_fetches = sum(e >= first_host for used in sets.values() for e in used[0])
    assert moved["host->device"]["experts"] == prompt_fetches * per_expert
    stages = sum(any(e >= first_host for e in used) for per in sets.values() for used in per[1:])
    rows, k = len(prompts), cfg.experts_per_token
    assert stages > 0
    assert moved["device->host"]["activations"] == stages * rows * (cfg.hidden_size * 4
                                                                  + k * (4 + 8))
    assert moved["host->device"]["activations"] == stages * rows * cfg.hidden_size * 4


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
def test_packed_experts_multiplied_in_cpu_memory(family):
    """4-bit experts (``--compress-weight``) multiplied as codes by the CPU kernels where they
    are held give the run that fetches the same codes: equal tokens, logits to float32
    rounding, and no expert bytes moved after the prompt."""
    _, _, store = family
    runs = []
    for on_host in (False, True):
        policy = Placement.from_percent([100, 0, 100, 0, 100, 0], expert_gpu_percent=0,
                                     expert_cpu_percent=100, host_in_place=False,
                                     compress_weight=True, cpu_expert_compute=on_host)
        runs.append(_run(store, policy, steps=1)[2]["host->device"]["experts"])
        runs.append(_run(store, policy))
    (prompt_only, fetched), (prompt_only_host, computed) = runs[:2], runs[2:]
    assert computed[0].token_ids == fetched[0].token_ids
    for a, b in zip(computed[0].logits, fetched[0].logits):
        assert (a - b).abs().max().item() < 1e-4
    assert fetched[2]["host->device"]["experts"] > prompt_only > 0
    assert computed[2]["host->device"]["experts"] == prompt_only_host == prompt_only
    assert computed[2]["device->host"]["activations"] > 0


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
def test_routing_profile_counts_and_places_the_most_read_experts(family, tmp_path):
    """--record-routing counts each expert's reads per layer: equal to transformers' router
    choices on the same tokens. --experts-profile then puts each layer's most-read experts on
    the fastest tier (here a quarter on the device, the rest on disk), with the same output;
    a profile of another model is one error before loading."""
    from flexgen_infinigen.config import ConfigError
    from flexgen_infinigen.engine import routing_profile
    from flexgen_infinigen.engine.expert_homes import expert_of
    from flexgen_infinigen.memory.tiers import DEVICE, DISK

    name, ref, store = family
    prompts = [p[:10] for p in PROMPTS]  # equal lengths: no padding tokens to route
    one_block = Placement.from_percent([100, 0, 100, 0, 100, 0], num_gpu_batches=2)
    with OffloadedLM.load(path=store, policy=one_block, progress=False) as lm:
        lm.engine.routing_counts = {}
        out = lm.generate(prompts, STEPS, stop_token_id=None, keep_logits=True)
        counts, cfg = lm.engine.routing_counts, lm.cfg
        profile = tmp_path / "routing.json"
        routing_profile.save(profile, cfg, counts)
    assert counts == expert_read_counts(ref, prompts, out.token_ids, STEPS)
    order = routing_profile.expert_order(profile, cfg)
    assert set(order) == set(_routers(ref))
    policy = Placement.from_percent([100, 0, 100, 0, 100, 0], num_gpu_batches=2,
                                 expert_gpu_percent=25, expert_cpu_percent=0)
    with OffloadedLM.load(path=store, policy=policy, progress=False,
                          expert_profile=str(profile)) as lm:
        again = lm.generate(prompts, STEPS, stop_token_id=None, keep_logits=True)
        tier = {expert_of(n): t.segments[0].tier for n, t in lm.engine.weights.items()
                if expert_of(n)}
    fast = round(cfg.num_experts * 0.25)
    for layer, ranked in order.items():
        most = sorted(range(cfg.num_experts), key=lambda e: -counts.get((layer, e), 0))
        assert counts.get((layer, ranked[0]), 0) == counts.get((layer, most[0]), 0)
        assert {tier[(layer, e)] for e in ranked[:fast]} == {DEVICE}
        assert {tier[(layer, e)] for e in ranked[fast:]} == {DISK}
    assert again.token_ids == out.token_ids
    other = dict(QWEN3_30B_A3B)
    from flexgen_infinigen.weights.hf_config import config_from_hf
    routing_profile.save(tmp_path / "other.json", config_from_hf(other, "other"), {})
    with pytest.raises(ConfigError, match="recorded for other"):
        OffloadedLM.load(path=store, policy=policy, progress=False,
                         expert_profile=str(tmp_path / "other.json"))


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
def test_routing_profile_from_the_command_line(family, tmp_path, capsys):
    """`run --record-routing FILE` writes a profile that `run --experts-profile FILE` uses;
    on a dense model --record-routing is one error."""
    import json

    from flexgen_infinigen import run

    _, _, store = family
    profile = tmp_path / "routing.json"
    base = ["--path", str(store), "--prompt-len", "8", "--gen-len", "3", "--no-stop"]
    assert run.main(base + ["--record-routing", str(profile)]) == 0
    data = json.loads(profile.read_text())
    assert set(data["layers"]) == {"0", "2"} and sum(map(sum, data["layers"].values())) > 0
    assert run.main(base + ["--experts-profile", str(profile),
                            "--experts-percent", "25", "0"]) == 0
    assert run.main(["--model", "smollm2-135m", "--dummy", "--prompt-len", "8", "--gen-len",
                     "2", "--record-routing", str(tmp_path / "x.json")]) == 2
    assert "needs a mixture-of-experts model" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
def test_cpu_expert_compute_from_the_command_line(family, tmp_path, capsys):
    """`run --experts-percent 0 100 --cpu-expert-compute` (a CPU standing in for a GPU): the
    report says the experts are computed in CPU memory, and its bytes moved show activations
    going to the host and no more expert bytes than the prompt's fetches."""
    import json

    from flexgen_infinigen import run

    _, _, store = family
    base = ["--path", str(store), "--prompt-len", "8", "--gen-len", "4", "--no-stop",
            "--experts-percent", "0", "100", "--host-in-place", "false"]
    moved = {}
    for flag in ([], ["--cpu-expert-compute"]):
        out = tmp_path / f"report{len(flag)}.json"
        assert run.main(base + flag + ["--json", str(out)]) == 0
        moved[bool(flag)] = json.loads(out.read_text())["bytes_moved"]
    assert "experts in CPU memory computed there" in capsys.readouterr().out
    assert moved[True]["host->device"]["experts"] < moved[False]["host->device"]["experts"]
    assert moved[True]["device->host"]["activations"] > 0 == \
        moved[False]["device->host"]["activations"]
    assert run.main(["--model", "smollm2-135m", "--dummy", "--prompt-len", "8", "--gen-len",
                     "2", "--cpu-expert-compute"]) == 2
    assert "--cpu-expert-compute needs a mixture-of-experts model" in capsys.readouterr().err


def test_refused_by_name(tmp_path):
    """What the runtime does not compute is refused in one line naming it."""
    from flexgen_infinigen.config import ConfigError
    from flexgen_infinigen.weights.hf_config import config_from_hf

    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                num_attention_heads=4, num_key_value_heads=2)
    for kind, words in [("deepseek_v2", "softmax group-limited router")]:
        with pytest.raises(ConfigError, match=words):
            config_from_hf({**base, "model_type": kind}, "x")
    with pytest.raises(ConfigError, match="num_local_experts"):  # experts on a dense type
        config_from_hf({**base, "model_type": "llama", "num_local_experts": 8}, "x")
    with pytest.raises(ConfigError, match="clip_qkv"):
        config_from_hf({**base, "model_type": "olmoe", "num_experts": 4,
                        "num_experts_per_tok": 2, "clip_qkv": 8.0}, "x")
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        config_from_hf({**base, "model_type": "mixtral", "num_local_experts": 2,
                        "num_experts_per_tok": 3}, "x")


EXPERTS_IN_CPU_MEMORY = Placement.from_percent([100, 0, 100, 0, 100, 0], expert_gpu_percent=0,
                                            expert_cpu_percent=100)


@pytest.mark.parametrize("family", ["qwen2_moe"], indirect=True)
@pytest.mark.parametrize("experts", [(0, 100), (0, 0)], ids=["cpu-memory", "disk"])
def test_experts_placed_apart(family, experts):
    """--experts-percent: the routed experts live where it says, everything else where
    --percent says (here on the device: nothing but experts moves); the same output."""
    from flexgen_infinigen.memory.tiers import DEVICE, DISK, HOST

    name, ref, store = family
    policy = Placement.from_percent([100, 0, 100, 0, 100, 0], expert_gpu_percent=experts[0],
                                 expert_cpu_percent=experts[1])
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        out = lm.generate(PROMPTS, STEPS, stop_token_id=None, keep_logits=True)
        where = {n: {s.tier for s in t.segments} for n, t in lm.engine.weights.items()}
        moved = lm.tiers.bytes_moved
    home = HOST if experts[1] else DISK
    for n, tiers in where.items():
        assert tiers == ({home} if ".experts." in n else {DEVICE}), n
    assert moved["host->device"]["weights"] == 0 and moved["host->device"]["experts"] > 0
    assert (moved["disk->host"]["experts"] > 0) == (home == DISK)
    for row, prompt in enumerate(PROMPTS):
        tokens, logits = hf_greedy(ref, prompt, STEPS)
        assert out.token_ids[row] == tokens
        assert (out.logits[row] - logits).abs().max().item() < 1e-4


# the public Qwen3-30B-A3B config.json's shapes
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                     intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)


@pytest.mark.parametrize("family", ["qwen3_moe"], indirect=True)
def test_memory_plan_places_experts_and_refuses_what_cannot_fit(family, monkeypatch):
    """The plan puts the experts' bytes where --experts-percent says (counted from the
    shapes here); on a 24 GiB GPU a Qwen3-30B-A3B fits with its experts in CPU memory and is
    refused with them on the GPU; the loader refuses before any weight is placed."""
    from flexgen_infinigen import api
    from flexgen_infinigen.config import ConfigError
    from flexgen_infinigen.models import family_of
    from flexgen_infinigen.models.moe import is_expert_weight
    from flexgen_infinigen.engine import memory_plan
    from flexgen_infinigen.weights.hf_config import config_from_hf
    from flexgen_infinigen.weights.store import WeightStore

    def bytes_of(cfg, experts: bool, item: int) -> int:
        return sum(math.prod(s) * item for n, s in family_of(cfg).weight_shapes(cfg).items()
                   if is_expert_weight(n) == experts)

    _, _, store = family
    cfg = WeightStore(store).config
    experts, dense = bytes_of(cfg, True, 4), bytes_of(cfg, False, 4)
    need = memory_plan.plan(cfg, EXPERTS_IN_CPU_MEMORY, torch.float32, 16, 8)
    assert need["weights"] == {"device": dense, "host": experts, "disk": 0}

    big = config_from_hf(QWEN3_30B_A3B, "qwen3-30b-a3b")
    assert 55e9 < bytes_of(big, True, 2) < 60e9 and bytes_of(big, False, 2) < 4e9
    gpu, gib = torch.device("cuda"), 1 << 30
    have = {"device": 24 * gib, "host": 128 * gib, "disk": 1 << 40}
    memory_plan.check_fit(memory_plan.plan(big, EXPERTS_IN_CPU_MEMORY, torch.float16, 512,
                                           64), have, gpu)
    with pytest.raises(ConfigError, match="experts-percent"):
        memory_plan.check_fit(memory_plan.plan(big, Placement(), torch.float16, 512, 64), have,
                              gpu)
    # through the loader: refused before placing (this machine's memory made that small)
    monkeypatch.setattr(memory_plan, "available",
                        lambda dev, d: {"device": dense + experts // 2, "host": 0,
                                        "disk": 1 << 40})
    monkeypatch.setattr(api, "place_weights", lambda *a, **k: pytest.fail("placed"))
    with pytest.raises(ConfigError, match="needs"):
        OffloadedLM.load(path=store, policy=Placement(), progress=False)


def test_cpu_plan_counts_expert_codes_as_read():
    """On a CPU, 4-bit experts (a GGUF's Q4_0 codes) in its memory are multiplied where they
    are and those on disk are read as codes: a Qwen3-30B-A3B with a quarter of its experts
    in memory plans one layer's disk experts' codes for a stage (a prefill may route to
    all), not their floats, and nothing for the experts in memory; the experts' bytes per
    tier are whole experts'."""
    from flexgen_infinigen.models import family_of
    from flexgen_infinigen.models.moe import is_expert_weight
    from flexgen_infinigen.engine import memory_plan
    from flexgen_infinigen.memory.codes import CodeLayout, stored_bytes
    from flexgen_infinigen.weights.hf_config import config_from_hf

    big = config_from_hf(QWEN3_30B_A3B, "qwen3-30b-a3b")
    shapes = family_of(big).weight_shapes(big)
    q4 = CodeLayout(4, 32, True)
    layouts = {n: q4 for n in shapes if is_expert_weight(n)}
    one = sum(stored_bytes(shapes[f"layers.0.experts.0.{m}.weight"], 4, True, q4)
              for m in ("gate_proj", "up_proj", "down_proj"))
    cpu = torch.device("cpu")

    def plan(gpu: int, host: int) -> dict:
        policy = Placement.from_percent([100, 0, 100, 0, 100, 0], expert_gpu_percent=gpu,
                                     expert_cpu_percent=host)
        return memory_plan.plan(big, policy, torch.float32, 4096, 32, device=cpu,
                                layouts=layouts)

    quarter = plan(0, 25)
    assert quarter["stage_copies"] == 96 * one  # 128 experts a layer, 32 of them in memory
    assert quarter["experts"] == {"device": 0, "host": 48 * 32 * one, "disk": 48 * 96 * one}
    assert plan(0, 100)["stage_copies"] == plan(100, 0)["stage_copies"] == 0
    floats = 3 * 768 * 2048 * 4 * 128  # a layer's experts as floats: what was planned before
    assert quarter["stage_copies"] < floats / 6


def test_experts_percent_flag():
    import argparse

    from flexgen_infinigen.cli.args import add_policy_args, expert_percent, policy_from_args
    from flexgen_infinigen.config import ConfigError

    p = argparse.ArgumentParser()
    add_policy_args(p)
    policy, _ = policy_from_args(p.parse_args(["--percent", "100", "0", "100", "0", "100", "0",
                                               "--experts-percent", "20", "50"]))
    assert policy.expert_split == (0.2, 0.5, 0.3) and policy.weight_split == (1.0, 0, 0)
    assert policy_from_args(p.parse_args([]))[0].expert_split == (1.0, 0, 0)
    with pytest.raises(ConfigError, match="sum to at most 100"):
        policy_from_args(p.parse_args(["--experts-percent", "60", "50"]))
    # with --percent auto the optimizer keeps the experts' split as given
    assert expert_percent(p.parse_args(["--percent", "auto", "--experts-percent", "0", "100"])) \
        == {"expert_gpu_percent": 0, "expert_cpu_percent": 100}
