"""``--model org/name`` from a Hub: a stand-in Hub on 127.0.0.1 (tests/hub_server.py)
reached through ``HF_ENDPOINT``, downloaded by the real ``huggingface_hub`` client into an
``HF_HOME`` of the test's own. Checked: what is fetched and where it lands, the same tokens
as the same files loaded from a folder (and as transformers), a cut connection resumed,
offline reuse with no request at all, GGUF quantizations and split files, and one error
line for each way it can fail, before anything is converted."""
from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy
from hub_server import HubServer, Repo

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.config import default_cache_dir
from flexgen_infinigen.weights.store import MANIFEST

pytest.importorskip("huggingface_hub")
gguf = pytest.importorskip("gguf")

PROMPT = "t5 t17 t230 t99 t410 t3 t77"
WORDS = [f"t{i}" for i in range(256)]


def _tokenizer_json() -> bytes:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok.to_str().encode()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, its folder, the repo's files): a llama saved in two safetensors
    shards with an index, a tokenizer, and files the runtime must not fetch."""
    import transformers

    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                   intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder, max_shard_size="100KB")
    (folder / "tokenizer.json").write_bytes(_tokenizer_json())
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert "model.safetensors.index.json" in files  # the sharded layout is what is tested
    files.update({"README.md": b"# tiny", "pytorch_model.bin": b"not fetched" * 100,
                  "original/consolidated.safetensors": b"not fetched either"})
    return model, folder, files


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(transformers model, {quantization: GGUF file bytes}, split shards' bytes)."""
    import transformers
    from test_gguf_families import COMMON, _write_gguf

    torch.manual_seed(4)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)).eval()
    folder = tmp_path_factory.mktemp("tiny-gguf")
    _write_gguf(model, "qwen2", folder / "one.gguf", vocab_model="llama")
    reader = gguf.GGUFReader(str(folder / "one.gguf"))
    w = gguf.GGUFWriter(str(folder / "tiny-Q8_0.gguf"), "qwen2",
                        split_max_tensors=len(reader.tensors) // 2 + 1)
    for key, f in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = {p.name: p.read_bytes() for p in sorted(folder.glob("tiny-Q8_0-*.gguf"))}
    assert len(shards) == 2
    return model, (folder / "one.gguf").read_bytes(), shards


@pytest.fixture()
def hub(tiny, tiny_gguf, tmp_path, monkeypatch):
    _, one, shards = tiny_gguf
    repos = {
        "org/tiny": Repo(dict(tiny[2])),
        "org/gated": Repo(dict(tiny[2]), gated_token="hf_right"),
        "org/tiny-GGUF": Repo({"tiny-q4_k_m.gguf": one, **shards, "README.md": b"#",
                               "mmproj-tiny-f16.gguf": b"a vision part"}),
        "org/two-GGUF": Repo({"a-Q5_K_M.gguf": one, "b-Q5_K_M.gguf": one}),
        "org/torn-GGUF": Repo({"tiny-Q8_0-00001-of-00002.gguf": shards[min(shards)]}),
    }
    with HubServer(repos) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("FLEXGEN_INFINIGEN_CACHE", str(tmp_path / "cache"))
        for var in ("HF_HUB_CACHE", "HF_TOKEN", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(var, raising=False)
        yield server


def _tokens(model: str, steps: int = 5):
    with OffloadedLM.load(model=model, policy=Placement(), progress=False) as lm:
        out = lm.generate([PROMPT], steps, stop_token_id=None)
        return lm.encode([PROMPT])[0], out.token_ids[0]


def _run(*args: str) -> int:
    from flexgen_infinigen import run

    return run.main(["--prompt", PROMPT, "--gen-len", "2", "--no-stop", *args])


def _one_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


def _stores(tmp_path: Path) -> list[Path]:
    root = tmp_path / "cache" / "stores"
    return [p for p in root.iterdir() if (p / MANIFEST).exists()] if root.exists() else []


def test_download_layout_tokens_and_offline_reuse(hub, tiny, tmp_path, monkeypatch):
    model, folder, files = tiny
    ids, tokens = _tokens("org/tiny")
    assert tokens == hf_greedy(model, ids, 5)[0]
    assert _tokens(str(folder)) == (ids, tokens)  # the same files as a local folder

    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    sha = hub.repos["org/tiny"].sha
    assert (repo / "refs" / "main").read_text() == sha
    fetched = sorted(p.name for p in (repo / "snapshots" / sha).iterdir())
    wanted = sorted(n for n in files if n.endswith((".safetensors", ".json")) and "/" not in n)
    assert fetched == wanted  # config, tokenizer, index and shards; no README, .bin, original/
    assert [p for p in (repo / "blobs").iterdir() if p.name.endswith(".incomplete")] == []

    before = len(hub.requests)  # online again: the commit is checked, no file is fetched
    assert _tokens("org/tiny") == (ids, tokens)
    assert not [r for r in hub.requests[before:] if r[0] == "GET" and "/resolve/" in r[1]]

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(hub.requests)
    assert _tokens("org/tiny") == (ids, tokens)
    assert len(hub.requests) == before  # the second run: no request at all
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert _run("--model", "org/tiny", "--offline") == 0
    assert len(hub.requests) == before
    os.environ.pop("HF_HUB_OFFLINE", None)  # what --offline set for this process

    monkeypatch.setenv("HF_ENDPOINT", _dead_endpoint())  # the Hub unreachable: the cache serves
    assert _tokens("org/tiny") == (ids, tokens)


def test_a_cut_connection_resumes(hub, tiny, monkeypatch):
    """The server promises a shard whole and hangs up half-way: the client asks for the rest
    only (a Range request from what it kept) and the model loads right."""
    from huggingface_hub import constants

    # the client keeps what it received in chunks (10 MB); 4 kB ones fit a tiny shard
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    model, _, files = tiny
    shard = next(n for n in files if n.startswith("model-0000"))
    hub.cut_once.add(shard)
    ids, tokens = _tokens("org/tiny")
    assert tokens == hf_greedy(model, ids, 5)[0]
    gets = [r for r in hub.requests if r[0] == "GET" and r[1].endswith(shard)]
    assert len(gets) == 2 and gets[0][2] is None  # the whole file, then the rest only
    kept = int(gets[1][2].removeprefix("bytes=").rstrip("-"))
    assert 0 < kept <= len(files[shard]) // 2


def test_gguf_by_quantization_file_and_split(hub, tiny_gguf, capsys):
    model = tiny_gguf[0]
    from test_gguf_families import PROMPT as IDS

    reference = hf_greedy(model, IDS, 4)[0]
    for name in ("org/tiny-GGUF:Q4_K_M", "org/tiny-GGUF/tiny-q4_k_m.gguf", "org/tiny-GGUF:q8_0"):
        with OffloadedLM.load(model=name, policy=Placement(), progress=False) as lm:
            assert lm.generate([IDS], 4, stop_token_id=None).token_ids[0] == reference, name
    fetched = {r[1].rsplit("/", 1)[-1] for r in hub.requests if r[0] == "GET"}
    assert {"tiny-Q8_0-00001-of-00002.gguf", "tiny-Q8_0-00002-of-00002.gguf"} <= fetched
    assert "mmproj-tiny-f16.gguf" not in fetched and "README.md" not in fetched
    joined = default_cache_dir() / "gguf-joined"
    assert not joined.exists()  # the shards are read where the Hub cache keeps them


@pytest.mark.parametrize("model, expected", [
    ("org/missing", "no repository org/missing on http://127.0.0.1"),
    ("org/gated", "gated repository; accept its license at http://127.0.0.1"),
    ("org/tiny@v9", "has no revision 'v9'"),
    ("org/tiny-GGUF:Q2_K", "no GGUF file for quantization Q2_K; the repository has Q4_K_M, "
                           "Q8_0"),
    ("org/two-GGUF:Q5_K_M", "quantization Q5_K_M matches 2 GGUF files (a-Q5_K_M.gguf, "
                            "b-Q5_K_M.gguf); name one with org/name/FILE.gguf"),
    ("org/two-GGUF", "pick one with org/name:QUANT (Q5_K_M)"),
    ("org/torn-GGUF:Q8_0", "shard 2 of 2 of tiny-Q8_0 is missing"),
])
def test_each_failure_is_one_error_line_before_any_conversion(hub, tmp_path, capsys, model,
                                                             expected):
    assert _run("--model", model) == 2
    line = _one_error(capsys)
    assert expected in line, line
    assert "HF_TOKEN" in line or "gated" not in model
    assert _stores(tmp_path) == []


def test_gated_repo_with_its_token(hub, tiny, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert _run("--model", "org/gated") == 2
    assert "HF_TOKEN is set, so accept its license" in _one_error(capsys)
    monkeypatch.setenv("HF_TOKEN", "hf_right")
    assert _run("--model", "org/gated") == 0


def _dead_endpoint() -> str:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_no_network_or_offline_and_not_cached(hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", _dead_endpoint())
    assert _run("--model", "org/tiny") == 2
    line = _one_error(capsys)
    assert "cannot be reached" in line and "not in the cache" in line
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _run("--model", "org/tiny") == 2
    assert "offline (HF_HUB_OFFLINE or --offline) and not in the cache" in _one_error(capsys)
    assert hub.requests == []


def test_a_full_disk_mid_download_leaves_nothing_to_find(hub, tiny, tmp_path):
    """The download runs in a process whose files may not grow past 20 kB (as a full disk
    refuses a write): one error line, no store, no partial file in the cache; the next run
    fetches what is missing and works."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a refused write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-m", "flexgen_infinigen.run", "--model", "org/tiny",
                           "--prompt", PROMPT, "--gen-len", "2"], env=env, preexec_fn=limit,
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "no room to write the download" in errors[0] and "HF_HUB_CACHE" in errors[0]
    assert _stores(tmp_path) == []
    blobs = tmp_path / "hf" / "hub" / "models--org--tiny" / "blobs"
    assert not any(p.name.endswith(".incomplete") for p in blobs.iterdir())
    assert all(p.stat().st_size <= 20_000 for p in blobs.iterdir())
    assert _run("--model", "org/tiny") == 0


def test_names_that_need_only_shapes(hub, tiny):
    """A registry alias with --dummy or in planning stays the registry's (no request); a Hub
    checkpoint that only needs shapes sends for its config.json and nothing else."""
    from flexgen_infinigen import run
    from flexgen_infinigen.engine.loading import find_weights, model_config

    assert model_config("facebook/opt-13b", shapes_only=True).name == "opt-13b"
    assert find_weights("facebook/opt-125m", None, True)[0].name == "opt-125m"
    assert hub.requests == []
    cfg = model_config("org/tiny", shapes_only=True)  # what `optimize` plans with
    assert (cfg.name, cfg.num_layers, cfg.hidden_size) == ("tiny", 2, 64)
    assert run.main(["--dummy", "--model", "org/tiny", "--prompt-len", "4", "--gen-len",
                     "1"]) == 0
    files = {r[1].rsplit("/", 1)[-1] for r in hub.requests if "/resolve/" in r[1]}
    assert files == {"config.json"}


def test_every_command_takes_a_hub_name(hub, tiny, tmp_path, monkeypatch, capsys):
    """One download, then batch, eval, skew and the lm-eval model all find it offline: the
    name is resolved in one place below the commands."""
    import json

    from flexgen_infinigen import batch, eval as eval_cmd, calibrate as skew

    assert _run("--model", "org/tiny") == 0
    seen = len(hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": PROMPT, "gen_len": 2}) + "\n")
    assert batch.main(["--model", "org/tiny", "--input", str(prompts), "--output", str(out),
                       "--no-chat"]) == 0
    assert json.loads(out.read_text())["id"] == "a"
    text = tmp_path / "text.txt"
    text.write_text(" ".join(WORDS[i % 200 + 1] for i in range(64)))
    assert eval_cmd.main(["perplexity", "--model", "org/tiny", "--text", str(text),
                          "--seq-len", "16", "--prefill-len", "8", "--max-windows", "1"]) == 0
    assert skew.main(["--model", "org/tiny", "--max-tokens", "16"]) == 0
    pytest.importorskip("lm_eval")
    from flexgen_infinigen.harness import OffloadedHarnessLM

    assert OffloadedHarnessLM(model="org/tiny", offline="true").lm.cfg.name == "tiny"
    assert len(hub.requests) == seen
    assert "error" not in capsys.readouterr().err


def test_names_and_picks_without_a_hub(tmp_path, monkeypatch):
    from flexgen_infinigen.config import ConfigError
    from flexgen_infinigen.weights.hub_files import HubName, choose_gguf, parse_hub_name
    from flexgen_infinigen.weights.local_model import is_model_path

    assert parse_hub_name("Qwen/Qwen2.5-7B-Instruct") == HubName("Qwen/Qwen2.5-7B-Instruct")
    assert parse_hub_name("org/m-GGUF@v1.0:q4_k_m") == HubName("org/m-GGUF", "v1.0", "q4_k_m")
    assert parse_hub_name("org/m@refs/pr/3") == HubName("org/m", "refs/pr/3")
    assert parse_hub_name("org/m/sub/x-Q8_0.gguf") == HubName("org/m", None, None,
                                                              "sub/x-Q8_0.gguf")
    for path in ("./org/m", "/abs/m", "~/m", "models/tiny.gguf", "opt-13b", "a/b/c"):
        assert parse_hub_name(path) is None, path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "m").mkdir(parents=True)  # a local folder wins over the Hub
    assert is_model_path("org/m") and parse_hub_name("org/m") is not None
    assert not is_model_path("opt-13b") and not is_model_path("facebook/opt-13b", True)
    assert is_model_path("facebook/opt-13b")

    files = ["m-Q4_K.gguf", "m-Q4_K_M.gguf", "sub/m-IQ4_XS-00002-of-00002.gguf",
             "sub/m-IQ4_XS-00001-of-00002.gguf", "mmproj-m-f16.gguf"]
    assert choose_gguf("x", files, "q4_k", None) == ["m-Q4_K.gguf"]
    assert choose_gguf("x", files, "Q4_K_M", None) == ["m-Q4_K_M.gguf"]
    assert choose_gguf("x", files, "iq4_xs", None) == ["sub/m-IQ4_XS-00001-of-00002.gguf",
                                                       "sub/m-IQ4_XS-00002-of-00002.gguf"]
    assert choose_gguf("x", files, None, "sub/m-IQ4_XS-00002-of-00002.gguf")[0].endswith(
        "00001-of-00002.gguf")
    with pytest.raises(ConfigError, match="no GGUF file for quantization F16; the repository "
                                          "has IQ4_XS, Q4_K, Q4_K_M"):
        choose_gguf("x", files, "F16", None)
