"""Bad input fails fast with exactly one clear line that names the fix.

Every case runs the command line in-process (``run.main``) and checks that it returns 2,
prints one ``error: ...`` line on stderr that mentions the fix, prints nothing on stdout,
returns quickly, and never starts placing weights (``place_weights`` is replaced by a
function that fails the test).
"""
from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import torch

from flexgen_infinigen import api, run
from flexgen_infinigen.engine import loading
from flexgen_infinigen.weights import embedded

FAST_S = 2.0  # a bad input must be reported well before any long work


@pytest.fixture(autouse=True)
def no_long_work(monkeypatch):
    """Fail the test if weights are placed or the default model is fetched."""

    def forbidden(*args, **kwargs):
        pytest.fail("long work started (weights placed or default model fetched) "
                    "before the bad input was reported")

    # api.py imports place_weights by name, so patch both the module it lives in and api's copy
    monkeypatch.setattr(loading, "place_weights", forbidden)
    monkeypatch.setattr(api, "place_weights", forbidden)
    monkeypatch.setattr(embedded, "default_model_store", forbidden)


def cli_error(capsys, argv) -> str:
    """Run the CLI on ``argv``; assert one fast ``error:`` line and return it."""
    capsys.readouterr()  # drop anything printed before (fixtures)
    start = time.perf_counter()
    rc = run.main([str(a) for a in argv])
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, f"main returned {rc}; stderr: {err!r}"
    assert len(lines) == 1, f"expected exactly one stderr line, got {len(lines)}: {err!r}"
    assert lines[0].startswith("error: "), lines[0]
    assert out == "", f"unexpected stdout: {out!r}"
    assert elapsed < FAST_S, f"took {elapsed:.2f} s to report: {lines[0]}"
    return lines[0]


def assert_mentions(line: str, *words: str) -> None:
    for w in words:
        assert w.lower() in line.lower(), f"{w!r} not in {line!r}"


@pytest.fixture
def store_copy(tiny_opt, tmp_path):
    """A private copy of the tiny OPT store that a test may damage."""
    dest = tmp_path / "store"
    shutil.copytree(tiny_opt[1], dest)
    return dest


SMALL = ["--gen-len", "2", "--prompt-len", "4"]


# ---- the model and its weights ---------------------------------------------------------------
def test_unknown_model(capsys):
    line = cli_error(capsys, ["--model", "opt-does-not-exist", "--dummy"])
    assert_mentions(line, "unknown model", "opt-does-not-exist", "opt-125m", "--path")


def test_unknown_model_without_dummy(capsys):
    line = cli_error(capsys, ["--model", "gpt-17"])
    assert_mentions(line, "unknown model", "gpt-17", "--path")


def test_path_missing_folder(capsys, tmp_path):
    line = cli_error(capsys, ["--path", tmp_path / "nope"] + SMALL)
    assert_mentions(line, "does not exist", "convert", "--dummy")


def test_path_folder_without_manifest(capsys, tmp_path):
    line = cli_error(capsys, ["--path", tmp_path] + SMALL)
    assert_mentions(line, "manifest.json", "flexgen_infinigen.convert")


def test_path_to_unconverted_hf_folder(capsys, tiny_opt):
    # the Hugging Face folder the store was converted from: a likely mix-up
    line = cli_error(capsys, ["--path", tiny_opt[1].parent] + SMALL)
    assert_mentions(line, "manifest.json", "flexgen_infinigen.convert")


def test_partial_store(capsys, store_copy):
    (store_copy / "layers.1.fc2.weight.npy").unlink()
    line = cli_error(capsys, ["--path", store_copy] + SMALL)
    assert_mentions(line, "layers.1.fc2.weight", "re-run the conversion")


@pytest.mark.parametrize("bad_shape", [(128, 256), (256, 1)], ids=["transposed", "broadcastable"])
@pytest.mark.parametrize("manifest_updated", [True, False], ids=["manifest-updated",
                                                                 "manifest-stale"])
def test_tensor_shape_mismatch(capsys, store_copy, bad_shape, manifest_updated):
    name = "layers.0.fc1.weight"  # (256, 128) in the tiny OPT
    np.save(store_copy / f"{name}.npy", np.zeros(bad_shape, np.float32))
    if manifest_updated:
        manifest = json.loads((store_copy / "manifest.json").read_text())
        manifest["tensors"][name]["shape"] = list(bad_shape)
        (store_copy / "manifest.json").write_text(json.dumps(manifest))
    line = cli_error(capsys, ["--path", store_copy] + SMALL)
    assert_mentions(line, name, str(bad_shape), "(256, 128)", "re-convert")


# ---- the policy ------------------------------------------------------------------------------
@pytest.mark.parametrize("percent", [[150, 0, 100, 0, 100, 0], [100, 0, -10, 0, 100, 0],
                                     [100, 0, 100, 0, 100, 101]])
def test_percent_outside_range(capsys, percent):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--percent", *percent])
    assert_mentions(line, "--percent", "outside 0..100")


@pytest.mark.parametrize("percent, what", [([60, 50, 100, 0, 100, 0], "weights"),
                                           ([100, 0, 70, 40, 100, 0], "cache"),
                                           ([100, 0, 100, 0, 50, 51], "activations")])
def test_percent_pair_over_100(capsys, percent, what):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--percent", *percent])
    assert_mentions(line, "--percent", what, "sum to at most 100")


def test_percent_five_numbers(capsys):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--percent", "100", "0", "100",
                              "0", "100"])
    assert_mentions(line, "--percent", "six numbers", "auto")


def test_percent_not_a_number(capsys):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--percent", "100", "0", "x",
                              "0", "100", "0"])
    assert_mentions(line, "--percent", "six numbers")


@pytest.mark.parametrize("flag", ["--gpu-batch-size", "--num-gpu-batches"])
def test_batch_shape_zero(capsys, flag):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", flag, 0])
    assert_mentions(line, flag, "at least 1")


def test_policy_that_cannot_fit(capsys):
    line = cli_error(capsys, ["--model", "opt-175b", "--dummy"])
    # names the short tier and what to change
    assert_mentions(line, "GiB", "memory", "--percent")


def test_device_cuda_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--device", "cuda"])
    assert_mentions(line, "--device cuda", "--device cpu")


# ---- lengths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--gen-len", "--prompt-len"])
def test_length_zero(capsys, flag):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", flag, 0])
    assert_mentions(line, flag, "at least 1")


@pytest.mark.parametrize("flag", ["--gen-len", "--prompt-len"])
def test_length_zero_default_model(capsys, flag):
    # no --model: must still fail before the default model is fetched
    line = cli_error(capsys, [flag, 0])
    assert_mentions(line, flag, "at least 1")


def test_lengths_over_max_positions(capsys):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--prompt-len", 2000,
                              "--gen-len", 100])
    assert_mentions(line, "2048", "--gen-len", "shorten")


def test_lengths_over_max_positions_store(capsys, tiny_opt):
    # the tiny OPT has 256 positions; its limit is only known once the store is read
    line = cli_error(capsys, ["--path", tiny_opt[1], "--prompt-len", 250, "--gen-len", 10])
    assert_mentions(line, "256", "--gen-len", "shorten")


def test_cut_gen_len_zero(capsys):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--cut-gen-len", 0])
    assert_mentions(line, "--cut-gen-len", "at least 1")


# ---- sampling --------------------------------------------------------------------------------
def test_negative_temperature(capsys):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--temperature", -1])
    assert_mentions(line, "--temperature", ">= 0")


@pytest.mark.parametrize("top_p", [0, 1.5, -0.2])
def test_top_p_outside_range(capsys, top_p):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--temperature", 0.7,
                              "--top-p", top_p])
    assert_mentions(line, "--top-p", "(0, 1]")


# ---- prompts ---------------------------------------------------------------------------------
def test_prompt_file_missing(capsys, tmp_path):
    missing = tmp_path / "no-such-prompt.txt"
    line = cli_error(capsys, ["--prompt-file", missing])
    assert_mentions(line, "--prompt-file", str(missing))


@pytest.mark.parametrize("text", ["", "  \n\t\n"], ids=["empty", "blank"])
def test_prompt_file_empty(capsys, tmp_path, text):
    f = tmp_path / "prompt.txt"
    f.write_text(text)
    line = cli_error(capsys, ["--prompt-file", f])
    assert_mentions(line, "--prompt-file", "empty")


def test_dummy_with_prompt(capsys):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--prompt", "Hello"])
    assert_mentions(line, "--dummy", "--prompt-len")


def test_dummy_with_prompt_file(capsys, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("Hello there")
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--prompt-file", f])
    assert_mentions(line, "--dummy", "--prompt-len")


# ---- a newcomer's first hour -----------------------------------------------------------------
def test_json_folder_missing_is_reported_before_the_run(capsys, tmp_path):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--json",
                              tmp_path / "nope" / "r.json"] + SMALL)
    assert_mentions(line, "--json", "does not exist")


def test_offload_dir_unwritable(capsys):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--offload-dir",
                              "/proc/forbidden"] + SMALL)
    assert_mentions(line, "--offload-dir", "/proc/forbidden", "writable")


@pytest.mark.parametrize("kv", ["infinigen", "h2o"])
def test_selective_policy_with_cpu_cache_compute(capsys, kv):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--kv-policy", kv,
                              "--cpu-cache-compute"] + SMALL)
    assert_mentions(line, "--cpu-cache-compute", kv)


def test_empty_prompt(capsys):
    line = cli_error(capsys, ["--prompt", "  ", "--gen-len", "2"])
    assert_mentions(line, "--prompt", "empty")


def test_binary_prompt_file(capsys, tmp_path):
    f = tmp_path / "blob.bin"
    f.write_bytes(bytes(range(256)) * 4)
    line = cli_error(capsys, ["--prompt-file", f, "--gen-len", "2"])
    assert_mentions(line, "--prompt-file", "UTF-8")


def test_truncated_tensor_file(capsys, store_copy):
    path = store_copy / "layers.0.fc1.weight.npy"
    path.write_bytes(path.read_bytes()[:1000])
    line = cli_error(capsys, ["--path", store_copy] + SMALL)
    assert_mentions(line, "layers.0.fc1.weight.npy", "re-run the conversion")


@pytest.mark.parametrize("value", ["0", "-1"])
def test_bad_repetition_penalty(capsys, value):
    line = cli_error(capsys, ["--model", "opt-125m", "--dummy", "--repetition-penalty",
                              value] + SMALL)
    assert_mentions(line, "--repetition-penalty")


def test_optimize_refuses_the_impossible_before_profiling(capsys, monkeypatch):
    """A model that cannot fit at all is refused before the minute-long machine profile."""
    from flexgen_infinigen import optimize
    from flexgen_infinigen.planner import auto, measure

    monkeypatch.setattr(auto, "load_profile", lambda *a, **k: pytest.fail("profiled first"))
    monkeypatch.setattr(measure, "cached_profile", lambda *a, **k: pytest.fail("profiled first"))
    capsys.readouterr()
    rc = optimize.main(["--model", "opt-175b", "--gpu-mem", "0", "--cpu-mem", "8",
                        "--disk-mem", "10"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(err) == 1 and "opt-175b" in err[0] and "GiB" in err[0]


def test_cpu_out_of_memory_advice_fits_the_machine(capsys):
    """On a CPU the device is host memory: the advice is disk or compression, not the GPU."""
    line = cli_error(capsys, ["--model", "opt-175b", "--dummy", "--percent", "100", "0", "100",
                              "0", "100", "0", "--device", "cpu"] + SMALL)
    assert_mentions(line, "disk", "--compress-weight")
