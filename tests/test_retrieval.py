"""Retrieval: a number hidden in filler text, several prompts of different lengths in one batch.

The full cache's greedy answer is the reference: InfiniGen (defaults: 20% of the cached
tokens per KV head in the selecting layers) and the oracle must give the same tokens, and the
full cache must find the number (otherwise the test would prove nothing).
"""
from __future__ import annotations

import pytest

from flexgen_infinigen import OffloadedLM, Placement

FILLER = ("The hills were quiet and the river ran slowly past the mill. Nothing much happened "
          "in the village that day. ")
KEYS = ["48213", "90567", "31874"]
REPEATS = [24, 40, 62]  # about 550 to 1,400 tokens per prompt


def _prompt(key: str, repeats: int, where: float) -> str:
    before = int(repeats * where)
    return ("Read the text and remember the secret number in it.\n"
            + FILLER * before + f"The secret number is {key}. Remember it: {key}.\n"
            + FILLER * (repeats - before)
            + "\nQuestion: what is the secret number? Answer: The secret number is")


def _answers(store, kv_policy: str, prompts: list[str], steps: int):
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=len(prompts))
    with OffloadedLM.load(path=store, policy=policy, kv_policy=kv_policy,
                          progress=False) as lm:
        ids = [lm.tokenizer.encode(p) for p in prompts]
        out = lm.generate(ids, steps, stop_token_id=None)
        return out.token_ids, [lm.tokenizer.decode(t) for t in out.token_ids], \
            [len(i) for i in ids]


@pytest.mark.slow
def test_infinigen_retrieves_what_the_full_cache_retrieves(smollm2_store):
    prompts = [_prompt(k, r, w) for k, r, w in zip(KEYS, REPEATS, (0.2, 0.5, 0.8))]
    full_ids, full_text, lengths = _answers(smollm2_store, "full", prompts, 7)
    assert min(lengths) >= 500 and max(lengths) <= 1500
    found = [k in t for k, t in zip(KEYS, full_text)]
    assert sum(found) >= 2, f"the full cache itself does not retrieve: {full_text}"
    for kv in ("infinigen", "oracle"):
        ids, text, _ = _answers(smollm2_store, kv, prompts, 7)
        for row, ok in enumerate(found):
            if ok:
                assert KEYS[row] in text[row], (kv, text[row], full_text[row])
