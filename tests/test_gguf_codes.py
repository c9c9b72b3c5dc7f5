"""Quantized GGUF tensors stay quantized: the store keeps the file's blocks, loading maps them
exactly onto the runtime's codes (checked against ``gguf``'s own dequantizer), the kernels
multiply them as stored, and a model built from them gives transformers' tokens on the
same (dequantized) weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_greedy, inputs_rounded
from gguf_header import add_model_metadata

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.kernels import layers as cpu_layers
from flexgen_infinigen.memory.codes import BLOCK_FORMS, Packed, PackedWeight, decompress
from flexgen_infinigen.weights import gguf_codes

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

# where each type keeps its float16 factors (bytes of a block), set to sane values in tests
F16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q8_0": [0],
          "Q5_0": [0], "Q5_1": [0, 2], "Q6_K": [208]}


def random_blocks(kind: str, rows: int, cols: int, seed: int, scale: float = 1.0):
    """Random codes in ``kind``'s blocks, their float16 factors normal-sized (random bytes
    would make infinities and NaNs of some)."""
    per, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for at in F16_AT.get(kind, []):
        f = (rng.standard_normal((rows, cols // per)) * scale).astype(np.float16)
        raw[..., at:at + 2] = f.view(np.uint8).reshape(rows, cols // per, 2)
    if kind == "MXFP4":  # every exponent 0..254: subnormal powers of two included
        raw[..., 0] = rng.integers(0, 255, (rows, cols // per))
    return raw.reshape(rows, -1)


def packed_of(raw, kind, shape) -> Packed:
    parts = gguf_codes.to_parts(raw, kind, shape)
    return Packed(*(torch.from_numpy(np.array(p)) for p in parts), shape)


@pytest.mark.parametrize("kind", list(gguf_codes.BLOCKS))
def test_codes_expand_to_what_gguf_dequantizes(kind):
    """Every kept type, on random codes: code * scale + minimum is, bit for bit, what
    ``gguf.quants.dequantize`` makes of the same blocks; the codes are 4 or 8 bits as the
    type's layout says, in groups of 32 (16 for Q6_K)."""
    shape = (6, 512)
    raw = random_blocks(kind, *shape, seed=len(kind) + ord(kind[1]))
    ref = dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(shape)
    p = packed_of(raw, kind, shape)
    assert (p.bits, p.group) == gguf_codes.layout(kind)
    assert np.array_equal(decompress(p).numpy(), ref)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_codes_of_quantized_floats(kind):
    """Floats quantized by ``gguf``'s own quantizer come back as it dequantizes them."""
    w = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    raw = quantize(w, gguf.GGMLQuantizationType[kind])
    ref = dequantize(raw, gguf.GGMLQuantizationType[kind])
    assert np.array_equal(decompress(packed_of(raw, kind, w.shape)).numpy(), ref)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q8_0", "Q6_K", "Q5_1"])
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_kernels_multiply_the_codes_as_stored(kind, rows):
    """``linear`` on the codes (4-bit groups of 32 through ``linear_q4``, 8-bit codes through
    ``linear_q8``) against ``F.linear`` on the expanded weights: 4 bits within 1e-3 of the
    outputs' largest value (x rounded to 16 bits per 64 values), 8 bits to float rounding."""
    shape = (40, 768)
    raw = random_blocks(kind, *shape, seed=rows, scale=0.01)
    w = PackedWeight(packed_of(raw, kind, shape))
    assert w.kernel_ready
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, shape[1], generator=gen)
    b = torch.randn(shape[0], generator=gen)
    ours = cpu_layers.linear_q4(x, w, b)
    if ours is None:
        pytest.skip("no kernel for these codes here (4 bits need AVX2)")
    ref = torch.nn.functional.linear(x.double(), decompress(w.packed).double(), b.double())
    tol = 1e-3 if w.packed.bits == 4 else 1e-5
    assert (ours.double() - ref).abs().max() <= tol * ref.abs().max()


# --- whole models -------------------------------------------------------------------------

COMMON = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, intermediate_size=512,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=False, rms_norm_eps=1e-6)
TYPES = {"self_attn.q_proj": "Q4_K", "self_attn.k_proj": "Q4_0", "self_attn.v_proj": "Q6_K",
         "self_attn.o_proj": "Q5_K", "mlp.gate_proj": "Q4_1", "mlp.up_proj": "Q5_0",
         "mlp.down_proj": "Q5_1", "embed_tokens": "Q8_0", "lm_head": "Q8_0"}
GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
PROMPT = [1, 17, 230, 5, 99, 410, 3, 77, 8, 21]


def _gguf_name(name: str) -> tuple[str, str | None]:
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "token_embd.weight", "embed_tokens"
    if name == "norm.weight":
        return "output_norm.weight", None
    if name == "lm_head.weight":
        return "output.weight", "lm_head"
    _, i, rest = name.split(".", 2)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{GGUF_NAMES[part]}.{kind}", part


def write_quantized_gguf(model, arch: str, path, kinds=TYPES, shards: int = 0) -> None:
    """``model`` as a GGUF whose matrices are quantized (``gguf``'s quantizer where it has
    one, random codes for the K-quants), and the model's own weights replaced by what the
    file encodes (``gguf``'s dequantizer): the reference runs on exactly those values."""
    from flexgen_infinigen.weights.gguf_convert import permute_rotary, unpermute_rotary

    c = model.config
    # ``shards``: at most that many tensors a file (``path``-0000i-of-0000n.gguf)
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=shards)
    add_model_metadata(w, c, arch, "llama")
    state = model.state_dict()
    for seed, (name, t) in enumerate(state.items()):
        out, part = _gguf_name(name)
        kind = kinds.get(part) if name.endswith(".weight") and t.dim() == 2 else None
        t = t.float().numpy()
        permuted = arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj")
        heads = c.num_attention_heads if part == "self_attn.q_proj" else c.num_key_value_heads
        if permuted:
            t = permute_rotary(t, heads)
        if kind is None:
            w.add_tensor(out, np.ascontiguousarray(t))
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        try:
            raw = quantize(t, qtype)
        except NotImplementedError:  # K-quants: random codes, weights about 0.05 in size
            raw = random_blocks(kind, *t.shape, seed=seed, scale=2e-3)
        w.add_tensor(out, raw, raw_dtype=qtype)
        values = dequantize(raw, qtype).reshape(t.shape)
        if permuted:
            values = unpermute_rotary(values, heads)
        with torch.no_grad():
            state[name].copy_(torch.from_numpy(values))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny(arch: str):
    import transformers

    torch.manual_seed(0)
    name = {"llama": "Llama", "qwen3": "Qwen3"}[arch]
    extra = {"head_dim": 64} if arch == "qwen3" else {}
    model = getattr(transformers, f"{name}ForCausalLM")(
        getattr(transformers, f"{name}Config")(**COMMON, **extra)).eval()
    with torch.no_grad():  # non-trivial norm scales
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(torch.randn_like(p) * 0.5 + 1)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("percent,blocks,fused", [([100, 0], True, True), ([100, 0], True, False),
                                                  ([40, 30], True, True), ([40, 30], False, True)])
def test_quantized_gguf_runs_from_its_codes(arch, percent, blocks, fused, tmp_path, monkeypatch):
    """A GGUF holding all eight kept quantized types (llama: q/k rows permuted by llama.cpp,
    undone on whole rows of blocks; qwen3: q/k norms) converts to a store of the file's
    blocks (each tensor's file the size of its bytes in the GGUF), with the weights on the
    device or split over the three tiers. ``blocks`` (a CPU's default): placed as the file's
    blocks, byte for byte, the memory plan counting them, and giving transformers' greedy
    tokens and logits on the dequantized weights with each quantized matrix's input rounded
    to 8-bit blocks as the kernels round it (``conftest.inputs_rounded``). Else placed as codes
    (the form a GPU takes), matching transformers' float path."""
    from flexgen_infinigen.engine import memory_plan
    from flexgen_infinigen.weights.gguf_convert import convert_gguf
    from flexgen_infinigen.weights.store import WeightStore

    monkeypatch.setenv("FLEXGEN_INFINIGEN_GGUF_BLOCKS", "1" if blocks else "0")
    monkeypatch.setenv("FLEXGEN_INFINIGEN_FUSED", "1" if fused else "0")  # the layer's one call
    model = _tiny(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_quantized_gguf(model, arch, path)
    store = convert_gguf(path, tmp_path / "store", progress=False)
    reader = gguf.GGUFReader(path)
    ws = WeightStore(store)
    for t in reader.tensors:  # the blocks as the file holds them, nothing added but a header
        stored = [n for n, info in ws.tensors.items()
                  if tuple(info["shape"]) == tuple(int(d) for d in reversed(t.shape))
                  and ws.format(n) == t.tensor_type.name]
        assert stored, t.name
        size = (store / f"{stored[0]}.npy").stat().st_size
        assert t.n_bytes <= size <= t.n_bytes + 256
    assert ws.format("layers.0.v_proj.weight") == "Q6_K"
    policy = Placement.from_percent([*percent, 100, 0, 100, 0])
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        assert lm.cfg.qk_norm == (arch == "qwen3")
        placed = sum(lm.weight_bytes_by_tier().values())
        planned = memory_plan.plan(lm.cfg, lm.policy, torch.float32, 1, 1,
                                   layouts=lm.weight_layouts)["weights"]
        out = lm.generate([PROMPT], 8, stop_token_id=None, keep_logits=True)
    assert sum(planned.values()) == placed
    with inputs_rounded(model, lambda part: BLOCK_FORMS[TYPES[part]][1] if blocks else None):
        tokens, logits = hf_greedy(model, PROMPT, 8)
    codes = sum(t.n_bytes for t in reader.tensors if t.tensor_type.name != "F32")
    if blocks:  # the file's blocks as they lie, times activations rounded to 8-bit blocks
        assert {ws.format(n) == lay.kind for n, lay in lm.weight_layouts.items()} == {True}
        assert placed == sum(t.n_bytes for t in reader.tensors)  # nothing widened or added
        assert out.token_ids[0] == tokens
        assert (out.logits[0] - logits).abs().max().item() < 1e-5 * logits.abs().max().item()
        return
    # the plain types' factors held as float16 (exact), the random K-quants' as float32
    half = {ws.format(n): lay.half for n, lay in lm.weight_layouts.items()}
    assert half == {"Q4_K": False, "Q5_K": False, "Q6_K": False, "Q4_0": True,
                    "Q4_1": True, "Q5_0": True, "Q5_1": True, "Q8_0": True}
    # 4-bit and 8-bit codes with a scale and minimum a group, norms in float32
    assert codes < placed < 1.6 * codes
    assert out.token_ids[0] == tokens
    assert (out.logits[0] - logits).abs().max().item() < 2e-3 * logits.abs().max().item()


def test_compress_weight_on_codes_changes_nothing(tmp_path):
    """``--compress-weight`` over codes a file brought is a no-op that the report names."""
    from flexgen_infinigen.cli.report import build_report
    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    path = tmp_path / "tiny.gguf"
    write_quantized_gguf(_tiny("llama"), "llama", path)
    store = convert_gguf(path, tmp_path / "store", progress=False)
    runs = []
    for compress in (False, True):
        with OffloadedLM.load(path=store, policy=Placement(compress_weight=compress),
                              progress=False) as lm:
            out = lm.generate([PROMPT], 3, stop_token_id=None, keep_logits=True)
            report = build_report(lm, out, "cpu")
            runs.append((lm.weight_bytes_by_tier(), out.logits[0], report["weight_formats"]))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])
    assert runs[0][2]["compress_weight"] is None and "ignored" in runs[1][2]["compress_weight"]
    summary = runs[0][2]["summary"]
    assert "Q4_K (attention)" in summary and "Q8_0 (embedding, head)" in summary
    assert "F32 (norms)" in summary


def test_unknown_tensor_type_is_one_error(tmp_path):
    """A type the runtime cannot keep is named before anything is written."""
    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    path = tmp_path / "q2.gguf"
    write_quantized_gguf(_tiny("llama"), "llama", path,
                         kinds={**TYPES, "mlp.down_proj": "Q2_K"})
    with pytest.raises(ConfigError, match="Q2_K") as err:
        convert_gguf(path, tmp_path / "store", progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "store").exists()
    assert not list(tmp_path.glob(".store.partial-*"))


def test_truncated_gguf_is_one_error(tmp_path):
    """A file cut short (an interrupted download) is one error, and no store is left."""
    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    path = tmp_path / "cut.gguf"
    write_quantized_gguf(_tiny("llama"), "llama", path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) * 2 // 3])
    with pytest.raises(ConfigError, match="re-download") as err:
        convert_gguf(path, tmp_path / "store", progress=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "store").exists()


def test_store_that_would_not_fit_is_refused(tmp_path, monkeypatch):
    """A conversion that would fill the disk is one error naming the room it needs, before
    anything is written; with exactly that room it goes through, and the store it writes
    takes no more than the room asked for."""
    import collections

    from flexgen_infinigen.weights import store as store_mod
    from flexgen_infinigen.weights.gguf_convert import convert_gguf

    path = tmp_path / "tiny.gguf"
    write_quantized_gguf(_tiny("llama"), "llama", path)
    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    need = int(tensor_bytes * store_mod.ROOM_MARGIN) + store_mod.ROOM_SLACK
    usage = collections.namedtuple("usage", "total used free")
    for free in (need - 1, need):
        monkeypatch.setattr(store_mod.shutil, "disk_usage",
                            lambda _p, free=free: usage(10 * need, 9 * need, free))
        if free < need:
            with pytest.raises(ConfigError, match="FLEXGEN_INFINIGEN_CACHE") as err:
                convert_gguf(path, tmp_path / "store", progress=False)
            assert "GB free" in str(err.value) and "\n" not in str(err.value)
            assert not (tmp_path / "store").exists()
            assert not list(tmp_path.glob(".store.partial-*"))
        else:
            store = convert_gguf(path, tmp_path / "store", progress=False)
    written = sum(f.stat().st_size for f in store.iterdir())
    # the tensors' bytes plus headers, the manifest and the tokenizer: well inside the margin
    assert tensor_bytes <= written <= tensor_bytes * store_mod.ROOM_MARGIN + (1 << 20)


def test_sharded_gguf_is_one_model(tmp_path):
    """A GGUF split into shards converts, named by any shard, to the store the whole file
    gives (the same tensors, bit for bit); a missing shard is one error naming it."""
    from flexgen_infinigen.weights.gguf_convert import convert_gguf
    from flexgen_infinigen.weights.store import WeightStore

    model = _tiny("llama")
    write_quantized_gguf(model, "llama", tmp_path / "whole.gguf")
    write_quantized_gguf(model, "llama", tmp_path / "split.gguf", shards=8)
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(shards) > 2
    whole = WeightStore(convert_gguf(tmp_path / "whole.gguf", tmp_path / "a", progress=False))
    split = WeightStore(convert_gguf(shards[1], tmp_path / "b", progress=False))
    assert whole.tensors == split.tensors
    for name in whole.tensors:
        assert np.array_equal(whole.load(name), split.load(name))
    shards[-1].unlink()
    with pytest.raises(ConfigError, match=shards[-1].name):
        convert_gguf(shards[0], tmp_path / "c", progress=False)
