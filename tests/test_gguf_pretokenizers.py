"""GGUF tokenizers against transformers' GGUF reader, one pre-tokenizer type at a time.

Each test writes a small GGUF with the ``gguf`` package: a byte-level BPE vocabulary trained
here (with the type's own word split, so that the merges cross what other rules would split:
multi-digit numbers, ``\\n\\n``, runs of spaces), or a SentencePiece vocabulary with scores
and byte tokens. transformers builds its tokenizer from the same file independently.
The real Qwen2.5 GGUF is checked when ``FLEXGEN_INFINIGEN_QWEN_GGUF`` names it.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from flexgen_infinigen.config import ConfigError
from flexgen_infinigen.text.tokenizer import Tokenizer
from flexgen_infinigen.weights import gguf_tokenizer
from flexgen_infinigen.weights.gguf_tokenizer import PRE_TOKENIZERS, tokenizer_from_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
QWEN_ENV = "FLEXGEN_INFINIGEN_QWEN_GGUF"

TEXT = ("def fibonacci(n):\n\tif n < 2:\n        return n\n\n\n    return fib(n-1) + fib(n-2)\r\n"
        "In 2024 there were 366 days; 3.14159 * 12345678 = 38,271,593 and 7 > 42.\n\n"
        "It's here, they'll see, we've done, I'M SURE she'd DON'T.   Spaces    and\ttabs\t\t!\n"
        "naïve café — Straße, 日本語のテキストと中文字符, 한국어 텍스트, Ελληνικά, "
        "русский язык 🙂🚀\n")
PIECES = ["x  >  1", "a   \nb\t\t c", "  leading", "trailing   ", "1234567890", "\n\n\n",
          "A\r\n\r\nB", "don't", "<|e|>tail<|e|>"]


def _train_byte_level(pre_tokenizer, vocab_size=600):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 20 + PIECES * 5, trainer)
    data = tok.to_str()
    import json
    model = json.loads(data)["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [t for t, _ in vocab], merges


def _write_gguf(path: Path, tokens, types, pre=None, merges=None, scores=None, model="gpt2",
                bos=None, eos=None, unk=None, add_bos=None, template=None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    for value, add in ((bos, w.add_bos_token_id), (eos, w.add_eos_token_id),
                       (unk, w.add_unk_token_id)):
        if value is not None:
            add(value)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _reference(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _byte_level_gguf(tmp_path, pre: str):
    ours_pre = gguf_tokenizer._pre_tokenizer(pre)
    tokens, merges = _train_byte_level(ours_pre)
    tokens = tokens + ["<|e|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    return _write_gguf(tmp_path / f"{pre}.gguf", tokens, types, pre=pre, merges=merges,
                       eos=len(tokens) - 2)


# types transformers' GGUF reader splits by its own table (the independent reference)
REFERENCE_TYPES = ["default", "gpt2", "llama-bpe", "qwen2", "tekken", "gpt-4o",
                   "deepseek-r1-qwen"]


@pytest.mark.parametrize("pre", REFERENCE_TYPES)
def test_byte_level_types_equal_transformers(tmp_path, pre):
    path = _byte_level_gguf(tmp_path, pre)
    ours = tokenizer_from_gguf(gguf.GGUFReader(path))
    ref = _reference(path)
    for text in [TEXT, *PIECES, TEXT[::-1]]:
        got = ours.encode(text, add_special_tokens=False).ids
        assert got == ref.encode(text, add_special_tokens=False), (pre, text)
        assert ours.decode(got, skip_special_tokens=False) == text


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_listed_type_builds_and_round_trips(pre):
    """Each listed rule compiles and its pieces cover the text exactly (byte-level)."""
    pieces = gguf_tokenizer._pre_tokenizer(pre).pre_tokenize_str(TEXT)
    alphabet = {c: b for b, c in gguf_tokenizer._byte_alphabet().items()}
    joined = bytes(alphabet[c] for piece, _ in pieces for c in piece)
    assert joined.decode("utf-8") == TEXT


def test_types_differ_where_they_should(tmp_path):
    """The rules are not one rule: on the same vocabulary, Qwen2's single digits and
    Llama 3's groups of three give different ids for a long number."""
    path = _byte_level_gguf(tmp_path, "llama-bpe")
    reader = gguf.GGUFReader(path)
    llama3 = tokenizer_from_gguf(reader).encode("12345678", add_special_tokens=False).ids
    qwen2 = tokenizer_from_gguf(reader, "qwen2").encode("12345678", add_special_tokens=False).ids
    assert len(qwen2) == 8 and len(llama3) == 3 and llama3 != qwen2


def test_smollm_splits_single_digits_first(tmp_path):
    """``smollm`` (and ``starcoder``): every digit alone, then GPT-2's split, as SmolLM2's
    own tokenizer and llama.cpp do. transformers' GGUF reader does not know the type and
    uses GPT-2's split only, so it is the reference with that digit step added."""
    from tokenizers import pre_tokenizers

    path = _byte_level_gguf(tmp_path, "smollm")
    ours = tokenizer_from_gguf(gguf.GGUFReader(path))
    ref = _reference(path).backend_tokenizer
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), ref.pre_tokenizer])
    for text in [TEXT, *PIECES]:
        assert ours.encode(text, add_special_tokens=False).ids == \
            ref.encode(text, add_special_tokens=False).ids, text
    pieces = [p for p, _ in ours.pre_tokenizer.pre_tokenize_str("in 2024")]
    assert pieces == ["in", "Ġ", "2", "0", "2", "4"]


def test_deepseek_llm_word_split():
    """transformers has no rule for ``deepseek-llm``; the expected cuts are written out by
    hand from DeepSeek LLM's published split: newlines alone, letters with one leading
    space, punctuation runs with one, CJK runs and digit runs alone."""
    pre = gguf_tokenizer._pre_tokenizer("deepseek-llm")
    cut = [p for p, _ in pre.pre_tokenize_str("Hi there,\n2024年日本 ok!!")]
    space = "\u0120"
    assert cut == ["Hi", f"{space}there", ",", "\u010a", "2024",
                   "å¹´æĹ¥æľ¬", f"{space}ok", "!!"]


def test_unknown_pre_tokenizer_is_one_error(tmp_path):
    path = _write_gguf(tmp_path / "odd.gguf", ["a", "b", "ab"], [1, 1, 1], pre="made-up-v9",
                       merges=["a b"])
    with pytest.raises(ConfigError, match="'made-up-v9'.*--pre-tokenizer"):
        tokenizer_from_gguf(gguf.GGUFReader(path))
    tok = tokenizer_from_gguf(gguf.GGUFReader(path), pre_override="gpt2")  # the opt-in
    assert tok.encode("abab", add_special_tokens=False).ids == [2, 2]


def _sentencepiece_vocab():
    """A SentencePiece-style BPE vocabulary: <unk>, <s>, </s>, 256 byte tokens, then pieces
    learned on TEXT with the ▁ word marker, scored best-first (no merges in the file)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False)
    tok.train_from_iterator([TEXT.replace("🙂🚀", "")] * 10, trainer)
    pieces = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [p for p, _ in pieces if p not in tokens]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, types, scores


def test_sentencepiece_equals_transformers(tmp_path):
    tokens, types, scores = _sentencepiece_vocab()
    path = _write_gguf(tmp_path / "spm.gguf", tokens, types, model="llama", scores=scores,
                       bos=1, eos=2, unk=0)
    ours = tokenizer_from_gguf(gguf.GGUFReader(path))
    ref = _reference(path)
    for text in [TEXT, *PIECES, "  two leading", "x"]:
        got = ours.encode(text, add_special_tokens=False).ids
        assert got == ref.encode(text, add_special_tokens=False), text
    emoji = ours.encode("🙂", add_special_tokens=False).ids  # not in the vocabulary
    assert [tokens[i] for i in emoji[-4:]] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert ours.decode(ours.encode("naïve 🙂 x", add_special_tokens=False).ids) == "naïve 🙂 x"


def test_special_ids_bos_and_stop_tokens(tmp_path):
    tokens, types, scores = _sentencepiece_vocab()
    path = _write_gguf(tmp_path / "spm.gguf", tokens, types, model="llama", scores=scores,
                       bos=1, eos=2, unk=0)
    reader = gguf.GGUFReader(path)
    assert gguf_tokenizer.add_bos(reader)  # SentencePiece files that do not say: BOS
    assert gguf_tokenizer.special_ids(reader) == {"bos": 1, "eos": 2, "unk": 0}
    file = tmp_path / "tokenizer.json"
    file.write_text(tokenizer_from_gguf(reader).to_str(), encoding="utf-8")
    tok = Tokenizer.from_file(file)
    assert tok.add_bos and tok.encode("x")[0] == 1
    # a byte-level file that says add_bos False, with <|im_end|> as a control token
    path = _byte_level_gguf(tmp_path, "qwen2")
    reader = gguf.GGUFReader(path)
    assert not gguf_tokenizer.add_bos(reader)
    file.write_text(tokenizer_from_gguf(reader).to_str(), encoding="utf-8")
    tok = Tokenizer.from_file(file)
    n = len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents())
    assert tok.tok.token_to_id("<|im_end|>") == n - 1
    assert n - 1 in tok.stop_token_ids  # a chat turn's end stops generation


def _qwen_gguf() -> Path:
    value = os.environ.get(QWEN_ENV)
    if not value or not Path(value).is_file():
        pytest.skip(f"set {QWEN_ENV} to the Qwen2.5-Coder-0.5B-Instruct GGUF "
                    "(../shared/models/qwen2.5-coder-0.5b.sh assembles it)")
    return Path(value)


def test_real_qwen25_equals_transformers():
    path = _qwen_gguf()
    reader = gguf.GGUFReader(path)
    assert gguf_tokenizer._field(reader, "tokenizer.ggml.pre") == "qwen2"
    ours = tokenizer_from_gguf(reader)
    ref = _reference(path)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    engine = Path(__file__).resolve().parents[1] / "flexgen_infinigen" / "engine" / "schedule.py"
    code = engine.read_text()
    texts = [readme, code, TEXT, "def fibonacci(n):"]
    wiki = SHARED / "data" / "wikitext2_test.txt"
    if wiki.is_file():
        texts.append(wiki.read_text(encoding="utf-8")[:50_000])
    for text in texts:
        assert ours.encode(text, add_special_tokens=False).ids == \
            ref.encode(text, add_special_tokens=False), text[:60]
    assert ours.encode("def fibonacci(n):", add_special_tokens=False).ids == \
        [750, 75698, 1445, 1648]


def test_real_smollm2_equals_its_reference():
    """The default model's GGUF (fetched by the first run; CI runs it before the tests):
    transformers' GGUF reader plus the ``smollm`` digit step (see the test above) gives the
    same ids as ours on the README, code and, when present, 50,000 characters of WikiText-2."""
    from tokenizers import pre_tokenizers

    from flexgen_infinigen.weights import embedded

    path = embedded._gguf_from_env() or embedded.default_cache_dir() / embedded.GGUF_NAME
    if not Path(path).is_file():
        pytest.skip(f"{path} is absent: `python -m flexgen_infinigen.run` fetches it")
    path = Path(path)
    reader = gguf.GGUFReader(path)
    assert gguf_tokenizer._field(reader, "tokenizer.ggml.pre") == "smollm"
    ours = tokenizer_from_gguf(reader)
    ref = _reference(path).backend_tokenizer
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), ref.pre_tokenizer])
    root = Path(__file__).resolve().parents[1]
    texts = [(root / "README.md").read_text(encoding="utf-8"), TEXT,
             (root / "flexgen_infinigen" / "engine" / "schedule.py").read_text(encoding="utf-8")]
    wiki = SHARED / "data" / "wikitext2_test.txt"
    if wiki.is_file():
        texts.append(wiki.read_text(encoding="utf-8")[:50_000])
    for text in texts:
        assert ours.encode(text, add_special_tokens=False).ids == \
            ref.encode(text, add_special_tokens=False).ids, text[:60]
