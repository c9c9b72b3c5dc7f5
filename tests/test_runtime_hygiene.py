"""CPU-visible parts of the CUDA path's fixes: no hang on errors, host syncs per decode step,
reused activation buffers, the device memory plan against real allocations, fp16 range."""
from __future__ import annotations

import math
import os
import threading

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.engine import memory_plan
from flexgen_infinigen.kernels.attention import attend, attend_rows

PROMPTS = [[2, 5, 17, 99, 45, 8, 200, 31, 7, 300, 12, 40] * 3, [9, 8, 7, 6, 5, 4, 3] * 4]
STEPS = 6
CACHE_ON_HOST = [100, 0, 0, 100, 100, 0]


def _load(store, percent=CACHE_ON_HOST, kv="full", kv_options=None, **policy):
    policy.setdefault("overlap", True)
    return OffloadedLM.load(path=store, dtype="float32", kv_policy=kv, kv_options=kv_options,
                            policy=Placement.from_percent(percent, **policy), progress=False)


class _Patched:
    """A model family with some functions replaced."""

    def __init__(self, family, **replace):
        self._family, self._replace = family, replace

    def __getattr__(self, name):
        return self._replace.get(name, getattr(self._family, name))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kv", ["infinigen", "h2o", "full"])
def test_an_error_mid_decode_surfaces_quickly(tiny_llama, kv, fused, monkeypatch):
    """InfiniGen's load lane waits for a speculation: when compute fails it must not wait
    (it used to wait 600 s); the error itself reaches the caller, from the per-operation
    path's MLP or from the fused decode call."""
    from flexgen_infinigen.engine import stage_plan as fused_decode
    from flexgen_infinigen.kernels.layer_call import LayerCall

    monkeypatch.setenv(fused_decode.ENV, "1" if fused else "0")
    _, store = tiny_llama
    lm = _load(store, kv=kv)
    family, calls = lm.engine.family, {"n": 0}
    if fused and lm.engine.fused is None:
        pytest.skip("no C compiler: no fused decode call")

    def failing_mlp(cfg, w, h):
        calls["n"] += 1
        if calls["n"] > lm.cfg.num_layers + 1:  # in the first decode step, after speculation
            raise MemoryError("simulated out of memory")
        return family.mlp(cfg, w, h)

    real_call = LayerCall.run

    def failing_call(self, mode):  # the fused path's first decode step
        raise MemoryError("simulated out of memory")

    monkeypatch.setattr(LayerCall, "run", failing_call if fused else real_call)
    lm.engine.family = _Patched(family, mlp=failing_mlp)
    outcome = {}

    def run():
        try:
            lm.generate([PROMPTS[0]], STEPS, stop_token_id=None)
        except MemoryError as e:
            outcome["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "generation hung after an error in compute"
    assert "simulated" in str(outcome.get("error"))
    lm.engine.family = family  # the engine still works afterwards
    monkeypatch.setattr(LayerCall, "run", real_call)
    assert len(lm.generate([PROMPTS[0]], 2, stop_token_id=None).token_ids[0]) == 2
    lm.close()


@pytest.mark.parametrize("kv,percent,batches,per_layer", [
    ("full", CACHE_ON_HOST, 2, 0),
    ("infinigen", CACHE_ON_HOST, 2, 0),  # rows read by the device by index: no wait
    ("infinigen-host-gather", CACHE_ON_HOST, 2, 1),  # one wait for the selection's indices
    ("infinigen", [100, 0, 100, 0, 100, 0], 1, 0),  # cache on the device: gathered there
    ("h2o", CACHE_ON_HOST, 2, 1),  # one read of the kept-token mask
    ("h2o", [100, 0, 100, 0, 100, 0], 1, 0),
])
def test_host_syncs_per_decode_step(tiny_llama, kv, percent, batches, per_layer, monkeypatch):
    """The engine counts every read of device values by the host; a decode step makes one per
    GPU batch for sampling plus ``per_layer`` per selecting layer and batch (none in the KV
    pool's eviction)."""
    _, store = tiny_llama
    if kv == "infinigen-host-gather":  # the fallback: rows gathered on the host
        from flexgen_infinigen.memory import mapped_rows
        monkeypatch.setenv(mapped_rows.ENV, "0")
        kv = "infinigen"
    opts = {"kv_pool_capacity": 0.5} if kv == "infinigen" else None
    prompts = PROMPTS * batches
    # the cache "on the host" copied over a link, as with a GPU
    with _load(store, percent, kv, opts, gpu_batch_size=2, num_gpu_batches=batches,
               host_in_place=False) as lm:
        lm.generate(prompts, STEPS, stop_token_id=None)
        syncs = lm.engine.debug["host_syncs_per_step"]
        layers = lm.cfg.num_layers - (2 if kv == "infinigen" else 0)
    assert len(syncs) == STEPS
    assert syncs[1:] == [batches * (1 + per_layer * layers)] * (STEPS - 1)


def test_offloaded_activations_reuse_one_buffer_per_batch_and_shape(tiny_opt, tmp_path):
    """Hidden states on disk: one file per (GPU batch, shape), not one per stage and step;
    outputs equal the run that keeps them on the device."""
    _, store = tiny_opt
    outs = []
    for percent in ([100, 0, 100, 0, 100, 0], [100, 0, 100, 0, 0, 0]):
        policy = Placement.from_percent(percent, gpu_batch_size=2, num_gpu_batches=2)
        with OffloadedLM.load(path=store, dtype="float32", policy=policy, progress=False,
                              offload_dir=str(tmp_path)) as lm:
            outs.append(lm.generate(PROMPTS * 2, STEPS, stop_token_id=None, keep_logits=True))
            created = lm.tiers.disk.created
            left = [f for f in (os.listdir(lm.tiers.disk_dir) if lm.tiers._disk_dir else [])
                    if f.endswith(".bin")]  # the tensors (beside them: the owner's pid)
            moved = lm.tiers.bytes_moved["host->disk"]["activations"]
    assert created == 2 * 2  # 2 GPU batches x (prefill shape, decode shape)
    assert left == []  # and each file was removed when the block let its buffer go
    assert moved > 0
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].logits, outs[1].logits):
        assert torch.equal(a, b)


def _cache_tensors(lm, batch_size: int, max_len: int):
    engine = lm.engine
    engine.states = [None] * lm.policy.num_gpu_batches
    engine._make_caches(batch_size, max_len)
    caches = list(engine.caches.values())
    engine.caches.clear()
    return caches


def _bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("fixture", ["tiny_opt", "tiny_llama"])
def test_device_plan_counts_what_infinigen_allocates(fixture, request):
    _, store = request.getfixturevalue(fixture)
    b, prompt, gen = 2, 40, 8
    opts = {"kv_pool_capacity": 0.5, "speculation_keys": "partial"}
    with _load(store, [100, 0, 0, 100, 100, 0], "infinigen", opts, gpu_batch_size=b,
               num_gpu_batches=2) as lm:
        kv = lm.engine.kv_policy
        terms = memory_plan.plan(lm.cfg, lm.policy, torch.float32, prompt, gen,
                                 kv=kv)["kv_policy_device"]
        caches = _cache_tensors(lm, b, prompt + gen)
        keys = [c.keys for c in caches if c.keys is not None]
        pools = [c.pool for c in caches if c.pool is not None]
        weights = [t for w in kv.rehearsal.weights for t in w.values()]
    assert len(keys) == 2 * (lm.cfg.num_layers - 2)  # layers 0-1 keep no speculation keys
    assert terms["speculation_keys"] == _bytes(*(k.data for k in keys))
    assert terms["speculation_weights"] == _bytes(*weights)
    assert terms["projections"] == _bytes(kv.rehearsal.projections)
    assert terms["kv_pool"] == _bytes(*(t for p in pools for t in (p.alive, p.last_used, p.uses)))


def test_device_plan_counts_the_unpacked_speculation_keys(tiny_llama, monkeypatch):
    """Without the compiled kernel (no C compiler, or a GPU) 4-bit speculation keys are
    scored one code slot at a time, each slot's codes expanded in the runtime dtype; the
    plan's term bounds all slots together at the longest context."""
    from flexgen_infinigen.kv.infinigen import spec_keys

    monkeypatch.setattr(spec_keys, "score_packed", lambda *a: None)  # the torch path
    monkeypatch.setattr(spec_keys, "speculate_mass", lambda *a: None)
    _, store = tiny_llama
    b, prompt, gen = 2, 40, 8
    with _load(store, [100, 0, 0, 100, 100, 0], "infinigen", {"speculation_keys": "int4"},
               gpu_batch_size=b) as lm:
        term = memory_plan.plan(lm.cfg, lm.policy, torch.float32, prompt, gen,
                                kv=lm.engine.kv_policy)["kv_policy_device"]
        out = lm.generate([[1] + list(range(5, 5 + prompt - 1))] * b, gen, stop_token_id=None)
    assert len(out.token_ids[0]) == gen
    cols, width, item = b * lm.cfg.num_kv_heads, lm.cfg.head_dim, 4  # int4: every column
    assert term["speculation_unpacked"] == (prompt + gen) * cols * width * item


def test_plan_of_4bit_weights_on_a_cpu_counts_what_is_expanded(tiny_llama, monkeypatch):
    """On a CPU, 4-bit weights are multiplied where they are stored: the plan counts no stage
    of expanded weights, only the largest matrix a prefill product expands, and InfiniGen's
    rehearsal shares the layer's packed W_Q (no float copy); elsewhere (device unknown, as
    for the optimizer) it still counts two stages and the copy."""
    from flexgen_infinigen.memory.codes import PackedWeight

    _, store = tiny_llama
    b, prompt, gen = 2, 40, 8
    with _load(store, [100, 0, 0, 100, 100, 0], "infinigen",
               {"speculation_query": "input"},  # the rehearsal's W_Q (own has none)
               gpu_batch_size=b, compress_weight=True) as lm:
        cfg, kv = lm.cfg, lm.engine.kv_policy
        cpu, unknown = (memory_plan.plan(cfg, lm.policy, torch.float32, prompt, gen, kv=kv,
                                         device=d) for d in (torch.device("cpu"), None))
        shared = [w["q_proj.weight"] for w in kv.rehearsal.weights if w]
        layer_q = [lm.engine.weights[f"layers.{i}.q_proj.weight"].read_for_compute()
                   for i in range(2, cfg.num_layers)]
    assert len(shared) == cfg.num_layers - 2
    assert all(isinstance(w, PackedWeight) for w in shared)
    assert all(a.packed.codes.data_ptr() == q.packed.codes.data_ptr()
               for a, q in zip(shared, layer_q))
    assert cpu["kv_policy_device"]["speculation_weights"] == 0  # no q bias in Llama
    assert unknown["kv_policy_device"]["speculation_weights"] == \
        (cfg.num_layers - 2) * cfg.q_dim * cfg.hidden_size * 4
    widest = max(cfg.intermediate_size * cfg.hidden_size, cfg.q_dim * cfg.hidden_size) * 4
    from flexgen_infinigen.kernels import cpu_kernels

    if cpu_kernels.library() is not None and \
            torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert cpu["working_set_device"] == (unknown["working_set_device"]
                                             - unknown["stage_copies_if_offloaded"] + widest)
    # without the kernels every product expands its weight, the output table included
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    bare = memory_plan.plan(cfg, lm.policy, torch.float32, prompt, gen, kv=kv,
                            device=torch.device("cpu"))
    table = cfg.vocab_size * cfg.hidden_size * 4
    assert table > widest
    assert bare["working_set_device"] == (unknown["working_set_device"]
                                          - unknown["stage_copies_if_offloaded"] + table)


def test_device_plan_counts_what_h2o_allocates(tiny_llama):
    _, store = tiny_llama
    b, prompt, gen = 2, 40, 8
    with _load(store, [100, 0, 0, 100, 100, 0], "h2o", gpu_batch_size=b) as lm:
        terms = memory_plan.plan(lm.cfg, lm.policy, torch.float32, prompt, gen,
                                 kv=lm.engine.kv_policy)["kv_policy_device"]
        caches = _cache_tensors(lm, b, prompt + gen)
    assert terms["h2o_scores_and_masks"] == _bytes(*(t for c in caches
                                                     for t in (c.alive, c.score)))


def test_device_plan_counts_attention_and_mlp_together_without_sep_layer(tiny_llama):
    _, store = tiny_llama
    with _load(store) as lm:
        cfg = lm.cfg
    plans = [memory_plan.plan(cfg, Placement.from_percent([0, 100, 100, 0, 100, 0], sep_layer=sep),
                              torch.float16, 64, 8) for sep in (True, False)]
    h, kv_dim = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    attn = (2 * h * h + 2 * h * kv_dim + h) * 2  # q, o, k, v and the norm, in fp16
    mlp = (3 * h * cfg.intermediate_size + h) * 2
    assert mlp > max(attn, cfg.vocab_size * h * 2)  # the MLP is the biggest stage alone
    # two stages in flight, each now attention and MLP together
    assert plans[1]["working_set_device"] - plans[0]["working_set_device"] == 2 * attn
    # weights all on the device are read where they are: no stage in flight
    resident = [memory_plan.plan(cfg, Placement(sep_layer=sep), torch.float16, 64, 8)
                for sep in (True, False)]
    assert resident[0]["working_set_device"] == resident[1]["working_set_device"]
    assert plans[0]["working_set_device"] - resident[0]["working_set_device"] == 2 * mlp


def test_peak_memory_leaves_out_loading(tiny_opt):
    _, store = tiny_opt
    with _load(store, [100, 0, 100, 0, 100, 0]) as lm:
        big = lm.tiers.empty("device", (64 << 20,), torch.uint8)  # 64 MiB held, then freed
        del big
        lm.generate([PROMPTS[0]], 2, stop_token_id=None)
        assert lm.tiers.peak["device"] < 64 << 20


@pytest.mark.parametrize("fn", ["attend", "attend_rows"])
def test_half_precision_scores_do_not_overflow(fn):
    """q.k above fp16's range whose scaled value fits: the output matches float32."""
    torch.manual_seed(0)
    b, heads, d, t = 1, 2, 64, 5
    q = torch.full((b, 1, heads, d), 40.0) + torch.randn(b, 1, heads, d)
    k = torch.full((b, t, heads, d), 40.0) + torch.randn(b, t, heads, d)
    v = torch.randn(b, t, heads, d)
    assert (q[0, 0, 0] * k[0, 0, 0]).sum() > torch.finfo(torch.float16).max
    bias = torch.zeros(b, 1, 1, t)

    def run(dtype):
        args = [x.to(dtype) for x in (q, k, v)]
        if fn == "attend":
            return attend(*args, bias.to(dtype)).float()
        rows = [x.permute(1, 0, 2, 3).reshape(t, b * heads, d) for x in args[1:]]
        return attend_rows(args[0], *rows, bias.to(dtype)).float()

    half, full = run(torch.float16), run(torch.float32)
    assert torch.isfinite(half).all()
    assert (half - full).abs().max() < 0.05 * math.sqrt(d)
