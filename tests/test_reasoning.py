"""A thinking model's reasoning split from its answer (flexgen_infinigen.text.reasoning):
the whole answer and the stream agree, piece by piece in every cut, whether the prompt opened
the thought or the answer does, closed or cut short."""
from __future__ import annotations

import pytest

from flexgen_infinigen.text.reasoning import ThinkStream, split, thinks

CASES = [
    # (answer, the prompt opened the thought, reasoning, content)
    ("<think>\nsky: Rayleigh\n</think>\n\nBecause of scattering.", False, "sky: Rayleigh",
     "Because of scattering."),
    ("sky: Rayleigh</think>Because.", True, "sky: Rayleigh", "Because."),
    ("still thinking when max_tokens came", True, "still thinking when max_tokens came", ""),
    ("<think>cut short", False, "cut short", ""),
    ("Plain answer, no thought. </think> is text here", False, None,
     "Plain answer, no thought. </think> is text here"),
    ("<thinking> is not the tag", False, None, "<thinking> is not the tag"),
]


@pytest.mark.parametrize("answer,inside,reasoning,content", CASES)
def test_the_answer_and_the_stream_split_alike(answer, inside, reasoning, content):
    assert split(answer, inside) == (reasoning, content)
    for size in (1, 2, 5, 100):
        stream = ThinkStream(inside)
        got = [stream.add(answer[i:i + size]) for i in range(0, len(answer), size)]
        got.append(stream.finish())
        thought = "".join(r for r, _ in got)
        said = "".join(c for _, c in got)
        assert thought.strip("\n") == (reasoning or "") and said == content, size


def test_only_templates_with_the_tags_think():
    assert thinks("{{ '<think>' }}...{{ '</think>' }}") and not thinks("{{ messages }}")
    assert not thinks(None)
