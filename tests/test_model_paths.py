"""``--model`` given a GGUF file or a Hugging Face folder: indexed (a GGUF, read in place)
or converted into the cache once, found again by the source's identity, made again when the
source changes, and never left half-written. Outputs are checked against transformers on
the same weights."""
from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import hf_greedy
from test_gguf_families import COMMON, PROMPT, _write_gguf

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.weights import local_model
from flexgen_infinigen.weights.store import MANIFEST, StoreWriter

pytest.importorskip("gguf")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXGEN_INFINIGEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    import transformers

    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)).eval()
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    _write_gguf(model, "qwen2", path, vocab_model="llama")
    return model, path


def _generate(model_arg, steps=6):
    with OffloadedLM.load(model=str(model_arg), policy=Placement(), progress=False) as lm:
        out = lm.generate([PROMPT], steps, stop_token_id=None, keep_logits=True)
        return lm, out


def test_gguf_file_indexed_once_then_found_then_reindexed(cache, tiny_qwen2, capsys):
    model, path = tiny_qwen2
    lm, out = _generate(path)
    assert "indexing" in capsys.readouterr().err.split("first use")[0]
    tokens, logits = hf_greedy(model, PROMPT, 6)
    assert out.token_ids[0] == tokens
    assert (out.logits[0] - logits).abs().max().item() < 1e-4
    assert lm.cfg.architecture == "qwen2" and lm.tokenizer is not None
    store = local_model.cache_store_path(path.resolve())
    assert lm.store_path == store and store.parent == cache / "stores"
    made = (store / MANIFEST).stat().st_mtime_ns

    _generate(path)  # found again: nothing indexed, the store untouched
    assert "indexing" not in capsys.readouterr().err
    assert (store / MANIFEST).stat().st_mtime_ns == made

    st = path.stat()  # a rewritten source (same bytes, new time) is indexed again
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _generate(path)
    assert "the source changed" in capsys.readouterr().err
    ident = json.loads((store / MANIFEST).read_text())["source_identity"]
    assert ident == local_model.identity(path.resolve(), "gguf")


def test_an_indexed_files_config_comes_from_its_index(cache, tiny_qwen2, monkeypatch):
    """Once indexed, a GGUF's config is read from the index (a large vocabulary's metadata
    takes seconds to parse), equal to the file's own; a changed file is read again."""
    from flexgen_infinigen.weights import gguf_config

    _, path = tiny_qwen2
    from_file = local_model.source_config(str(path))  # not indexed yet: the file's metadata
    local_model.store_for(str(path), progress=False)
    real = gguf_config.open_model
    monkeypatch.setattr(gguf_config, "open_model", lambda *a: pytest.fail("file parsed"))
    assert local_model.source_config(str(path)) == from_file
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    opened = []
    monkeypatch.setattr(gguf_config, "open_model", lambda *a: opened.append(a) or real(*a))
    assert local_model.source_config(str(path)) == from_file and opened


def test_hf_folder_as_model(cache, tiny_llama, capsys):
    model, existing_store = tiny_llama
    folder = existing_store.parent  # the folder save_pretrained wrote
    lm, out = _generate(folder)
    assert "first use" in capsys.readouterr().err
    assert out.token_ids[0] == hf_greedy(model, PROMPT, 6)[0]
    assert lm.cfg.architecture == "llama"
    _generate(folder)
    assert "converting" not in capsys.readouterr().err


def test_interrupted_conversion_is_not_found_later(cache, tiny_qwen2, monkeypatch, capsys):
    _, path = tiny_qwen2
    real_add, calls = StoreWriter.add_in_place, []  # a GGUF's store is an index

    def failing_add(self, name, entry):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated Ctrl-C")
        real_add(self, name, entry)

    monkeypatch.setattr(StoreWriter, "add_in_place", failing_add)
    with pytest.raises(KeyboardInterrupt):
        _generate(path)
    stores = cache / "stores"
    assert [p for p in stores.iterdir() if (p / MANIFEST).exists()] == []
    monkeypatch.setattr(StoreWriter, "add_in_place", real_add)
    _generate(path)  # the next use indexes from scratch
    assert capsys.readouterr().err.count("first use") == 2


def test_cli_reports_the_architecture(cache, tiny_qwen2, tmp_path):
    from flexgen_infinigen import run

    _, path = tiny_qwen2
    out = tmp_path / "r.json"
    assert run.main(["--model", str(path), "--prompt-len", "8", "--gen-len", "3", "--no-stop",
                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"]["architecture"] == "qwen2"
    assert len(report["token_ids"][0]) == 3


def test_bad_model_paths_are_one_error(cache, tmp_path, capsys):
    from flexgen_infinigen import run

    with pytest.raises(ConfigError, match="no such file"):
        local_model.store_for(str(tmp_path / "missing.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither a .gguf file nor a Hugging Face"):
        local_model.store_for(str(tmp_path / "empty"))
    assert run.main(["--model", str(tmp_path / "missing.gguf"), "--prompt-len", "4"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert not local_model.is_model_path("smollm2-135m")


def test_a_turn_end_token_stops_generation(cache, tiny_qwen2):
    """The tokenizer's stop set (EOS, the GGUF's end-of-turn id, <|im_end|>-style specials)
    ends a sequence, not only the config's EOS: the token greedy decoding makes first is
    made a stop token, and generation ends right after it."""
    _, path = tiny_qwen2
    with OffloadedLM.load(model=str(path), policy=Placement(), progress=False) as lm:
        free = lm.generate([PROMPT], 5, stop_token_id=None).token_ids[0]
        assert free[0] != lm.cfg.eos_token_id
        lm.tokenizer.stop_token_ids.add(free[0])
        assert lm.generate([PROMPT], 5).token_ids[0] == free[:1]
