"""The KV cache's exact-pinned host memory is registered once per load, not per generation:
a freed block stays registered for the next buffer of its size, and close() unregisters it
(checked on the CPU with a stand-in for CUDA's registration calls)."""
from __future__ import annotations

import gc

import torch

from flexgen_infinigen.memory import tiers as tiers_module
from flexgen_infinigen.memory.tiers import EXACT_PIN_BYTES, Tiers


class FakeCudart:
    def __init__(self):
        self.registered: dict[int, int] = {}
        self.calls = 0

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's names)
        assert ptr not in self.registered
        self.registered[ptr] = size
        self.calls += 1
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        del self.registered[ptr]
        return 0


def test_a_freed_block_is_kept_registered_for_the_next_buffer_of_its_size(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(tiers_module.torch.cuda, "cudart", lambda: fake)
    tiers = Tiers("cpu")
    tiers.pin_host = True  # as on a GPU machine
    shape = (EXACT_PIN_BYTES // 4 + 5,)
    for generation in range(3):  # a KV cache per generation, the same shapes
        kv = tiers.host_empty(shape, torch.float32)
        kv.fill_(generation)
        assert tiers.pinned_bytes >= kv.numel() * 4
        del kv
        gc.collect()
        assert tiers.pinned_bytes == 0  # freed: not counted as held
    assert fake.calls == 1 and len(fake.registered) == 1
    other = tiers.host_empty((EXACT_PIN_BYTES,), torch.uint8)  # another size: a miss
    assert fake.calls == 2 and len(fake.registered) == 1  # the kept block let go
    del other
    gc.collect()
    tiers.close()
    assert not fake.registered
