"""Text <-> token ids through Hugging Face ``tokenizers``, found next to the weights.

Nothing here touches the network: a tokenizer comes from a weight store's
``tokenizer.json`` or from a local Hugging Face checkpoint folder, or not at all
(``load_tokenizer`` returns None and callers work with token ids).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..config import ModelConfig
from . import harmony

MANIFEST = "manifest.json"  # mirrors weights.store.MANIFEST without importing numpy
# special tokens that end a chat turn in the templates of common model families
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                   "<|endoftext|>")
# a harmony model (gpt-oss) ends its answer with these; its <|end|> closes one message of an
# answer that goes on (the reasoning, before the final message)
HARMONY_ENDS = (harmony.RETURN, harmony.CALL, "<|endoftext|>")


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` that knows the model's special ids."""

    def __init__(self, tok, add_bos: bool = False, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None):
        self.tok = tok
        self.add_bos = add_bos and bos_token_id is not None
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id if pad_token_id is not None else eos_token_id
        self._control_texts: list[str] | None = None
        self._text_only = None
        # ids that end generation: EOS, and the turn-end tokens the vocabulary has as specials
        specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        self.harmony = harmony.CHANNEL in specials and harmony.MESSAGE in specials
        ends = HARMONY_ENDS if self.harmony else TURN_END_TOKENS
        self.stop_token_ids = {i for i in [eos_token_id, *(tok.token_to_id(t) for t in ends
                                                          if t in specials)]
                               if i is not None}
        # harmony's markers stay in the decoded text, where the answer's parts are read
        # (text.harmony); ids that never end an answer, whatever a file calls them
        self.kept_ids = {tok.token_to_id(t) for t in harmony.MARKERS if t in specials} \
            if self.harmony else set()
        self.never_stop = {tok.token_to_id(harmony.END)} if self.harmony else set()
        self.stop_token_ids -= self.never_stop

    @classmethod
    def from_file(cls, path: str | os.PathLike, cfg: ModelConfig | None = None,
                  add_bos: bool | None = None) -> Tokenizer:
        """Load a ``tokenizer.json``; ``add_bos=None`` asks the file (then the model family)."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tok = HFTokenizer.from_file(str(path))
        if add_bos is None:
            add_bos = _config_add_bos(path.parent)
        if add_bos is None:
            add_bos = _template_adds_bos(tok)
        return cls._with_ids(tok, cfg, add_bos)

    @classmethod
    def _with_ids(cls, tok, cfg: ModelConfig | None, add_bos: bool | None) -> Tokenizer:
        if add_bos is None:
            add_bos = cfg is not None and cfg.family == "opt"
        if cfg is not None:
            return cls(tok, add_bos, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
        bos = _first_id(tok, ["<s>", "<|begin_of_text|>", "<|im_start|>"])
        eos = _first_id(tok, ["</s>", "<|end_of_text|>", "<|endoftext|>"])
        return cls(tok, add_bos, bos, eos, _first_id(tok, ["<pad>"]))

    def encode(self, text: str, control_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``control_tokens=False``: control-token text in it
        (``<|im_start|>``) is encoded as the characters it is written with, as any text."""
        tok = self.tok if control_tokens else self.text_only
        ids = tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.add_bos else ids

    @property
    def control_texts(self) -> list[str]:
        """The texts of the vocabulary's control (special) tokens."""
        if self._control_texts is None:
            self._control_texts = sorted({t.content for t in
                                          self.tok.get_added_tokens_decoder().values()
                                          if t.special and t.content})
        return self._control_texts

    @property
    def text_only(self):
        """A copy of the tokenizer that reads control-token text as text (a copy, so that
        threads encoding with the original at the same time are not affected)."""
        if self._text_only is None:
            from tokenizers import Tokenizer as HFTokenizer

            tok = HFTokenizer.from_str(self.tok.to_str())
            tok.encode_special_tokens = True
            self._text_only = tok
        return self._text_only

    def encode_with_text(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """Token ids of ``text`` (no BOS added) where control-token text in ``spans``
        (character ranges: a chat's message contents) is plain text and the control tokens
        outside them are control tokens. ``tokenizers`` encodes the text between two control
        tokens on its own; this cuts at the same places, less the control tokens inside a
        span, so text without any is encoded exactly as :meth:`encode` would."""
        enc = self.tok.encode(text, add_special_tokens=False)
        specials = {self.tok.token_to_id(t) for t in self.control_texts}

        def inside(start: int, end: int) -> bool:  # any overlap: a token cut by a span too
            return any(start < b and a < end for a, b in spans)

        if not any(i in specials and inside(*at) for i, at in zip(enc.ids, enc.offsets)):
            return list(enc.ids)
        out, done = [], 0
        for i, (start, end) in zip(enc.ids, enc.offsets):
            if i in specials and not inside(start, end):
                if start > done:
                    out += self.text_only.encode(text[done:start], add_special_tokens=False).ids
                out.append(i)
                done = end
        if done < len(text):
            out += self.text_only.encode(text[done:], add_special_tokens=False).ids
        return out

    def decode(self, ids) -> str:
        """The text of ``ids``, control tokens left out (a harmony model's markers kept)."""
        ids = [int(i) for i in ids]
        if not self.kept_ids.intersection(ids):
            return self.tok.decode(ids, skip_special_tokens=True)
        out, run = [], []
        for i in ids:
            if i in self.kept_ids:  # the text on either side decodes as it would alone
                out += [self.tok.decode(run, skip_special_tokens=True), self.tok.id_to_token(i)]
                run = []
            else:
                run.append(i)
        out.append(self.tok.decode(run, skip_special_tokens=True))
        return "".join(out)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)


def _first_id(tok, candidates: list[str]) -> int | None:
    for text in candidates:
        idx = tok.token_to_id(text)
        if idx is not None:
            return idx
    return None


def _config_add_bos(folder: Path) -> bool | None:
    """``add_bos_token`` from a checkpoint's tokenizer_config.json, when it says."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("add_bos_token")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, bool) else None


def _template_adds_bos(tok) -> bool | None:
    """True when the file's post-processor is a template that starts with a special token."""
    proc = json.loads(tok.to_str()).get("post_processor") or {}
    if proc.get("type") == "Sequence":
        procs = proc.get("processors", [])
        proc = next((p for p in procs if p.get("type") == "TemplateProcessing"), {})
    if proc.get("type") != "TemplateProcessing":
        return None
    single = proc.get("single") or [{}]
    return "SpecialToken" in single[0]


def _byte_level_bpe(folder: Path, cfg: ModelConfig | None, add_bos: bool | None) -> Tokenizer:
    """A GPT-2 style tokenizer from ``vocab.json`` + ``merges.txt`` (what OPT ships)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    model = models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
    tok = HFTokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t in ("<s>", "<pad>", "</s>", "<unk>", "<|endoftext|>")
                if tok.token_to_id(t) is not None]
    if cfg is not None:  # the model's own special ids must decode to nothing, too
        ids = (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
        specials += [t for t in map(tok.id_to_token, ids) if t is not None]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return Tokenizer._with_ids(tok, cfg, add_bos)


def load_tokenizer(store_or_folder, cfg: ModelConfig | None = None) -> Tokenizer | None:
    """The tokenizer of a weight store (object or folder) or of a HF checkpoint folder, or None."""
    if store_or_folder is None:
        return None
    if hasattr(store_or_folder, "manifest"):  # an open WeightStore
        return load_tokenizer(store_or_folder.path, cfg or store_or_folder.config)
    folder = Path(store_or_folder)
    if folder.is_file():  # a tokenizer.json passed directly
        return Tokenizer.from_file(folder, cfg)
    manifest = folder / MANIFEST
    if manifest.is_file():
        info = json.loads(manifest.read_text())
        if cfg is None and "config" in info:
            cfg = ModelConfig.from_dict(info["config"])
        name = info.get("tokenizer")
        tok = _from_store_file(folder / name if name else None, cfg)
        if tok is not None:  # a GGUF's end-of-turn ids stop generation too
            ids = info.get("special_ids") or {}
            tok.stop_token_ids |= {ids[k] for k in ("eos", "eot", "eom") if k in ids}
            tok.stop_token_ids -= tok.never_stop
        return tok
    if (folder / "tokenizer.json").is_file():
        return Tokenizer.from_file(folder / "tokenizer.json", cfg)
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return _byte_level_bpe(folder, cfg, _config_add_bos(folder))
    return None


def _from_store_file(path: Path | None, cfg: ModelConfig | None) -> Tokenizer | None:
    return Tokenizer.from_file(path, cfg) if path is not None and path.is_file() else None
