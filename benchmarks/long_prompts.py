"""Natural-text prompts of an exact token length, shared by the long-context benchmarks.

Sequence i of a batch is a window of PG-19's first book (then WikiText-2, repeated if a
prompt is longer than both) starting at a different place, so that a batch's sequences
differ and attention patterns are those of real text. Without ``../shared`` a built-in
paragraph is repeated (its attention is less natural; the report says which was used).
"""
from __future__ import annotations

from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
FILES = ("pg19_firstbook.txt", "wikitext2_test.txt")


def source_text(data_dir: Path = SHARED) -> tuple[str, str]:
    """(text, name of its source)."""
    found = [data_dir / f for f in FILES if (data_dir / f).is_file()]
    if not found:
        from flexgen_infinigen.cli.prompts import FILLER_TEXT
        return FILLER_TEXT * 64, "built-in paragraph"
    return "\n\n".join(p.read_text(encoding="utf-8") for p in found), \
        " + ".join(p.name for p in found)


def natural_prompts(tokenizer, length: int, batch: int, data_dir: Path = SHARED,
                    stride: int = 1500) -> tuple[list[list[int]], str]:
    """``batch`` prompts of exactly ``length`` tokens, sequence i starting ``i * stride``
    tokens into the text; and the text's name."""
    text, name = source_text(data_dir)
    ids = tokenizer.encode(text)
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos else []
    if tokenizer.add_bos and ids[:1] == bos:
        ids = ids[1:]
    need = length + stride * (batch - 1)
    while len(ids) < need:
        ids = ids + ids
    body = length - len(bos)
    return [bos + ids[i * stride:i * stride + body] for i in range(batch)], name
