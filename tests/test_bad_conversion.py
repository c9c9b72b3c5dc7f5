"""A bad checkpoint or an interrupted conversion: one clear error line naming the fix, and
never a store (or a half-written one) left behind that later looks complete."""
from __future__ import annotations

import shutil
import time

import pytest

from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.weights import hf_convert
from flexgen_infinigen.weights.store import StoreWriter, WeightStore

FAST_S = 2.0  # a bad input must be reported well before any long work


def assert_mentions(line: str, *words: str) -> None:
    for w in words:
        assert w.lower() in line.lower(), f"{w!r} not in {line!r}"


# ---- the Hugging Face converter --------------------------------------------------------------
def convert_cli(capsys, argv) -> str:
    from flexgen_infinigen import convert

    capsys.readouterr()
    start = time.perf_counter()
    rc = convert.main([str(a) for a in argv])
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, f"convert returned {rc}; stderr: {err!r}"
    error_lines = [line for line in lines if line.startswith("error: ")]
    assert len(error_lines) == 1, f"expected one error line: {err!r}"
    # the conversion's own progress bar may precede it (a long read that found the fault)
    others = [line for line in lines if line not in error_lines]
    assert all(line.startswith("converting") for line in others), err
    assert elapsed < FAST_S, f"took {elapsed:.2f} s to report: {error_lines[0]}"
    return error_lines[0]


def leftovers(folder, before):
    return sorted(p.name for p in folder.iterdir() if p.name not in before)


def test_convert_folder_without_config(capsys, tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    line = convert_cli(capsys, ["--checkpoint", src, "--out", tmp_path / "out"])
    assert_mentions(line, "config.json", "--checkpoint")
    assert leftovers(tmp_path, {"ckpt"}) == []


@pytest.fixture
def hf_folder_copy(tiny_opt, tmp_path):
    """A private copy of the tiny OPT's Hugging Face folder (config.json + safetensors)."""
    src = tiny_opt[1].parent
    dest = tmp_path / "ckpt"
    dest.mkdir()
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, dest / f.name)
    return dest


def test_convert_checkpoint_missing_tensor(capsys, hf_folder_copy, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = hf_folder_copy / "model.safetensors"
    state = load_file(str(weights))
    key = next(k for k in state if k.endswith("layers.2.fc1.weight"))
    del state[key]
    save_file(state, str(weights), metadata={"format": "pt"})
    line = convert_cli(capsys, ["--checkpoint", hf_folder_copy, "--out", tmp_path / "out"])
    assert_mentions(line, "layers.2.fc1.weight", "partial")
    assert leftovers(tmp_path, {"ckpt"}) == []  # no store and no .partial folder


def test_convert_without_room_on_disk(capsys, monkeypatch, hf_folder_copy, tmp_path):
    """A disk without room for the store: one line with what it needs and where, and the
    fix, before any tensor is written."""
    import collections

    from flexgen_infinigen.weights import store as store_mod

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(store_mod.shutil, "disk_usage", lambda _p: usage(1 << 30, 1 << 30, 4096))
    line = convert_cli(capsys, ["--checkpoint", hf_folder_copy, "--out", tmp_path / "out"])
    assert_mentions(line, "GB free", str(tmp_path), "FLEXGEN_INFINIGEN_CACHE")
    assert leftovers(tmp_path, {"ckpt"}) == []


def test_room_counts_only_the_files_read(monkeypatch, hf_folder_copy, tmp_path):
    """A ``.bin`` folder the conversion reads ``pytorch_model.bin`` of: the room it asks for
    is that file's size, not that of every ``*.bin`` beside it (a 1 TB sparse
    ``optimizer.bin`` here), so a disk with room for the weights is not refused."""
    import collections

    import torch
    from safetensors.torch import load_file

    from flexgen_infinigen.weights import store as store_mod

    weights = hf_folder_copy / "model.safetensors"
    torch.save(load_file(str(weights)), hf_folder_copy / "pytorch_model.bin")
    weights.unlink()
    with open(hf_folder_copy / "optimizer.bin", "wb") as f:
        f.truncate(1 << 40)
    need = (hf_folder_copy / "pytorch_model.bin").stat().st_size
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(store_mod.shutil, "disk_usage",
                        lambda _p: usage(1 << 41, 0, 2 * need + (256 << 20)))
    out = hf_convert.convert_hf(hf_folder_copy, tmp_path / "out", "tiny-opt", progress=False)
    assert WeightStore(out).manifest["tensors"]


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, OSError], ids=["ctrl-c", "disk-error"])
def test_interrupted_conversion_leaves_nothing(monkeypatch, hf_folder_copy, tmp_path, exc_type):
    real_add = StoreWriter.add
    calls = []

    def add_then_fail(self, name, array, dtype=None):
        if len(calls) == 5:
            raise exc_type("interrupted")
        calls.append(name)
        real_add(self, name, array, dtype)

    monkeypatch.setattr(StoreWriter, "add", add_then_fail)
    out = tmp_path / "out"
    with pytest.raises(exc_type):
        hf_convert.convert_hf(hf_folder_copy, out, "tiny-opt")
    assert len(calls) == 5
    assert leftovers(tmp_path, {"ckpt"}) == []  # no store and no .partial folder
    with pytest.raises(ConfigError):
        WeightStore(out)
