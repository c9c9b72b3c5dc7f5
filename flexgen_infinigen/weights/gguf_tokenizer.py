"""A Hugging Face ``tokenizer.json`` rebuilt from a GGUF file's tokenizer metadata.

A GGUF carries its vocabulary as arrays (``tokenizer.ggml.tokens``, ``.merges``,
``.scores``, ``.token_type``) plus two names: ``tokenizer.ggml.model`` (``gpt2``:
byte-level BPE; ``llama``: SentencePiece BPE with byte fallback) and, for byte-level
vocabularies, ``tokenizer.ggml.pre``, the rule that cuts text into words before the
merges run. The rule matters: the merges were learned on words cut that way, and a
different cut gives a different (longer) token sequence than the model was trained on.

Each pre-tokenizer type maps to the ``tokenizers`` components that reproduce it
(:data:`PRE_TOKENIZERS`); a type we do not know is one error naming it, unless the user
picks a rule with ``pre_override`` (``convert --pre-tokenizer TYPE``).
"""
from __future__ import annotations

from ..config import ConfigError

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4

# Word-splitting regexes of the model families, as their published tokenizers define them.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: Qwen2's, combining marks kept with the letters they follow
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek LLM (7B/67B): newlines alone, letter runs, punctuation runs, trailing spaces,
# CJK runs and digit runs, each isolated, then byte-level without GPT-2's regex.
_DEEPSEEK_LLM = [
    r"[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\x{1F7D}ᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-\x{1FD3}ῖ-\x{1FDB}ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",  # noqa: E501
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
]

# pre-tokenizer type -> (kind, regex or regexes); kinds are built by _pre_tokenizer
PRE_TOKENIZERS: dict[str, tuple[str, object]] = {
    "default": ("gpt2", None), "gpt2": ("gpt2", None), "gpt-2": ("gpt2", None),
    "smollm": ("digits+gpt2", None), "starcoder": ("digits+gpt2", None),
    "refact": ("digits+gpt2", None),
    "llama-bpe": ("split", _LLAMA3), "llama3": ("split", _LLAMA3),
    "llama-v3": ("split", _LLAMA3), "smaug-bpe": ("split", _LLAMA3),
    "dbrx": ("split", _LLAMA3), "falcon3": ("split", _LLAMA3),
    "qwen2": ("split", _QWEN2), "deepseek-r1-qwen": ("split", _QWEN2),
    "megrez": ("split", _QWEN2), "qwen35": ("split", _QWEN35),
    "tekken": ("split", _TEKKEN),
    "gpt-4o": ("split", _GPT4O), "llama4": ("split", _GPT4O),
    "deepseek-llm": ("splits", _DEEPSEEK_LLM),
}


def _byte_alphabet() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise ConfigError(f"the GGUF's pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not one "
                          f"this runtime reproduces ({known}); pass --pre-tokenizer TYPE to "
                          "convert with the rule of a type you know to match")
    kind, rule = PRE_TOKENIZERS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind.endswith("gpt2"))
    if kind == "gpt2":
        return byte_level
    if kind == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    rules = [rule] if kind == "split" else rule
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rules]
    return pre_tokenizers.Sequence([*splits, byte_level])


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _merges(reader, tokens: list[str], scores: list[float] | None) -> list[tuple[str, str]]:
    """The file's merges, or (SentencePiece files without them) merges implied by the vocabulary:
    every split of a token into two vocabulary pieces, the best-scored token merged first."""
    listed = _field(reader, "tokenizer.ggml.merges")
    if listed:
        merges = [tuple(m.split(" ")) for m in listed]
        if any(len(m) != 2 for m in merges):
            raise ConfigError("GGUF tokenizer has malformed merges; re-download the GGUF file")
        return merges
    if scores is None:
        raise ConfigError("the GGUF's SentencePiece vocabulary has neither merges nor scores; "
                          "the tokenizer cannot be rebuilt (re-download the file)")
    index = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in index and token[i:] in index]
        pairs.sort(key=lambda p: (index[p[0]], index[p[1]]))
        found += [(left, right, score) for left, right in pairs]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _special_tokens(tok, tokens, types, byte_level: bool) -> None:
    """Control tokens become special added tokens (matched whole, dropped when decoding),
    user-defined ones plain added tokens (matched whole, kept)."""
    from tokenizers import AddedToken

    alphabet = set(_byte_alphabet().values()) if byte_level else None
    # a byte-level "control" token spelled outside the byte alphabet is a mislabel in the file
    control = [t for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL
               and (alphabet is None or set(t) <= alphabet)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _byte_level(reader, tokens, types, pre: str):
    from tokenizers import Tokenizer, decoders, models

    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # vocabularies written with raw characters instead of the byte alphabet are respelled
    vocab = {(t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(reader, tokens, None),
                               fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    _special_tokens(tok, tokens, types, byte_level=True)
    return tok


def _sentencepiece(reader, tokens, types):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    scores = _field(reader, "tokenizer.ggml.scores")
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(reader, tokens, scores),
                               unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    _special_tokens(tok, tokens, types, byte_level=False)
    return tok


def tokenizer_from_gguf(reader, pre_override: str | None = None):
    """A ``tokenizers.Tokenizer`` equal to the GGUF's, or None when the file has no vocabulary.

    ``pre_override`` replaces the file's ``tokenizer.ggml.pre`` (for types not in
    :data:`PRE_TOKENIZERS` whose rule the user knows)."""
    from tokenizers import processors

    kind = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        return None
    tokens = list(tokens)
    types = list(_field(reader, "tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens)))
    if kind == "gpt2":
        tok = _byte_level(reader, tokens, types,
                          pre_override or _field(reader, "tokenizer.ggml.pre", "default"))
    elif kind == "llama":
        tok = _sentencepiece(reader, tokens, types)
    else:
        raise ConfigError(f"the GGUF's tokenizer model {kind!r} (tokenizer.ggml.model) is not "
                          "supported (byte-level 'gpt2' and SentencePiece 'llama' are); run "
                          "with token ids (--prompt-len) or convert the Hugging Face checkpoint")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if add_bos(reader) and bos is not None:
        # "this model wants a BOS", said the way tokenizer.json files say it
        tok.post_processor = processors.TemplateProcessing(
            single=[tokens[bos], "$A"], pair=[tokens[bos], "$A", "$B"],
            special_tokens=[(tokens[bos], int(bos))])
    return tok


def add_bos(reader) -> bool:
    """Whether prompts start with BOS: the file's flag, else True for SentencePiece (the
    convention llama.cpp and transformers follow for files that do not say)."""
    flag = _field(reader, "tokenizer.ggml.add_bos_token")
    if flag is not None:
        return bool(flag)
    return _field(reader, "tokenizer.ggml.model") == "llama"


def special_ids(reader) -> dict[str, int]:
    """The special token ids the file names (bos, eos, eot, pad, unk), those present."""
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id",
            "pad": "padding_token_id", "unk": "unknown_token_id", "eom": "eom_token_id"}
    out = {}
    for name, key in keys.items():
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            out[name] = int(value)
    return out
