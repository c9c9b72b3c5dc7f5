"""``--model FILE.gguf`` reads the GGUF in place: the store in the cache is an index (config,
tokenizer, where each tensor lies in the file) holding no tensor bytes, and every tensor it
gives is, bit for bit, the one a full conversion (``convert --gguf``, the independent
reference: it copies the bytes out through gguf's reader) gives: values, blocks, codes,
llama's un-permuted q/k rows and each MoE expert's rows. A changed file is indexed again, a
file cut short is one error, and a model read from the index generates the converted
store's tokens."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_gguf_codes import PROMPT, _tiny, write_quantized_gguf
from test_moe_gguf import write_moe_gguf
from test_moe_gguf import _tiny as tiny_moe

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.weights import local_model
from flexgen_infinigen.weights.gguf_convert import convert_gguf, unpermute_rotary
from flexgen_infinigen.weights.gguf_index import index_gguf
from flexgen_infinigen.weights.store import MANIFEST, WeightStore, damage

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(GGUF path, index store, converted store) of a tiny llama holding the eight kept
    quantized types, its q/k rows interleaved as llama.cpp writes them."""
    folder = tmp_path_factory.mktemp("llama")
    path = folder / "tiny-llama.gguf"
    write_quantized_gguf(_tiny("llama"), "llama", path)
    return (path, WeightStore(index_gguf(path, folder / "index")),
            WeightStore(convert_gguf(path, folder / "converted", progress=False)))


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXGEN_INFINIGEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _folder_bytes(folder) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def assert_same_tensors(index: WeightStore, converted: WeightStore) -> None:
    """Every tensor of ``index`` as ``converted`` holds it: its format, its array as loaded,
    its values, and for a quantized one its layout and codes."""
    assert index.tensors.keys() == converted.tensors.keys()
    assert replace(index.config, name="") == replace(converted.config, name="")
    for name in converted.tensors:
        assert index.format(name) == converted.format(name), name
        ours, ref = index.load(name), converted.load(name)
        assert ours.dtype == ref.dtype and np.array_equal(ours, ref), name
        assert torch.equal(index.tensor(name), converted.tensor(name)), name
        if converted.layout(name) is not None:
            assert index.layout(name) == converted.layout(name), name
            for a, b in zip(index.packed(name).parts, converted.packed(name).parts):
                assert torch.equal(a, b), name


def test_index_holds_no_tensor_bytes_and_reads_in_place(llama):
    path, index, converted = llama
    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    assert not list(index.path.glob("*.npy"))
    assert _folder_bytes(index.path) < tensor_bytes / 20  # a manifest and a tokenizer
    assert _folder_bytes(converted.path) > tensor_bytes
    assert index.manifest["format"] == 3 and damage(index.path) is None
    for name in ("embed.weight", "layers.1.v_proj.weight", "final_norm.weight"):
        mapped = index.load(name)  # the GGUF's own bytes, mapped, not a copy
        assert isinstance(mapped, np.memmap) and mapped.filename == str(path), name
        assert not mapped.flags.writeable
    assert "heads" in index.tensors["layers.0.q_proj.weight"]
    assert_same_tensors(index, converted)
    assert index.tokenizer_path.read_text() == converted.tokenizer_path.read_text()
    skip = ("format", "tensors", "files")
    assert {k: v for k, v in index.manifest.items() if k not in skip} == \
        {k: v for k, v in converted.manifest.items() if k not in skip}


def test_blocks_are_the_file_and_their_order_unpermutes(llama):
    """``blocks()`` hands the stored blocks without a copy; for llama's q/k, row ``order[o]``
    of them is row ``o`` of the converted (un-permuted) store, the order being
    llama.cpp's permutation undone on row numbers. A converted store's blocks are its
    ``.npy`` rows, in order already."""
    path, index, converted = llama
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    cfg = index.config
    for name, info in index.tensors.items():
        if "gguf_type" not in info:
            with pytest.raises(ValueError, match="not GGUF blocks"):
                index.blocks(name)
            continue
        b, ref = index.blocks(name), converted.blocks(name)
        assert (b.kind, b.shape) == (info["gguf_type"], tuple(info["shape"]))
        assert ref.order is None and np.array_equal(ref.raw.numpy(), converted.load(name))
        assert b.raw.dtype == torch.uint8 and b.raw.shape == ref.raw.shape
        stored = index._raw(name)
        assert b.raw.data_ptr() == stored.ctypes.data  # the map itself
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            want = unpermute_rotary(np.arange(b.shape[0])[:, None], heads)[:, 0]
            assert b.order.dtype == torch.int32 and np.array_equal(b.order.numpy(), want)
            gguf_name = f"blk.{name.split('.')[1]}.attn_{name.split('.')[2][0]}.weight"
            assert np.array_equal(b.raw.numpy(), np.asarray(reader[gguf_name].data))
            assert not np.array_equal(b.raw.numpy(), ref.raw.numpy())
            assert torch.equal(b.raw[b.order.long()], ref.raw)
        else:
            assert b.order is None and torch.equal(b.raw, ref.raw), name


@pytest.mark.parametrize("gate_up", [False, True])
def test_moe_experts_are_entries_into_the_fused_tensor(gate_up, tmp_path):
    """A fused expert tensor (gate, up and down apart, or gate and up in one) is one entry
    per expert matrix, each at its own offset into the fused tensor's bytes, and each the
    converted store's tensor."""
    model = tiny_moe("qwen3moe")
    path = tmp_path / "moe.gguf"
    write_moe_gguf(model, "qwen3moe", path, "Q8_0", gate_up=gate_up)
    index = WeightStore(index_gguf(path, tmp_path / "index"))
    converted = WeightStore(convert_gguf(path, tmp_path / "converted", progress=False))
    assert_same_tensors(index, converted)
    fused = "ffn_gate_up_exps" if gate_up else "ffn_gate_exps"
    start = {t.name: t for t in gguf.GGUFReader(path).tensors}[f"blk.2.{fused}.weight"]
    first = index.tensors["layers.2.experts.0.gate_proj.weight"]
    second = index.tensors["layers.2.experts.0.up_proj.weight" if gate_up
                           else "layers.2.experts.1.gate_proj.weight"]
    assert first["offset"] == int(start.data_offset)
    assert second["offset"] == first["offset"] + first["bytes"]


def test_sharded_model_is_indexed_across_its_shards(tmp_path):
    model = _tiny("llama")
    write_quantized_gguf(model, "llama", tmp_path / "whole.gguf")
    write_quantized_gguf(model, "llama", tmp_path / "split.gguf", shards=8)
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    index = WeightStore(index_gguf(shards[1], tmp_path / "index"))
    converted = WeightStore(convert_gguf(tmp_path / "whole.gguf", tmp_path / "converted",
                                         progress=False))
    assert [f["path"] for f in index.manifest["files"]] == [str(s) for s in shards]
    assert {info["file"] for info in index.tensors.values()} == set(range(len(shards)))
    assert_same_tensors(index, converted)


def _generate(**where):
    with OffloadedLM.load(policy=Placement(), progress=False, **where) as lm:
        out = lm.generate([PROMPT], 6, stop_token_id=None, keep_logits=True)
        return lm, out


@pytest.mark.parametrize("w_gpu", [100, 0], ids=["device", "host"])
def test_placed_blocks_are_the_file_not_a_copy(llama, w_gpu):
    """On a CPU, a weight the kernels read as stored and placed whole (on the compute device
    or in CPU memory) is the file's memory map itself: its bytes lie inside the map of the
    GGUF, so the resident set holds the file once, not once mapped and once copied."""
    path, index, _ = llama
    policy = Placement(w_gpu_percent=w_gpu, w_cpu_percent=100 - w_gpu)
    with OffloadedLM.load(path=str(index.path), policy=policy, progress=False) as lm:
        maps = _file_maps(path)
        checked = 0
        for name, lay in lm.weight_layouts.items():
            if lay.kind is None or index.tensors[name].get("heads"):
                continue  # llama's q/k rows: un-permuted into a copy
            at = lm.engine.weights[name].segments[0].data.raw.data_ptr()
            where = [off + at - lo for lo, hi, off in maps if lo <= at < hi]
            assert where == [index.tensors[name]["offset"]], name
            checked += 1
        assert checked
        out = lm.generate([PROMPT], 4, stop_token_id=None)
    with OffloadedLM.load(path=str(index.path), policy=Placement(), progress=False) as ref:
        assert out.token_ids == ref.generate([PROMPT], 4, stop_token_id=None).token_ids


def _file_maps(path) -> list[tuple[int, int, int]]:
    """(start, end, file offset) of each of this process's mappings of ``path``."""
    out = []
    for line in open("/proc/self/maps"):
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].strip() == str(path.resolve()):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, int(parts[2], 16)))
    return out


def test_generation_from_the_index_is_the_converted_stores(llama, cache, capsys):
    path, index, converted = llama
    _, ref = _generate(path=converted.path)
    _, out = _generate(path=index.path)
    assert out.token_ids == ref.token_ids and torch.equal(out.logits[0], ref.logits[0])
    lm, out = _generate(model=str(path))  # --model FILE.gguf: indexed into the cache
    err = capsys.readouterr().err
    assert "indexing" in err and "first use" in err and "converting" not in err
    assert lm.store_path.parent == cache / "stores"
    assert not list(lm.store_path.glob("*.npy"))
    assert out.token_ids == ref.token_ids


def test_a_changed_file_is_indexed_again(cache, tmp_path, capsys):
    """Found again while the file is unchanged; a touched file, or one rewritten with other
    weights, is indexed again (and its new tensors read); a store copied by the previous
    converter is replaced by an index."""
    path = tmp_path / "m.gguf"
    write_quantized_gguf(_tiny("llama"), "llama", path)
    store = local_model.store_for(str(path), progress=False)
    assert "first use" in capsys.readouterr().err
    made = (store / MANIFEST).stat().st_mtime_ns
    assert local_model.store_for(str(path), progress=False) == store
    assert "indexing" not in capsys.readouterr().err
    assert (store / MANIFEST).stat().st_mtime_ns == made

    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert damage(store) is not None and "changed since it was indexed" in damage(store)
    local_model.store_for(str(path), progress=False)
    assert "the source changed" in capsys.readouterr().err
    assert damage(store) is None

    torch.manual_seed(7)
    other = _tiny("llama")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    write_quantized_gguf(other, "llama", path)  # other bytes at the same path
    local_model.store_for(str(path), progress=False)
    assert "the source changed" in capsys.readouterr().err
    fresh = WeightStore(convert_gguf(path, tmp_path / "converted", progress=False))
    assert_same_tensors(WeightStore(store), fresh)

    # a store the previous converter copied: its identity's version is older
    ident = {**local_model.identity(path.resolve(), "gguf"), "converter": 3}
    convert_gguf(path, store, extra={"source_identity": ident}, progress=False)
    assert list(store.glob("*.npy"))
    local_model.store_for(str(path), progress=False)
    assert "the source changed" in capsys.readouterr().err
    assert not list(store.glob("*.npy")) and WeightStore(store).manifest["format"] == 3


def test_a_file_cut_short_is_one_error(cache, tmp_path):
    """Cut short before indexing: one error naming the fix, no store. Cut short after: the
    index is damaged (found from the file's size, reading no tensor), the error names the
    file, and the next ``--model`` run gives the one error instead of reading past its end."""
    path = tmp_path / "cut.gguf"
    write_quantized_gguf(_tiny("llama"), "llama", path)
    store = local_model.store_for(str(path), progress=False)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) * 2 // 3])

    def no_reading(*_a, **_k):
        raise AssertionError("a damage check read tensor data")

    ws = WeightStore(store)
    ws._in_place.array = no_reading
    assert "changed since it was indexed" in (ws._fault("lm_head.weight") or "")
    with pytest.raises(ConfigError, match="in place") as err:
        ws.check({n: tuple(i["shape"]) for n, i in ws.tensors.items()})
    assert str(path) in str(err.value) and "\n" not in str(err.value)

    for attempt in (lambda: local_model.store_for(str(path), progress=False),
                    lambda: index_gguf(path, tmp_path / "index")):
        with pytest.raises(ConfigError, match="re-download") as err:
            attempt()
        assert "\n" not in str(err.value)
    assert not (tmp_path / "index").exists()
    assert not list(tmp_path.glob(".index.partial-*"))


def test_a_missing_file_is_named(llama, tmp_path):
    """An index whose GGUF is gone is damaged, and says which file it reads."""
    path, index, _ = llama
    manifest = json.loads((index.path / MANIFEST).read_text())
    manifest["files"][0]["path"] = str(tmp_path / "gone.gguf")
    (tmp_path / "moved").mkdir()
    (tmp_path / "moved" / MANIFEST).write_text(json.dumps(manifest))
    fault = damage(tmp_path / "moved")
    assert "gone.gguf" in fault and "missing" in fault
