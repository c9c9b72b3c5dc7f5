"""What the first GPU run must confirm beyond the schedules (skipped without a GPU): a GQA
Llama against transformers in fp32 and bf16, InfiniGen keeping everything equal to the full
cache with the rows read from pinned host memory by the device, the GPU's selections agreeing
with the CPU's, and the mapped row read itself."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import hf_greedy

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.kv import InfiniGenOptions

pytestmark = pytest.mark.cuda

PROMPT = [2, 5, 17, 99, 45, 8, 200, 31, 7, 300]
STEPS = 12
CACHE_ON_CPU = [100, 0, 0, 100, 100, 0]


@pytest.mark.parametrize("percent", [[100, 0, 100, 0, 100, 0], CACHE_ON_CPU,
                                     [0, 100, 0, 100, 100, 0]])
def test_llama_gqa_matches_transformers_fp32(tiny_llama, percent):
    model, store = tiny_llama
    ref_tokens, ref_logits = hf_greedy(model, PROMPT, STEPS)
    with OffloadedLM.load(path=store, device="cuda", dtype="float32",
                          policy=Placement.from_percent(percent), progress=False) as lm:
        out = lm.generate([PROMPT], STEPS, stop_token_id=None, keep_logits=True)
    assert out.token_ids[0] == ref_tokens
    assert (out.logits[0] - ref_logits).abs().max().item() < 1e-3  # TF32 may be on


def test_llama_gqa_matches_transformers_bf16(tiny_llama):
    """bf16 against transformers' own bf16 on the same GPU, teacher-forced on its tokens (a
    rounding difference may flip a greedy token later): every step's logits close."""
    model, store = tiny_llama
    ref_tokens, _ = hf_greedy(model.float().cpu(), PROMPT, STEPS)
    hf = model.to("cuda", torch.bfloat16)  # in place: the same module, now on the GPU
    try:
        with torch.no_grad():
            ref = hf(torch.tensor([PROMPT + ref_tokens[:-1]], device="cuda")).logits[0].float()
    finally:
        model.float().cpu()
    ref = ref[len(PROMPT) - 1:]
    with OffloadedLM.load(path=store, device="cuda", dtype="bfloat16",
                          policy=Placement.from_percent(CACHE_ON_CPU), progress=False) as lm:
        out = lm.generate([PROMPT], STEPS, stop_token_id=None, keep_logits=True,
                          forced=[ref_tokens])
    scale = ref.abs().max().item()
    assert (out.logits[0].cpu() - ref.cpu()).abs().max().item() < 0.05 * scale


@pytest.mark.parametrize("family", ["tiny_opt", "tiny_llama"])
@pytest.mark.parametrize("overlap", [True, False])
def test_infinigen_keeping_everything_equals_full_with_mapped_rows(request, family, overlap):
    _, store = request.getfixturevalue(family)
    policy = Placement.from_percent(CACHE_ON_CPU, overlap=overlap, gpu_batch_size=2)
    prompts = [PROMPT * 3, PROMPT[:5] * 2]
    outs = []
    for kv, opts in (("full", None), ("infinigen", {"options": InfiniGenOptions(
            alpha=math.inf, max_kv_fraction=1.0, first_layer=1, select_from_mb=0.0)})):
        with OffloadedLM.load(path=store, device="cuda", dtype="float32", policy=policy,
                              kv_policy=kv, kv_options=opts, progress=False) as lm:
            if kv == "infinigen":
                assert lm.tiers.maps_host, "the mapped row read is not available"
            outs.append(lm.generate(prompts, STEPS, stop_token_id=None, keep_logits=True))
            if kv == "infinigen":
                assert lm.tiers.maps_host, "the mapped row read was turned off"
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logits, outs[1].logits):
        assert (a - b).abs().max().item() < 1e-3


def test_gpu_and_cpu_selections_agree(tiny_llama, monkeypatch):
    """The same prompts in fp32 on the GPU and on the CPU: the rows each selecting layer
    chooses overlap almost wholly (ties and TF32 rounding may swap a few)."""
    from flexgen_infinigen.kv.infinigen import cache as infinigen_cache
    _, store = tiny_llama
    real = infinigen_cache.InfiniGenCache._rank
    chosen: dict[str, list] = {}

    def recording(self, *args, **kwargs):
        order, counts = real(self, *args, **kwargs)
        sets = [set(order[b, h, :int(counts[b, h])].tolist())
                for b in range(order.shape[0]) for h in range(order.shape[1])]
        chosen[self.spec.tiers.device.type].append(sets)
        return order, counts

    monkeypatch.setattr(infinigen_cache.InfiniGenCache, "_rank", recording)
    # the rehearsal's query on both (a CPU reading its cache in place would pick each
    # layer's own query in attention, which never ranks ahead)
    opts = {"options": InfiniGenOptions(max_kv_fraction=0.3, min_num_kv=4, first_layer=1,
                                        select_from_mb=0.0, speculation_query="input")}
    for device in ("cuda", "cpu"):
        chosen[device] = []
        with OffloadedLM.load(path=store, device=device, dtype="float32",
                              policy=Placement.from_percent(CACHE_ON_CPU), kv_policy="infinigen",
                              kv_options=opts, progress=False) as lm:
            lm.generate([PROMPT * 4], STEPS, stop_token_id=None)
    assert len(chosen["cuda"]) == len(chosen["cpu"]) > 0
    same = total = 0
    for g, c in zip(chosen["cuda"], chosen["cpu"]):
        for a, b in zip(g, c):
            same, total = same + len(a & b), total + max(len(a), len(b))
    assert same / total > 0.95


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_mapped_row_read_from_pinned_memory(dtype):
    """The Triton kernel reads rows of a pinned host tensor by device indices; rows past a
    column's count are zeros."""
    from flexgen_infinigen.memory import mapped_rows
    assert mapped_rows.kernel_available()
    src = torch.randn(1000, 128).to(dtype).pin_memory()
    cols, n = 4, 6
    index = torch.randint(0, 1000, (n * cols,), device="cuda")
    counts = torch.tensor([6, 3, 0, 5], device="cuda")
    out = torch.full((n * cols, 128), 7.0, dtype=dtype, device="cuda")
    mapped_rows.gather(src, index, counts, cols, out)
    expect = src[index.cpu()].cuda()
    keep = (torch.arange(n * cols, device="cuda") // cols) < counts.repeat(n)
    assert torch.equal(out[keep], expect[keep])
    assert (out[~keep] == 0).all()
