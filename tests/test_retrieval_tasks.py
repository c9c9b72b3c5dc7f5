"""The long-context retrieval tasks: prompts reproducible from their seed, of the exact
length asked, each needle's tokens where its depth says; and the scorer on hand-made outputs."""
from __future__ import annotations

import pytest

from flexgen_infinigen.cli.prompts import FILLER_TEXT
from flexgen_infinigen.evals.retrieval_tasks import TASKS, Filler, found, make_sample, score

# natural-looking filler with varied sentences (the built-in paragraph, numbered so that
# windows differ)
TEXT = " ".join(f"Chapter {i}. " + FILLER_TEXT for i in range(40))


@pytest.fixture(scope="module")
def filler(smollm2_store):
    from flexgen_infinigen.text.tokenizer import load_tokenizer

    return Filler(load_tokenizer(smollm2_store), TEXT)


@pytest.mark.parametrize("task", TASKS)
def test_a_sample_is_reproducible_and_exactly_as_long_as_asked(filler, task):
    a = make_sample(filler, task, 3000, 0.3, seed=7)
    b = make_sample(filler, task, 3000, 0.3, seed=7)
    c = make_sample(filler, task, 3000, 0.3, seed=8)
    assert a.ids == b.ids and a.answers == b.answers
    assert c.ids != a.ids and c.answers != a.answers
    assert len(a.ids) == 3000
    tok = filler.tokenizer
    if tok.add_bos:
        assert a.ids[0] == tok.bos_token_id and a.ids.count(tok.bos_token_id) == 1


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_each_needle_sits_where_its_depth_says(filler, task, depth):
    s = make_sample(filler, task, 2500, depth, seed=1)
    start, end = s.haystack
    needles = sum(map(len, s.needle_ids))
    body = end - start - needles
    for i, (pos, ids) in enumerate(zip(s.needle_starts, s.needle_ids)):
        assert s.ids[pos:pos + len(ids)] == ids
        assert start <= pos and pos + len(ids) <= end
        # filler tokens before this needle, over the filler's length
        before = pos - start - sum(len(n) for j, n in enumerate(s.needle_ids)
                                   if s.needle_starts[j] < pos)
        assert abs(before / body - s.needle_depths[i]) < 1e-9
    # the asked needle at the sentence end nearest its depth: within a sentence's length
    first = s.needle_starts[0] - start
    assert abs(first / body - depth) < 0.05, (first, body, depth)
    text = filler.tokenizer.decode(s.ids)
    for answer in s.answers:
        assert answer in text
    assert text.rstrip().endswith(("is", "are", "are:"))


def test_the_variable_chain_comes_in_order_and_every_link_is_asked(filler):
    s = make_sample(filler, "vartrack", 3000, 0.2, seed=3)
    assert s.needle_starts == sorted(s.needle_starts)
    text = filler.tokenizer.decode(s.ids)
    first, *rest = s.answers
    value = text.split(f"VAR {first} = ")[1].split(".")[0]
    assert value.isdigit() and len(value) == 7
    for a, b in zip(s.answers, rest):
        assert f"VAR {b} = VAR {a}." in text
    assert f"assigned the value {value}" in text.rsplit("Question:", 1)[1]


def test_multikey_asks_one_key_among_distractors(filler):
    s = make_sample(filler, "multikey", 3000, 0.5, seed=2)
    text = filler.tokenizer.decode(s.ids)
    question = text.rsplit("Question:", 1)[1]
    assert len(s.answers) == 1 and len(s.needle_ids) == 4
    assert text.count("special magic numbers for") == 4  # the needles (the question is singular)
    asked = question.split("number for ")[1].split(" in the text")[0]
    assert f"for {asked} is: {s.answers[0]}." in text


def test_bad_depth_and_too_short_length_are_errors(filler):
    with pytest.raises(ValueError, match="depth"):
        make_sample(filler, "single", 3000, 1.5, seed=0)
    with pytest.raises(ValueError, match="too short"):
        make_sample(filler, "multivalue", 120, 0.5, seed=0)


@pytest.mark.parametrize("text,answers,expected", [
    ("1234567.", ["1234567"], 1.0),                       # at the start
    (" is: 1234567, as said", ["1234567"], 1.0),           # inside
    (" is 7654321.", ["1234567"], 0.0),                    # missing
    (" is 123456.", ["1234567"], 0.0),                     # a partial number
    (" is 12345678.", ["1234567"], 0.0),                   # a longer number containing it
    (" is 1 234 567", ["1234567"], 0.0),                   # split digits are not the number
    ("4444444 and 5555555", ["4444444", "5555555", "6666666", "7777777"], 0.5),
    (" ABCDE, FGHIJ and klmno", ["ABCDE", "FGHIJ", "KLMNO", "PQRST"], 0.75),  # case ignored
    (" ABCDEF", ["ABCDE"], 0.0),                           # a longer word
    ("", ["1234567"], 0.0),
])
def test_the_scorer_counts_exactly_the_hits(text, answers, expected):
    assert score(text, answers) == expected


def test_found_takes_numbers_next_to_words_but_not_digits():
    assert found("number1234567", "1234567")
    assert not found("01234567", "1234567")
    with pytest.raises(ValueError):
        score("x", [])
