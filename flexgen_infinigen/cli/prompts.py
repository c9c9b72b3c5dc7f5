"""The prompts a run feeds: the user's texts through the model's chat template, or
synthesized prompts of a given length for throughput runs."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

from ..config import ConfigError

if TYPE_CHECKING:
    from ..api import OffloadedLM

# Used to synthesize prompts of --prompt-len tokens when none are given.
FILLER_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. From the "
    "lantern room he could see the whole bay: the fishing boats coming home, the gulls "
    "circling the harbour, and the long line of hills that turned purple as the sun went "
    "down. He kept a notebook in which he wrote the weather, the ships that passed, and "
    "anything else that seemed worth remembering. Over forty years the notebooks had filled "
    "three shelves of the small kitchen below. One winter night, when the storm was so loud "
    "that he could not hear the kettle, he opened the first notebook again and began to read. "
)


def synthesize_prompts(lm: OffloadedLM, prompt_len: int, count: int, seed: int):
    """``count`` prompts of ``prompt_len`` tokens: the filler text repeated, or seeded random
    ids when there is no tokenizer (or its vocabulary spells none of the filler)."""
    ids = lm.tokenizer.encode(FILLER_TEXT) if lm.tokenizer is not None else []
    if ids:
        ids = (ids * (prompt_len // len(ids) + 1))[:prompt_len]
        return [ids] * count
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, lm.cfg.vocab_size, (count, prompt_len), generator=gen).tolist()


def chat_prompts(lm: OffloadedLM, a, texts: list[str]):
    """Token ids of each text (or of an example question when none is given and no synthetic
    prompts were asked for) in the model's chat template; None when not chatting."""
    from ..text.chat import DEFAULT_QUESTION, chat_prompt_ids, chat_template

    template = chat_template(lm.store_path, getattr(a, "chat_template", None))
    if a.chat and (template is None or lm.tokenizer is None):
        raise ConfigError("--chat: this model has no chat template (or no tokenizer); drop "
                          "--chat to continue the prompt as plain text")
    if a.chat is False or template is None or lm.tokenizer is None:
        return None
    if not texts:
        if a.synthesize:
            return None
        texts = [DEFAULT_QUESTION]
        print(f"no --prompt given: asking the model {DEFAULT_QUESTION!r} (pass --prompt, or "
              "--prompt-len for synthesized throughput prompts)", file=sys.stderr)
    return [chat_prompt_ids(lm.tokenizer, template, [{"role": "user", "content": t}])
            for t in texts]


def make_prompts(lm, a, texts: list[str]) -> list[list[int]]:
    """Token ids of the run's prompts: the texts (through the chat template when the model
    has one), or synthesized prompts of ``--prompt-len`` tokens."""
    prompts = chat_prompts(lm, a, texts)
    if prompts is None and texts:
        prompts = lm.encode(texts)
    elif prompts is None:
        policy = lm.policy
        count = a.num_prompts or policy.block_size
        prompts = synthesize_prompts(lm, a.prompt_len, count, a.seed)
        print(f"running {count} synthesized prompts of {a.prompt_len} tokens (one block "
              f"of {policy.gpu_batch_size} x {policy.num_gpu_batches}; --num-prompts "
              "sets the count)", file=sys.stderr)
    return prompts
