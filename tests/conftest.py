"""Shared fixtures: a tiny random OPT checkpoint and the real SmolLM2 store, with HF references."""
from __future__ import annotations

import contextlib

import os
import re
from pathlib import Path

import pytest
import torch

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# .ci/run sets this: there a test that skips because a package is missing is a failure, since
# the README's install (setup.py's [test] extra) must bring every package a test imports.
EXTRAS_REQUIRED = os.environ.get("FLEXGEN_INFINIGEN_TEST_EXTRAS") == "required"


def _missing_package_fails(report) -> None:
    if not (EXTRAS_REQUIRED and report.skipped and isinstance(report.longrepr, tuple)):
        return
    found = re.search(r"could not import '([^']+)'", str(report.longrepr[2]))
    if found:
        report.outcome = "failed"
        report.longrepr = (f"{found[1]} is not installed, and the README's install command should "
                           f"install every package a test imports: add {found[1]} to the [test] "
                           "extra in setup.py")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _missing_package_fails(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _missing_package_fails(outcome.get_result())


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory):
    """(HF model, converted store path) for a small OPT with random weights."""
    from transformers import OPTConfig, OPTForCausalLM

    from flexgen_infinigen.weights.hf_convert import convert_hf

    torch.manual_seed(0)
    hf_cfg = OPTConfig(vocab_size=512, hidden_size=128, num_hidden_layers=3, ffn_dim=256,
                       num_attention_heads=4, max_position_embeddings=256,
                       word_embed_proj_dim=128)
    model = OPTForCausalLM(hf_cfg).eval()
    folder = tmp_path_factory.mktemp("tiny-opt")
    model.save_pretrained(folder)
    store = convert_hf(folder, folder / "store", "tiny-opt")
    return model, store


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(HF model, converted store path) for a small Llama with grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flexgen_infinigen.weights.hf_convert import convert_hf

    torch.manual_seed(0)
    hf_cfg = LlamaConfig(vocab_size=512, hidden_size=128, num_hidden_layers=4,
                         intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    model = LlamaForCausalLM(hf_cfg).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    store = convert_hf(folder, folder / "store", "tiny-llama")
    return model, store


@pytest.fixture(scope="session")
def smollm2_codes_store():
    """The default model's store as the runtime builds it: the GGUF's Q4_1/Q8_0 codes."""
    from flexgen_infinigen.config import ConfigError
    from flexgen_infinigen.weights.embedded import default_model_store

    try:
        return default_model_store(progress=False)
    except ConfigError as e:
        pytest.skip(f"SmolLM2-135M could not be obtained: {e}")


@pytest.fixture(scope="session")
def smollm2_store(smollm2_codes_store, tmp_path_factory):
    """The default model's weights as a float32 store (its codes expanded by ``gguf``): the
    real model for tests of everything but the weights' format (the KV policies, kernels
    compared with torch, ``--compress-weight`` on floats), whose bounds assume float
    weights. Products over 4-bit codes round x to 16 bits per 64 values, which turns a
    1e-7 difference upstream into ~1e-3 of the logits; test_llama_reference and
    test_gguf_codes run the codes themselves."""
    from flexgen_infinigen.weights.hf_reference import float_store

    return float_store(smollm2_codes_store, tmp_path_factory.mktemp("smollm2") / "float32")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_store):
    from flexgen_infinigen.weights.hf_reference import hf_llama_from_store

    return hf_llama_from_store(smollm2_store)


@contextlib.contextmanager
def inputs_rounded(model, block_of):
    """transformers' ``model`` with each linear layer's input rounded as the GGUF block
    kernels round it: per block of ``block_of(part)`` values (None: left alone; ``part``:
    the module's name without ``model.layers.N.``, e.g. ``self_attn.q_proj``, ``lm_head``),
    8-bit codes q = round(x * 127 / amax) and the float scale amax / 127 (llama.cpp's
    Q8_0 and Q8_K). The hooks come off on leaving."""
    def hook_for(n):
        def hook(module, args):
            x = args[0]
            b = x.float().reshape(-1, n)
            amax = b.abs().amax(1, keepdim=True)
            q = torch.round(b * torch.where(amax > 0, 127 / amax, 0))
            return ((q * (amax / 127)).reshape(x.shape).to(x.dtype),)
        return hook

    handles = []
    for name, module in model.named_modules():
        part = name.removeprefix("model.")
        part = part.split(".", 2)[-1] if part.startswith("layers.") else part
        n = block_of(part) if isinstance(module, torch.nn.Linear) else None
        if n:
            handles.append(module.register_forward_pre_hook(hook_for(n)))
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


def hf_greedy(model, prompt: list[int], steps: int):
    """Greedy tokens and per-step logits from transformers with its own KV cache (the reference).

    A plain loop rather than ``generate`` so that no logits processor (such as the one that
    hides the end-of-sequence token) changes the logits.
    """
    tokens, logits = [], []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            last = out.logits[0, -1].float()
            logits.append(last)
            tokens.append(int(last.argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens, torch.stack(logits)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# InfiniGen reads a layer whole while its KV is too small for choosing to pay (12 MB on a
# CPU): the tests' models are tiny, and they test the selection, so it always selects here
# (tests/test_infinigen.py checks the read-whole rule with explicit sizes)
os.environ.setdefault("FLEXGEN_INFINIGEN_SELECT_FROM_MB", "0")


def portable_kernels(tmp_path_factory, source: str, march: str | None = None):
    """``kernels/c/<source>`` built for a plain x86-64 (no AVX, so no AVX2 and no
    F16C): the kernels' portable paths, loaded with ctypes; or for ``march`` (``haswell``:
    AVX2 without AVX-512). Skips without a C compiler or off x86-64."""
    import ctypes
    import platform
    import shutil
    import subprocess
    from pathlib import Path

    from flexgen_infinigen.kernels import cpu_kernels

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None or platform.machine() != "x86_64":
        pytest.skip("the portable build is tested on x86-64 with a C compiler")
    folder = Path(cpu_kernels.__file__).with_name("c")
    out = tmp_path_factory.mktemp("portable") / f"{Path(source).stem}.so"
    target = [f"-march={march}"] if march else ["-march=x86-64", "-mno-avx"]
    subprocess.run([cc, "-O2", *target, "-fopenmp", "-fPIC", "-shared",
                    "-Wno-psabi", "-I", str(folder), str(folder / source), "-o", str(out),
                    "-lm"], check=True, capture_output=True)
    return ctypes.CDLL(str(out))
