"""GGUF conversion, the embedded SmolLM2 store, and the tokenizer wrapper."""
from __future__ import annotations

import json

import numpy as np
import pytest

from flexgen_infinigen.config import KNOWN_MODELS, ConfigError, get_config
from flexgen_infinigen.text.tokenizer import Tokenizer, load_tokenizer
from flexgen_infinigen.weights import embedded, gguf_convert
from flexgen_infinigen.weights.store import StoreWriter, WeightStore

gguf = pytest.importorskip("gguf")

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It wasn't amused, was it?",
    "In 2024 there were 366 days; 3.14159 * 2 = 6.28318 and 1,000,000 > 999.",
    "naïve café — Straße, 日本語のテキスト, emoji 🙂🚀 and Ελληνικά.",
    "def f(x):\n\tif x  >  1:\n        return x ** 2\n\n\n    # trailing   \n",
    "   leading spaces, trailing spaces   ",
    "",
]


@pytest.fixture(scope="module")
def store() -> WeightStore:
    try:
        path = embedded.default_model_store(progress=False)
    except (ConfigError, OSError) as e:
        pytest.skip(f"default model store unavailable: {e}")
    return WeightStore(path)


@pytest.fixture(scope="module")
def floats(smollm2_store) -> WeightStore:
    """The same weights expanded to float32 by ``gguf``'s own dequantizer (conftest)."""
    return WeightStore(smollm2_store)


@pytest.fixture(scope="module")
def gguf_path(store):
    return embedded.default_gguf(embedded.default_cache_dir())


@pytest.fixture(scope="module")
def reader(gguf_path):
    return gguf.GGUFReader(gguf_path)


@pytest.fixture(scope="module")
def tok(store) -> Tokenizer:
    t = load_tokenizer(store.path, store.config)
    assert t is not None, "the converted store has no tokenizer.json"
    return t


def _raw(reader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    return w.reshape(tuple(int(d) for d in reversed(t.shape)))


# --- (a) weights -----------------------------------------------------------------------------

def test_store_matches_known_config(store):
    from flexgen_infinigen.models import llama

    assert store.config == KNOWN_MODELS["smollm2-135m"]
    store.check(llama.weight_shapes(store.config))
    # each tensor is kept as the file holds it: F32 as float32, quantized ones as their blocks
    reader = gguf.GGUFReader(embedded.default_gguf(embedded.default_cache_dir()))
    in_file = {t.tensor_type.name for t in reader.tensors}
    kept = {info.get("gguf_type", info["dtype"].upper().replace("FLOAT", "F"))
            for info in store.tensors.values()}
    assert kept == in_file, (kept, in_file)
    for info in store.tensors.values():
        assert info["dtype"] == ("uint8" if "gguf_type" in info else "float32"), info


def test_config_from_metadata(reader):
    cfg = gguf_convert.config_from_gguf(reader, None)
    known = get_config("smollm2-135m")
    assert cfg.family == "llama" and cfg.tie_word_embeddings
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "max_positions", "bos_token_id", "eos_token_id"):
        assert getattr(cfg, field) == getattr(known, field), field
    with pytest.raises(ConfigError, match="pick the matching --model"):
        gguf_convert.config_from_gguf(reader, "llama-2-7b")


def test_unpermute_is_exact_inverse(floats, reader):
    store = floats
    cfg = store.config
    rng = np.random.default_rng(0)
    x = rng.standard_normal((cfg.hidden_size, 8)).astype(np.float32)
    assert np.array_equal(
        gguf_convert.permute_rotary(gguf_convert.unpermute_rotary(x, 9), 9), x)
    assert not np.array_equal(gguf_convert.unpermute_rotary(x, 9), x)
    for layer in (0, cfg.num_layers - 1):
        for proj, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads)):
            ours = np.asarray(store.load(f"layers.{layer}.{proj}_proj.weight"))
            raw = _raw(reader, f"blk.{layer}.attn_{proj}.weight")
            assert np.array_equal(gguf_convert.permute_rotary(ours, heads), raw)
    v = np.asarray(store.load("layers.0.v_proj.weight"))
    assert np.array_equal(v, _raw(reader, "blk.0.attn_v.weight"))  # v is never permuted


def test_unpermute_matches_hf_rotate_half(floats):
    """HF LlamaForCausalLM (rotate_half RoPE) with the store weights knows that Paris is in
    France, and it predicts English far better than with llama.cpp's interleaved layout."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    store = floats
    cfg, tok = store.config, load_tokenizer(store)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=True)
    names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
             "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj"}

    def hf_state(interleaved: bool) -> dict:
        sd = {"model.embed_tokens.weight": store.load("embed.weight"),
              "model.norm.weight": store.load("final_norm.weight")}
        for i in range(cfg.num_layers):
            for ours in ("attn_norm", "q_proj", "k_proj", "v_proj", "o_proj", "mlp_norm",
                         "gate_proj", "up_proj", "down_proj"):
                w = np.asarray(store.load(f"layers.{i}.{ours}.weight"))
                if interleaved and ours in ("q_proj", "k_proj"):
                    heads = cfg.num_heads if ours == "q_proj" else cfg.num_kv_heads
                    w = gguf_convert.permute_rotary(w, heads)
                sd[f"model.layers.{i}.{names.get(ours, 'mlp.' + ours)}.weight"] = w
        return {k: torch.from_numpy(np.array(v)) for k, v in sd.items()}

    text = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, "
            "France. It is named after the engineer Gustave Eiffel, whose company designed and "
            "built the tower from 1887 to 1889.")
    ids = torch.tensor([tok.encode(text)])
    prompt = torch.tensor([tok.encode("The capital of France is")])
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    losses = []
    with torch.no_grad():
        for interleaved in (False, True):
            model.load_state_dict(hf_state(interleaved), strict=False)
            losses.append(float(model(ids, labels=ids).loss))
            if not interleaved:
                nxt = model(prompt).logits[0, -1].argmax().item()
                assert tok.decode([nxt]).strip() == "Paris"
    right, wrong = losses
    assert right < 3.0 and wrong > right + 1.0, losses


# --- (b), (c) tokenizer ----------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_known_ids(tok, reader):
    tokens = gguf_convert.field_value(reader, "tokenizer.ggml.tokens")
    ids = tok.encode("Hello world")
    assert ids == [19556, 905]
    assert [tokens[i] for i in ids] == ["Hello", "Ġworld"]
    digits = tok.encode("2024")  # Digits(individual_digits=True): one token per digit
    assert [tokens[i] for i in digits] == ["2", "0", "2", "4"]
    for text in TEXTS:
        for i in tok.encode(text):
            assert tok.tok.id_to_token(i) == tokens[i]


def test_tokenizer_special_ids(tok, store):
    assert not tok.add_bos  # SmolLM2's GGUF says add_bos_token False
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"  # special tokens are skipped
    assert load_tokenizer(store).encode("Hello world") == [19556, 905]


def test_tokenizer_matches_transformers_gguf_reader(tok, gguf_path):
    """transformers' own GGUF tokenizer converter reads vocab and merges independently.

    It ignores ``tokenizer.ggml.pre == "smollm"`` (SmolLM2's HF tokenizer and llama.cpp split
    every digit off first), so the reference gets that Digits step added before comparing.
    """
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers

    try:
        ref = transformers.AutoTokenizer.from_pretrained(gguf_path.parent,
                                                         gguf_file=gguf_path.name)
        backend = ref.backend_tokenizer
    except Exception as e:  # noqa: BLE001 - optional reference only
        pytest.skip(f"transformers cannot read the GGUF tokenizer: {e}")
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer])
    for text in TEXTS + ["x  >  1", "a   \nb\t\t c", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == backend.encode(text, add_special_tokens=False).ids, text


def test_opt_style_vocab_merges_folder(tmp_path, reader):
    tokens = gguf_convert.field_value(reader, "tokenizer.ggml.tokens")
    (tmp_path / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    merges = gguf_convert.field_value(reader, "tokenizer.ggml.merges")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    opt = load_tokenizer(tmp_path, get_config("opt-125m"))
    assert opt is not None and opt.add_bos
    assert opt.encode("Hello world") == [2, 19556, 905]
    assert opt.decode(opt.encode("Hello world")) == "Hello world"
    assert load_tokenizer(tmp_path / "nothing-here", None) is None


class _Field:
    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


class _FakeReader:
    def __init__(self, **fields):
        self.fields = {"tokenizer.ggml." + k: _Field(v) for k, v in fields.items()}


def test_gguf_add_bos_token_is_kept(tmp_path):
    reader = _FakeReader(model="gpt2", tokens=["<s>", "</s>", "a", "b", "ab"],
                         token_type=[3, 3, 1, 1, 1], merges=["a b"], bos_token_id=0,
                         add_bos_token=True)
    path = tmp_path / "tokenizer.json"
    path.write_text(gguf_convert.tokenizer_json_from_gguf(reader), encoding="utf-8")
    t = Tokenizer.from_file(path)
    assert t.add_bos and t.bos_token_id == 0 and t.eos_token_id == 1
    assert t.encode("abab") == [0, 4, 4]
    assert t.decode([0, 4, 1]) == "ab"
    assert gguf_convert.tokenizer_json_from_gguf(_FakeReader(model="llama")) is None


# --- (d) failures ----------------------------------------------------------------------------

def test_interrupted_conversion_leaves_nothing(tmp_path, gguf_path, monkeypatch):
    real_add, calls = StoreWriter.add, []

    def failing_add(self, name, array):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated interruption")
        real_add(self, name, array)

    monkeypatch.setattr(StoreWriter, "add", failing_add)
    dest = tmp_path / "store"
    with pytest.raises(KeyboardInterrupt):
        gguf_convert.convert_gguf(gguf_path, dest, name="smollm2-135m", progress=False)
    assert len(calls) == 3
    assert list(tmp_path.iterdir()) == []  # neither the store nor a partial folder
    with pytest.raises(ConfigError):
        WeightStore(dest)


def test_bad_inputs_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        gguf_convert.convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        gguf_convert.convert_gguf(not_gguf, tmp_path / "out")
    other = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(other), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="architecture 'gpt2'"):
        gguf_convert.convert_gguf(other, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2.gguf", "model.gguf"]
