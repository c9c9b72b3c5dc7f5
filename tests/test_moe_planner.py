"""The cost model and the placement optimizer on mixture-of-experts models: expert coverage
against random routing, expert bytes against the weight store and the byte ledger, and
placements that put the experts apart or are refused because nothing fits."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError, get_config
from flexgen_infinigen.planner import cost, workload
from flexgen_infinigen.planner.auto import run_command, search
from flexgen_infinigen.planner.hardware import BUILTIN
from flexgen_infinigen.planner.workload import Sizes, Workload, expert_coverage
from flexgen_infinigen.engine import memory_plan
from flexgen_infinigen.memory.tiers import TIERS

EXPERTS_IN_CPU_MEMORY = Placement.from_percent([100, 0, 100, 0, 100, 0], expert_gpu_percent=0,
                                            expert_cpu_percent=100, overlap=False)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """(our store, the checkpoint's expert tensors' bytes): a random Qwen3-MoE of 3 layers
    (layer 1 dense), 8 experts of width 32, top 2, saved by transformers as the Hub does."""
    import transformers
    from safetensors import safe_open

    from flexgen_infinigen.weights.hf_convert import convert_hf

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=3, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # routes far apart
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_()
    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    model.save_pretrained(folder)
    expert_bytes = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            expert_bytes += sum(f.get_tensor(k).nbytes for k in f.keys() if ".experts." in k)
    return convert_hf(folder, folder / "store", "tiny-qwen3-moe", progress=False), expert_bytes


@pytest.mark.parametrize("experts,top_k,tokens", [(16, 2, 1), (16, 2, 5), (64, 8, 8),
                                                   (128, 8, 32), (8, 2, 3)])
def test_coverage_matches_random_routing(experts, top_k, tokens):
    """E(1-(1-k/E)^B) against the distinct experts that B tokens, each routed to k of E
    experts by a softmax top-k of random logits, actually use (mean of many draws)."""
    cfg = dataclasses.replace(get_config("qwen3-30b-a3b"), num_experts=experts,
                              experts_per_token=top_k)
    gen = torch.Generator().manual_seed(experts * 1000 + tokens)
    trials = 4000
    logits = torch.randn(trials, tokens, experts, generator=gen)
    chosen = torch.softmax(logits, -1).topk(top_k, dim=-1).indices.reshape(trials, -1)
    used = torch.zeros(trials, experts).scatter_(1, chosen, 1.0).sum(1)
    se = used.std().item() / math.sqrt(trials)
    assert expert_coverage(cfg, tokens) == pytest.approx(used.mean().item(),
                                                         abs=4 * se + 1e-9)
    assert expert_coverage(cfg, 1) == top_k
    assert expert_coverage(get_config("smollm2-135m"), tokens) == 0


def test_plan_expert_bytes_equal_the_store(tiny_moe):
    """The memory plan's expert bytes per tier and the cost model's per expert equal the
    checkpoint's expert tensors and, kept in 4 bits, what the loaded experts hold."""
    store, checkpoint_bytes = tiny_moe
    with OffloadedLM.load(path=store, policy=EXPERTS_IN_CPU_MEMORY, progress=False) as lm:
        cfg = lm.cfg
    need = memory_plan.plan(cfg, EXPERTS_IN_CPU_MEMORY, torch.float32, 16, 8)
    assert need["experts"] == {"device": 0, "host": checkpoint_bytes, "disk": 0}
    assert need["weights"]["host"] == checkpoint_bytes  # nothing else is in CPU memory
    work = Workload(cfg, 16, 8, dtype_bytes=4)
    sz = Sizes.of(work, EXPERTS_IN_CPU_MEMORY)
    assert sz.moe_layers == 2
    assert sz.moe_layers * cfg.num_experts * sz.expert_bytes == checkpoint_bytes

    packed = dataclasses.replace(EXPERTS_IN_CPU_MEMORY, expert_gpu_percent=50,
                                 expert_cpu_percent=25, compress_weight=True)
    with OffloadedLM.load(path=store, policy=packed, progress=False) as lm:
        held = {t: 0 for t in TIERS}
        for name, tensor in lm.engine.weights.items():
            if ".experts." in name:
                for t, n in tensor.bytes_by_tier().items():
                    held[t] += n
    plan = memory_plan.plan(cfg, packed, torch.float32, 16, 8)
    assert plan["experts"] == held
    assert sum(held.values()) == sz.moe_layers * cfg.num_experts * Sizes.of(
        work, packed).expert_bytes < checkpoint_bytes


def test_predicted_expert_reads_equal_the_ledger(tiny_moe):
    """At batch 1 a decode step reads exactly k experts per MoE layer: the cost model's
    host->device expert bytes for the decode steps (a unit-rate link: seconds are bytes)
    equal what the runtime's ledger counted for them."""
    from test_planner import unit_profile

    store, _ = tiny_moe
    prompt = [1, 7, 9, 33, 41, 5, 90, 17]
    moved = {}
    for gen in (1, 6):
        with OffloadedLM.load(path=store, policy=EXPERTS_IN_CPU_MEMORY, progress=False) as lm:
            lm.generate([prompt], gen, stop_token_id=None)
            moved[gen] = lm.tiers.bytes_moved["host->device"]["experts"]
            cfg = lm.cfg
    work = Workload(cfg, len(prompt), 6, dtype_bytes=4)
    x = workload.fractions(EXPERTS_IN_CPU_MEMORY)
    step = cost.decode_terms(work, EXPERTS_IN_CPU_MEMORY, unit_profile(), x, len(prompt))
    assert x["wg"] == 1 and x["ec"] == 1
    assert 5 * step["h2d"] == pytest.approx(moved[6] - moved[1], rel=1e-9)
    assert step["h2d"] > 0


QWEN3 = get_config("qwen3-30b-a3b")


def test_optimizer_places_experts_apart_and_plans_their_bytes():
    """Qwen3-30B-A3B on a 24 GB GPU: all on the GPU does not fit; the optimizer keeps it on
    the GPU only in part and puts the experts' remainder in CPU memory, prices the experts
    a step reads by coverage (k per layer at batch 1, the union of a block of GPU batches),
    and writes --experts-percent into the command."""
    hw = BUILTIN["a6000-pcie3"].with_memory(gpu_gb=24, cpu_gb=200)
    work = Workload(QWEN3, 512, 16)
    assert not cost.predict(work, Placement(), hw)["fits"]
    best, plans = search(QWEN3, 512, 16, hw, Placement(), gpu_batch_size=1, num_gpu_batches=1,
                         progress=False)
    pred = best.prediction
    assert pred["fits"] and pred["memory_bytes"]["device"] <= hw.gpu_mem
    assert best.experts_percent() is not None and best.experts_percent()[0] < 100
    sz = Sizes.of(work, best.policy)
    assert pred["experts"]["bytes_per_step"] == pytest.approx(48 * 8 * sz.expert_bytes)
    assert "--experts-percent" in run_command(best, "qwen3-30b-a3b", 512, 16, "full")
    given = Placement(expert_gpu_percent=0, expert_cpu_percent=100)  # --experts-percent 0 100
    kept, _ = search(QWEN3, 512, 16, hw, given, gpu_batch_size=1, num_gpu_batches=1,
                     progress=False)
    assert kept.experts_percent() == [0, 100] and kept.prediction["fits"]
    block = Placement.from_percent([100, 0, 100, 0, 100, 0], gpu_batch_size=4, num_gpu_batches=3,
                                expert_gpu_percent=0, expert_cpu_percent=100)
    e = cost.predict(work, block, hw)["experts"]
    assert e["coverage_per_step"] == pytest.approx(128 * (1 - (1 - 8 / 128) ** 12))
    assert e["off_device_bytes_per_step"] == pytest.approx(48 * e["coverage_per_step"]
                                                           * sz.expert_bytes)


def test_expert_bytes_count_toward_what_cannot_fit():
    """A machine whose memory and disk hold the dense parts but not the experts: refused
    before any search, with the memory that would fit."""
    hw = BUILTIN["a6000-pcie3"].with_memory(gpu_gb=8, cpu_gb=20, disk_gb=10)
    with pytest.raises(ConfigError, match="does not fit"):
        search(QWEN3, 512, 16, hw, Placement(), gpu_batch_size=1, num_gpu_batches=1,
               progress=False)
    assert cost.predict(Workload(QWEN3, 512, 16), Placement.from_percent(
        [100, 0, 100, 0, 100, 0], expert_gpu_percent=0, expert_cpu_percent=0),
        BUILTIN["a6000-pcie3"].with_memory(disk_gb=70))["fits"]


def test_cpu_expert_compute_priced_against_fetching():
    """Experts in CPU memory on a GPU machine: multiplying them there
    (``--cpu-expert-compute``) costs the CPU's products plus the block's rows crossing, and
    saves fetching them. At one token the CPU reads each routed expert once, faster than the
    link brings it; at a block of thousands of tokens the CPU's flops cost more than
    fetching every expert once. The optimizer takes the flag where it predicts the step
    faster, and writes it into the command."""
    hw = BUILTIN["a6000-pcie3"].with_memory(gpu_gb=24, cpu_gb=200)
    work = Workload(QWEN3, 512, 16)

    def experts_s(tokens: int, on: bool) -> float:
        policy = dataclasses.replace(EXPERTS_IN_CPU_MEMORY, cpu_expert_compute=on)
        terms = cost.expert_terms(work, policy, hw, cost.fractions(policy), tokens,
                                  decode=True)
        return sum(terms.values())

    assert experts_s(1, True) < experts_s(1, False) / 2
    assert experts_s(4096, True) > experts_s(4096, False)
    on = dataclasses.replace(EXPERTS_IN_CPU_MEMORY, cpu_expert_compute=True)
    assert (cost.predict(work, on, hw)["decode_step_s"]
            < cost.predict(work, EXPERTS_IN_CPU_MEMORY, hw)["decode_step_s"])
    given = Placement(expert_gpu_percent=0, expert_cpu_percent=100)
    best, _ = search(QWEN3, 512, 16, hw, given, gpu_batch_size=1, num_gpu_batches=1,
                     progress=False)
    assert best.policy.cpu_expert_compute
    assert "--cpu-expert-compute" in run_command(best, "qwen3-30b-a3b", 512, 16, "full")
