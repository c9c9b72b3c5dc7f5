"""On a GPU every torch op of a decode step is a kernel launch: InfiniGen's step (speculation,
selection, the row read, attention over the rows) issues at most 1.5x the full cache's ops.
Counted with a dispatch-mode counter on the CPU torch path a GPU takes (the C kernels off, the
KV cache in host memory reached as over a link: ``--host-in-place false``)."""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.kernels import cpu_kernels

MAX_RATIO = 1.5


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def gqa_store(tmp_path_factory):
    """A Llama with grouped-query attention and enough layers that the two first ones (which
    read the whole cache by default) weigh about as little as in a real model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flexgen_infinigen.weights.hf_convert import convert_hf

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, num_hidden_layers=12, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    folder = tmp_path_factory.mktemp("gqa-12")
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    return convert_hf(folder, folder / "store", "gqa-12")


def _ops_per_step(store, kv: str) -> collections.Counter:
    """The ops of one decode step: a generation with one more step, minus one without."""
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], host_in_place=False)
    options = ({"max_kv_fraction": 0.2, "min_num_kv": 4, "select_from_mb": 0.0}
               if kv == "infinigen" else None)
    prompts = [list(range(3, 300))]  # batch 1: the long-context case
    with OffloadedLM.load(path=store, policy=policy, kv_policy=kv, kv_options=options,
                          progress=False) as lm:
        counts = []
        for steps in (2, 3):
            with OpCounter() as counter:
                lm.generate(prompts, steps, stop_token_id=None)
            counts.append(counter.ops)
    return counts[1] - counts[0]


def test_infinigen_decode_ops_within_1_5x_full(gqa_store, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_lib", None)  # the C kernels off (as on a GPU)
    monkeypatch.setattr(cpu_kernels, "_tried", True)
    full = _ops_per_step(gqa_store, "full")
    infinigen = _ops_per_step(gqa_store, "infinigen")
    n_full, n_inf = sum(full.values()), sum(infinigen.values())
    assert n_full > 100  # the counter sees the step
    extra = (infinigen - full).most_common(12)
    assert n_inf <= MAX_RATIO * n_full, f"{n_inf} ops against {n_full}: most added {extra}"
