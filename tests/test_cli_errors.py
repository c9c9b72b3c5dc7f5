"""Hostile or broken files and settings end the command line in one ``error:`` line that
names the fix, exit code 2, and no traceback: a safetensors header that claims more bytes
than its file, a pickled ``.bin`` (refused without running it), a cache folder that cannot be
written, sampling flags that are not finite, a Hub revision or file name that would leave
the Hub cache. A damaged store says how to rebuild it, and a store in the cache is rebuilt
by the next run."""
from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flexgen_infinigen import batch, run
from flexgen_infinigen.config import CACHE_ENV

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
              "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": False,
              "rms_norm_eps": 1e-5}


def _checkpoint(folder: Path, weights: str, data: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    (folder / weights).write_bytes(data)
    return folder


def _ends_in_one_error(rc: int, err: str) -> str:
    """The last stderr line: the only ``error:`` line, with exit code 2, no traceback."""
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2, f"exit {rc}: {err}"
    assert "Traceback" not in err, err
    errors = [x for x in lines if x.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    return errors[0]


def _cli(args, env_extra: dict) -> tuple[int, str]:
    """``python -m flexgen_infinigen.run`` in its own process: (exit code, stderr)."""
    env = {**os.environ, **env_extra}
    proc = subprocess.run([sys.executable, "-m", "flexgen_infinigen.run", *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env)
    return proc.returncode, proc.stderr


def _main(capsys, args, command=run) -> tuple[int, str]:
    capsys.readouterr()
    rc = command.main([str(a) for a in args])
    return rc, capsys.readouterr().err


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private cache folder for what the command converts."""
    folder = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


# ---- safetensors and pickles -----------------------------------------------------------------
def test_a_safetensors_header_of_2_to_the_62_bytes(tmp_path, cache):
    """The header's length is checked against the file before anything is allocated (this
    was a MemoryError), in a process of its own."""
    folder = _checkpoint(tmp_path / "ckpt", "model.safetensors",
                         (2**62).to_bytes(8, "little") + b"{}")
    rc, err = _cli(["--model", folder, "--gen-len", "2"], {CACHE_ENV: str(cache)})
    line = _ends_in_one_error(rc, err)
    assert "model.safetensors" in line and "download it again" in line


def _safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize("data, words", [
    (b"\x05\x00", ["shorter than a header"]),
    ((1000).to_bytes(8, "little") + b"{}", ["1000 bytes"]),
    (_safetensors({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}},
                  b"\0" * 16), ["data_offsets"]),
    (_safetensors({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 16]}},
                  b"\0" * 16), ["does not fill"]),
    (_safetensors({"w": {"dtype": "F32", "shape": "big", "data_offsets": [0, 16]}},
                  b"\0" * 16), ["shape"]),
    (_safetensors([1, 2], b""), ["not a table"]),
], ids=["short", "past-the-end", "offsets-outside", "shape-past-data", "shape-not-list",
        "header-not-object"])
def test_a_damaged_safetensors_header(tmp_path, cache, capsys, data, words):
    folder = _checkpoint(tmp_path / "ckpt", "model.safetensors", data)
    line = _ends_in_one_error(*_main(capsys, ["--model", folder, "--gen-len", "2"]))
    for w in words:
        assert w in line, line


class _Planted:
    """Unpickling this would create a file: the proof that the pickle ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_bin_is_refused_without_running(tmp_path, cache, capsys):
    marker = tmp_path / "the-pickle-ran"
    folder = _checkpoint(tmp_path / "ckpt", "pytorch_model.bin",
                         pickle.dumps({"w": _Planted(marker)}))
    line = _ends_in_one_error(*_main(capsys, ["--model", folder, "--gen-len", "2"]))
    assert "pytorch_model.bin" in line and ".safetensors" in line
    assert not marker.exists()


# ---- the cache folder ------------------------------------------------------------------------
def test_the_cache_variable_naming_a_file(tmp_path):
    """The default model's cache is a file: one line, in a process of its own."""
    not_a_folder = tmp_path / "cache-file"
    not_a_folder.write_text("")
    rc, err = _cli(["--gen-len", "2"], {CACHE_ENV: str(not_a_folder)})
    line = _ends_in_one_error(rc, err)
    assert CACHE_ENV in line and "is a file" in line


def test_a_cache_on_a_read_only_disk(tmp_path, cache, capsys, monkeypatch):
    """Creating the cache folder fails as on a read-only disk (EROFS), which a test cannot
    mount: one line naming the variable to point elsewhere."""
    real = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self == cache or cache in self.parents:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    folder = _checkpoint(tmp_path / "ckpt", "model.safetensors", _safetensors({}, b""))
    line = _ends_in_one_error(*_main(capsys, ["--model", folder, "--gen-len", "2"]))
    assert "Read-only file system" in line and CACHE_ENV in line


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into a folder without write permission")
def test_a_cache_folder_without_write_permission(tmp_path, cache, capsys):
    cache.mkdir()
    cache.chmod(0o500)
    try:
        folder = _checkpoint(tmp_path / "ckpt", "model.safetensors", _safetensors({}, b""))
        line = _ends_in_one_error(*_main(capsys, ["--model", folder, "--gen-len", "2"]))
        assert CACHE_ENV in line
    finally:
        cache.chmod(0o700)


# ---- sampling flags --------------------------------------------------------------------------
@pytest.mark.parametrize("command", [run, batch], ids=["run", "batch"])
@pytest.mark.parametrize("flag, value", [("--temperature", "nan"), ("--temperature", "inf"),
                                         ("--top-p", "nan"), ("--repetition-penalty", "inf")])
def test_sampling_flags_that_are_not_finite(tmp_path, capsys, command, flag, value):
    args = ["--model", "opt-125m", "--dummy", flag, value]
    if command is batch:
        (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": [1, 2]}\n')
        args += ["--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl"]
    line = _ends_in_one_error(*_main(capsys, args, command))
    assert flag in line and "finite" in line
    assert not (tmp_path / "out.jsonl").exists()


def test_a_seed_outside_64_bits(capsys):
    line = _ends_in_one_error(*_main(capsys, ["--model", "opt-125m", "--dummy", "--seed",
                                              str(2**64)]))
    assert "--seed" in line


# ---- Hub names -------------------------------------------------------------------------------
@pytest.mark.parametrize("model, words", [
    ("org/name@../../..", ["revision", "'../../..'"]),
    ("org/name@..", ["revision"]),
    ("org/name@refs/../../x", ["revision"]),
    ("org/name@/etc", ["revision"]),
    ("org/name@a/b", ["revision"]),
    ("org/name/../x.gguf", ["file", "'../x.gguf'"]),
    ("org/name//etc/x.gguf", ["file"]),
    ("org/a--b", ["repository name"]),
])
def test_hub_names_cannot_leave_the_cache(tmp_path, capsys, monkeypatch, model, words):
    """Even when the folder a revision points at exists (a repository's folder and a target
    outside the cache), the name is refused before any request or cache lookup."""
    hub = tmp_path / "hub"
    (hub / "models--org--name" / "snapshots").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps(TINY_LLAMA))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    line = _ends_in_one_error(*_main(capsys, ["--model", model, "--gen-len", "2"]))
    for w in words:
        assert w in line, line


def test_a_pull_request_revision_is_still_a_revision():
    from flexgen_infinigen.weights.hub_files import check_hub_name, parse_hub_name

    for name in ("org/m@refs/pr/3", "org/m@v1.0", "org/m@0123abcd", "org/m-GGUF@main:Q4_K_M",
                 "org/m/sub/x-Q8_0.gguf"):
        check_hub_name(parse_hub_name(name))  # no error


# ---- damaged stores --------------------------------------------------------------------------
def test_a_damaged_store_names_the_fix(tiny_opt, tmp_path, capsys):
    store = tmp_path / "store"
    shutil.copytree(tiny_opt[1], store)
    (store / "manifest.json").write_text("{not json")
    line = _ends_in_one_error(*_main(capsys, ["--path", store, "--prompt-len", "4",
                                              "--gen-len", "2"]))
    assert "damaged" in line and str(store) in line and "flexgen_infinigen.convert" in line


def test_a_damaged_store_in_the_cache_is_rebuilt(tiny_opt, tmp_path, capsys, monkeypatch):
    from flexgen_infinigen.kernels import cpu_kernels

    cpu_kernels.library()  # from the usual cache: not compiled again into this test's
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    source = tmp_path / "checkpoint"
    source.mkdir()
    for f in tiny_opt[1].parent.iterdir():
        if f.is_file():
            shutil.copy(f, source / f.name)
    args = ["--model", source, "--prompt-len", "4", "--gen-len", "2"]
    assert _main(capsys, args)[0] == 0
    (store,) = (cache / "stores").iterdir()
    tensor = store / "layers.0.fc1.weight.npy"
    tensor.write_bytes(tensor.read_bytes()[:100])  # cut short, its manifest untouched
    rc, err = _main(capsys, args)
    assert rc == 0 and "the store is damaged" in err, err
    assert tensor.stat().st_size > 100


def test_a_profile_that_cannot_be_saved_is_measured_and_used(tmp_path, monkeypatch, capsys):
    """``--percent auto`` on a read-only cache: the measured profile is used, with a warning,
    instead of an OSError from saving it."""
    from flexgen_infinigen.planner import hardware
    from flexgen_infinigen.planner.measure import cache as profile_cache

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(profile_cache, "cache_path", lambda: blocker / "hw.json")
    measured = hardware.load_profile("a6000-pcie3")
    monkeypatch.setattr(profile_cache, "measure_hardware", lambda *a, **k: measured)
    assert profile_cache.cached_profile(progress=False) is measured
    assert "could not be saved" in capsys.readouterr().err
