"""Synthetic long-context retrieval tasks in the spirit of RULER, built as token ids of an
exact length, and their scorer.

Tasks (each a haystack of natural filler text with needles at controlled depths):

- ``single``: one special magic number hidden for a key; asked back.
- ``multikey``: four keys with a number each; one key is asked (the others distract).
- ``multivalue``: four numbers hidden for one key; all four are asked.
- ``vartrack``: a chain ``VAR A = 4821937``, ``VAR B = VAR A``, ... spread through the text;
  every variable holding the number is asked (the answer needs several far-apart tokens).

A sample is reproducible from ``(task, length, depth, seed)``: the filler window, keys,
values and the other needles' depths all come from a generator seeded by those. Needles go
in at sentence ends of the filler, at the token position nearest to ``depth`` of the haystack;
the sample records where each needle's tokens start. Prompts are in plain completion form
(an instruction, the text, a question and the start of the answer); the score of an output
is the share of its expected answers it contains as whole numbers or words.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

TASKS = ("single", "multikey", "multivalue", "vartrack")
# generated tokens scored per task: a 7-digit number is at most 8 tokens; lists need more
GEN_LEN = {"single": 12, "multikey": 12, "multivalue": 48, "vartrack": 36}

_ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow",
               "icy", "jolly", "keen", "lunar", "mellow", "noble", "olive", "plain", "quiet",
               "rapid", "silent", "tidy", "upper", "vivid", "woolly", "young", "zesty")
_NOUNS = ("anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor",
          "island", "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper",
          "quarry", "ribbon", "saddle", "tunnel", "violin", "walnut", "yacht", "zephyr")
_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"

INSTRUCTION = ("Some special magic numbers are hidden in the long text below. Remember them: "
               "a question about them follows the text.\n\n")
VAR_INSTRUCTION = ("The long text below hides a chain of variable assignments. Follow it: a "
                   "question about it follows the text.\n\n")


@dataclass
class Sample:
    task: str
    length: int
    depth: float  # where the asked (or first) needle sits, 0 = start of the haystack
    seed: int
    ids: list[int]
    answers: list[str]
    needle_starts: list[int] = field(default_factory=list)  # token index of each needle
    needle_ids: list[list[int]] = field(default_factory=list)
    needle_depths: list[float] = field(default_factory=list)
    haystack: tuple[int, int] = (0, 0)  # [start, end) of the haystack in ids

    @property
    def key(self) -> str:
        return f"{self.task}/{self.length}/{self.depth:g}/{self.seed}"

    @property
    def gen_len(self) -> int:
        return GEN_LEN[self.task]


class Filler:
    """A tokenized filler text and the token positions where a sentence ends (a needle may
    go there without cutting a word)."""

    def __init__(self, tokenizer, text: str):
        self.tokenizer = tokenizer
        self.ids = _pieces(tokenizer, text)
        ends = set()
        for i in set(self.ids):
            s = tokenizer.decode([i])
            if s.rstrip(" ").endswith((".", "!", "?", "\n")):
                ends.add(i)
        self.ends = [p + 1 for p, i in enumerate(self.ids) if i in ends]
        self.end_set = {e % len(self.ids) for e in self.ends}
        if len(self.ends) < 16:
            raise ValueError("the filler text has too few sentence ends to place needles in")

    def window(self, start: int, n: int) -> list[int]:
        ids = self.ids
        while len(ids) < start + n:
            ids = ids + self.ids
        return ids[start:start + n]


def _pieces(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without the BOS a tokenizer may add."""
    ids = tokenizer.encode(text)
    if getattr(tokenizer, "add_bos", False) and ids[:1] == [tokenizer.bos_token_id]:
        ids = ids[1:]
    return ids


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample([(a, b) for a in _ADJECTIVES for b in _NOUNS], n)
    return [f"{a}-{b}" for a, b in pairs]


def _needles(task: str, rng: random.Random):
    """(instruction, needle sentences, question and answer start, expected answers)."""
    if task in ("single", "multikey", "multivalue"):
        keys = _keys(rng, 1 if task != "multikey" else 4)
        n = 4 if task != "single" else 1
        values = [_number(rng) for _ in range(n)]
        asked = keys[0]
        if task == "multikey":
            sentences = [f"One of the special magic numbers for {k} is: {v}."
                         for k, v in zip(keys, values)]
        else:
            sentences = [f"One of the special magic numbers for {asked} is: {v}." for v in values]
        if task == "multivalue":
            question = (f"\n\nQuestion: What are all the special magic numbers for {asked} in "
                        f"the text above?\nAnswer: The special magic numbers for {asked} in the "
                        "text above are")
            return INSTRUCTION, sentences, question, values
        question = (f"\n\nQuestion: What is the special magic number for {asked} in the text "
                    f"above?\nAnswer: The special magic number for {asked} in the text above is")
        return INSTRUCTION, sentences, question, values[:1]
    if task == "vartrack":
        value = _number(rng)
        names = ["".join(rng.choice(_LETTERS) for _ in range(5)) for _ in range(5)]
        sentences = [f"VAR {names[0]} = {value}."]
        sentences += [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
        question = (f"\n\nQuestion: Which variables are assigned the value {value} in the text "
                    f"above?\nAnswer: Following the assignments in the text above, the "
                    f"variables assigned the value {value} are:")
        return VAR_INSTRUCTION, sentences, question, names
    raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")


def make_sample(filler: Filler, task: str, length: int, depth: float, seed: int) -> Sample:
    """One prompt of exactly ``length`` tokens (BOS included when the tokenizer adds one)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1] (got {depth})")
    rng = random.Random(f"{task}:{length}:{depth}:{seed}")
    tok = filler.tokenizer
    instruction, sentences, question, answers = _needles(task, rng)
    bos = [tok.bos_token_id] if getattr(tok, "add_bos", False) else []
    head, tail = bos + _pieces(tok, instruction), _pieces(tok, question)
    needles = [_pieces(tok, " " + s) for s in sentences]
    body = length - len(head) - len(tail) - sum(map(len, needles))
    if body < 64:
        raise ValueError(f"length {length} is too short for the {task} task")
    start = rng.choice(filler.ends[:-1])
    window = filler.window(start, body)
    depths = [depth] + [rng.random() for _ in needles[1:]]
    if task == "vartrack":  # the chain in order, the first link at ``depth``
        depths = [depth] + sorted(depth + (1 - depth) * rng.random() for _ in needles[1:])
    n = len(filler.ids)
    ends = sorted({p for p in range(body + 1) if (start + p) % n in filler.end_set} | {0, body})
    cuts = [min(ends, key=lambda e, d=d: (abs(e - d * body), e)) for d in depths]
    order = sorted(range(len(needles)), key=lambda i: (cuts[i], i))
    ids, starts, last = list(head), [0] * len(needles), 0
    for i in order:
        ids += window[last:cuts[i]]
        starts[i] = len(ids)
        ids += needles[i]
        last = cuts[i]
    ids += window[last:]
    hay = (len(head), len(ids))
    ids += tail
    assert len(ids) == length, (len(ids), length)
    return Sample(task, length, depth, seed, ids, answers, starts, needles,
                  [c / body for c in cuts], hay)


def make_samples(filler: Filler, tasks, length: int, depths, seeds) -> list[Sample]:
    return [make_sample(filler, t, length, d, s) for t in tasks for d in depths for s in seeds]


def found(text: str, answer: str) -> bool:
    """``answer`` in ``text`` as a whole number or word (``1234567`` is not found in
    ``12345678``, nor ``ABCDE`` in ``ABCDEF``); case is ignored."""
    before = r"(?<!\d)" if answer[:1].isdigit() else r"(?<!\w)"
    after = r"(?!\d)" if answer[-1:].isdigit() else r"(?!\w)"
    return re.search(before + re.escape(answer) + after, text, re.IGNORECASE) is not None


def score(text: str, answers: list[str]) -> float:
    """The share of ``answers`` found in ``text`` (1.0: all of them)."""
    if not answers:
        raise ValueError("a sample has no expected answers")
    return sum(found(text, a) for a in answers) / len(answers)
