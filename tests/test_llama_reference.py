"""SmolLM2-135M (real weights, GQA) equals transformers' LlamaForCausalLM on the same weights."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import hf_greedy

from flexgen_infinigen import OffloadedLM, Placement

STEPS = 32
TEXTS = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived"]

POLICIES = {
    "all-on-device": Placement(),
    "weights-split-cache-on-disk": Placement.from_percent([30, 40, 0, 0, 100, 0]),
    "cpu-cache-compute-fused-layers": Placement.from_percent(
        [0, 100, 0, 100, 100, 0], cpu_cache_compute=True, sep_layer=False, overlap=False),
    "mixed-three-batches": Placement.from_percent([50, 50, 30, 40, 100, 0], num_gpu_batches=3),
}
# the overlapped loop is off by default on a CPU-only machine: ask for it where not said
POLICIES = {k: p if p.overlap is not None else dataclasses.replace(p, overlap=True)
            for k, p in POLICIES.items()}


@pytest.fixture(scope="module")
def prompts(smollm2_codes_store):
    from flexgen_infinigen.config import get_config
    from flexgen_infinigen.text.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_codes_store, get_config("smollm2-135m"))
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def references(smollm2_hf, prompts):
    return [hf_greedy(smollm2_hf, p, STEPS) for p in prompts]


@pytest.mark.parametrize("name", list(POLICIES))
def test_matches_transformers(smollm2_codes_store, prompts, references, name, monkeypatch):
    """The file's codes as a GPU takes them (FLEXGEN_INFINIGEN_GGUF_BLOCKS=0: group codes,
    multiplied with a 16-bit input), on a CPU, in every placement."""
    monkeypatch.setenv("FLEXGEN_INFINIGEN_GGUF_BLOCKS", "0")
    with OffloadedLM.load(path=smollm2_codes_store, policy=POLICIES[name], progress=False) as lm:
        out = lm.generate(prompts, STEPS, stop_token_id=None, keep_logits=True)
    for row, (ref_tokens, ref_logits) in enumerate(references):
        assert out.token_ids[row] == ref_tokens
        # the store holds the GGUF's Q4_1/Q8_0 codes and the reference gguf's dequantized
        # floats: where the codes are multiplied in place (all on the device) the 4-bit
        # kernel rounds x to 16 bits per 64 values, ~1e-3 of the logits' scale after 30
        # layers; elsewhere they are expanded exactly and only fp32 order differs
        scale = ref_logits.abs().max().item()
        assert (out.logits[row] - ref_logits).abs().max().item() < 2e-3 * scale


def test_continuation_is_text(smollm2_codes_store):
    with OffloadedLM.load(path=smollm2_codes_store, progress=False) as lm:
        out = lm.generate(["The capital of France is"], 8)
    assert "Paris" in out.texts[0]


PARAGRAPH = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
             "France. It is named after the engineer Gustave Eiffel, whose company designed "
             "and built the tower from 1887 to 1889. Locally nicknamed the Iron Lady, it was "
             "constructed as the centerpiece of the 1889 World's Fair, and to crown the "
             "centennial anniversary of the French Revolution.")


def test_blocks_follow_transformers_on_a_real_text(smollm2_codes_store, smollm2_hf):
    """The default: the file's blocks, each matrix's input rounded to 8-bit blocks of 32
    (as llama.cpp computes them). On real text, teacher-forced, the next-token predictions
    stay transformers' (float inputs, the same weight values) at nearly every position and
    the text's log-likelihood moves by little; SmolLM2's activation outliers make the
    rounding's effect larger here than on most models (tests/test_gguf_codes.py checks the
    rounding itself exactly, on a tiny model)."""
    import torch

    from flexgen_infinigen.evals.metrics import teacher_forced_nll
    from flexgen_infinigen.text.tokenizer import load_tokenizer

    ids = load_tokenizer(smollm2_codes_store).encode(PARAGRAPH)
    prefix, rest = ids[:8], ids[8:]
    with OffloadedLM.load(path=smollm2_codes_store, progress=False) as lm:
        assert {lay.kind for lay in lm.weight_layouts.values()} == {"Q4_1", "Q8_0"}
        out = lm.generate([prefix], len(rest), stop_token_id=None, keep_logits=True,
                          forced=[rest])
        ours = teacher_forced_nll(lm, [prefix], [rest])[0]
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([ids])).logits[0, len(prefix) - 1:-1].float()
    theirs = -torch.log_softmax(ref, -1)[torch.arange(len(rest)), torch.tensor(rest)]
    agree = (out.logits[0].argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9  # measured 79 of 81
    assert abs(ours.mean().item() - theirs.mean().item()) < 0.05  # nats a token; measured 0.017
    # each position's logits within a tenth of their scale (measured at most 0.05)
    assert ((out.logits[0] - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item() < 0.1
