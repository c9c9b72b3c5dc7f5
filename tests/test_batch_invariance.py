"""At temperature 0 a prompt answers in a block what it answers alone, to the last bit.

The default model multiplies 8-bit activations with its GGUF codes, so a difference in the
last bit of one float upstream (a sum taken in another order because a row was left-padded,
or because more rows shared the threads) rounds some activation to the next code and can
turn into another token. The reference is each prompt's own run, batch 1, no padding: the
logits of every step of every row of a block of prompts of mixed lengths (left padding from
0 to over a thousand tokens, and a history longer than one range of the attention kernel's
work split) must equal it exactly."""
from __future__ import annotations

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement

PROMPTS = ["Tell me a long story about a lighthouse keeper. " * 110,  # ~1100 tokens
           "Explain in detail how bread rises. " * 12, "Water boils at", "In 1969, the first",
           "The three primary colours are red,", "Once upon a time there was a small dragon"]
STEPS = 6


@pytest.mark.parametrize("kv", ["full", "infinigen"])
def test_every_row_of_a_block_equals_its_prompt_alone(smollm2_codes_store, kv):
    """(InfiniGen reads far fewer rows than one range: it takes the shorter prompts.)"""
    prompts = PROMPTS if kv == "full" else PROMPTS[1:]
    with OffloadedLM.load(path=smollm2_codes_store, kv_policy=kv, progress=False,
                          policy=Placement(gpu_batch_size=len(prompts))) as lm:
        ids = lm.encode(prompts)
        assert min(map(len, ids)) < 8
        assert kv != "full" or max(map(len, ids)) > 1024 + STEPS
        block = lm.generate(ids, STEPS, keep_logits=True, stop_token_id=None)
        for i, prompt in enumerate(ids):
            alone = lm.generate([prompt], STEPS, keep_logits=True, stop_token_id=None)
            assert block.token_ids[i] == alone.token_ids[0], i
            diff = (block.logits[i] - alone.logits[0]).abs().max().item()
            assert torch.equal(block.logits[i], alone.logits[0]), (i, len(prompt), diff)
