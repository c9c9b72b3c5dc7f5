"""``batch`` and bad lines: a request that cannot run gets an error line of its own and the
job goes on, the other lines answered exactly as a clean run answers them; a block that fails
in the engine runs again row by row; a damaged ``--output`` is repaired at its end or refused
in one line; ``--output`` equal to ``--input`` is refused; our own line format honours
``max_tokens``, ``seed`` and ``stop`` (and refuses what it does not serve, by name)."""
from __future__ import annotations

import json
import os

import pytest

from flexgen_infinigen import OffloadedLM, Placement, api, batch
from flexgen_infinigen.sampling import SamplingConfig

SMOL_VOCAB = 49152


def _run(capsys, args) -> tuple[int, str]:
    """``batch`` in this process: (exit code, stderr)."""
    capsys.readouterr()
    rc = batch.main([str(a) for a in args])
    return rc, capsys.readouterr().err


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _write(path, rows) -> None:
    """JSON lines; a str row is written as it is (JSON that ``json.dumps`` cannot spell)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _one_error_line(rc: int, err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# ---- poisoned lines among good ones (the real model) ----------------------------------------
GOOD = [{"id": "france", "prompt": "The capital of France is", "gen_len": 5},
        {"id": "count", "prompt": "One, two, three,", "gen_len": 5},
        {"id": "ids", "prompt": [1, 504, 3575, 282, 4649], "gen_len": 5},
        # our format's max_tokens (gen_len's OpenAI name) and stop strings
        {"id": "max", "prompt": "One, two, three,", "max_tokens": 3},
        {"id": "stop", "prompt": "One, two, three,", "gen_len": 5, "stop": [" five"]}]
# (line, words its error message holds): each would have stopped the whole job
POISON_OURS = [
    ('{"id": "nan", "prompt": "Hi", "temperature": NaN}', ["temperature", "finite"]),
    ('{"id": "inf", "prompt": "Hi", "top_p": Infinity}', ["top_p", "finite"]),
    ({"id": "seed", "prompt": "Hi", "seed": 2**64}, ["seed"]),
    ({"id": "tiny-top-p", "prompt": "Hi", "temperature": 1, "top_p": 1e-60}, ["top_p"]),
    ({"id": "vocab", "prompt": [1, SMOL_VOCAB]}, ["prompt[1]", str(SMOL_VOCAB)]),
    ({"id": "negative", "prompt": [1, -1]}, ["prompt[1]", "-1"]),
    ({"id": "long", "prompt": "Hi", "gen_len": 100000}, ["8192"]),
    ({"id": "role", "messages": [{"role": 5, "content": "Hi"}]}, ["role"]),
    ('{"id": "surrogate", "prompt": "a\\ud800b"}', ["surrogate"]),
    ({"id": "n", "prompt": "Hi", "n": 2}, ["not served: n"]),
    ({"id": "logprobs", "prompt": "Hi", "logprobs": True}, ["logprobs"]),
]


def _openai(custom_id, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


POISON_OPENAI = [
    ('{"custom_id": "nan", "method": "POST", "url": "/v1/completions", "body": '
     '{"prompt": "Hi", "temperature": NaN}}', ["temperature"]),
    ('{"custom_id": "max-inf", "method": "POST", "url": "/v1/completions", "body": '
     '{"prompt": "Hi", "max_tokens": Infinity}}', ["max_tokens"]),
    (_openai("seed", prompt="Hi", seed=2**64), ["seed"]),
    (_openai("tiny-top-p", prompt="Hi", top_p=1e-60), ["top_p"]),
    (_openai("vocab", prompt=[1, SMOL_VOCAB], max_tokens=4), ["prompt", str(SMOL_VOCAB)]),
    (_openai("model-list", prompt="Hi", model=["a"]), ["model"]),
]


@pytest.fixture(scope="module")
def clean(smollm2_store, tmp_path_factory):
    """The good lines alone, run clean: the answers a poisoned run must repeat."""
    folder = tmp_path_factory.mktemp("clean")
    _write(folder / "in.jsonl", GOOD)
    rc = batch.main(["--path", str(smollm2_store), "--input", str(folder / "in.jsonl"),
                     "--output", str(folder / "out.jsonl"), "--no-chat",
                     "--gpu-batch-size", "2"])
    assert rc == 0
    return {r["id"]: r for r in _lines(folder / "out.jsonl")}


def test_poisoned_lines_leave_the_others_unchanged(smollm2_store, clean, tmp_path, capsys):
    poison = [p for p, _ in POISON_OURS]
    rows = [GOOD[0], *poison[:4], GOOD[1], GOOD[3], *poison[4:8], GOOD[2], *poison[8:],
            GOOD[4]]
    _write(tmp_path / "in.jsonl", rows)
    rc, err = _run(capsys, ["--path", smollm2_store, "--input", tmp_path / "in.jsonl",
                            "--output", tmp_path / "out.jsonl", "--no-chat",
                            "--gpu-batch-size", "2"])
    assert rc == 0 and "Traceback" not in err, err
    got = {r["id"]: r for r in _lines(tmp_path / "out.jsonl")}
    assert len(got) == len(rows)  # every line answered, once
    for key, want in clean.items():
        assert got[key] == want and want["error"] is None
    for line, words in POISON_OURS:
        key = json.loads(line)["id"] if isinstance(line, str) else line["id"]
        error = got[key]["error"]
        assert set(got[key]) == {"id", "error"} and error["code"] == "invalid_request"
        for w in words:
            assert w in error["message"], (key, error)
    # a rerun finds every line done, errors included: nothing runs twice
    rc, err = _run(capsys, ["--path", smollm2_store, "--input", tmp_path / "in.jsonl",
                            "--output", tmp_path / "out.jsonl", "--no-chat"])
    assert rc == 0 and f"{len(rows)} already in" in err
    assert len(_lines(tmp_path / "out.jsonl")) == len(rows)


def test_poisoned_openai_lines_get_openai_error_lines(smollm2_store, clean, tmp_path, capsys):
    good = [_openai(r["id"], prompt=r["prompt"], max_tokens=5, temperature=0) for r in GOOD[:3]]
    rows = [good[0], *[p for p, _ in POISON_OPENAI[:3]], good[1],
            *[p for p, _ in POISON_OPENAI[3:]], good[2]]
    _write(tmp_path / "in.jsonl", rows)
    rc, err = _run(capsys, ["--path", smollm2_store, "--input", tmp_path / "in.jsonl",
                            "--output", tmp_path / "out.jsonl", "--gpu-batch-size", "2"])
    assert rc == 0 and "Traceback" not in err, err
    got = {r["custom_id"]: r for r in _lines(tmp_path / "out.jsonl")}
    assert len(got) == len(rows)
    for key in ("france", "count", "ids"):  # the same text as our format's clean run
        want = clean[key]
        assert got[key]["error"] is None
        choice = got[key]["response"]["body"]["choices"][0]
        assert choice["text"] == want["text"]
        assert choice["finish_reason"] == want["finish_reason"]
    for line, words in POISON_OPENAI:
        key = json.loads(line)["custom_id"] if isinstance(line, str) else line["custom_id"]
        row = got[key]
        assert row["response"] is None and row["id"].startswith("batch_req_")
        assert row["error"]["code"] == "invalid_request"
        for w in words:
            assert w in row["error"]["message"], (key, row["error"])


def test_our_format_honours_max_tokens_and_stop(clean, tmp_path, capsys):
    full, short, stop = clean["count"], clean["max"], clean["stop"]
    assert " five" in full["text"]  # the reference holds the stop string
    assert short["token_ids"] == full["token_ids"][:3] and short["finish_reason"] == "length"
    assert stop["text"] == full["text"].split(" five")[0] and stop["finish_reason"] == "stop"
    # the tokens up to the one that completed the stop string
    cut = stop["token_ids"]
    assert cut == full["token_ids"][:len(cut)] and len(cut) < len(full["token_ids"])
    # two names for one setting: one error naming the line, before any work
    _write(tmp_path / "two.jsonl", [{"id": "both", "prompt": "Hi", "gen_len": 3,
                                     "max_tokens": 3}])
    rc, err = _run(capsys, ["--model", "opt-125m", "--dummy", "--input",
                            tmp_path / "two.jsonl", "--output", tmp_path / "two.out.jsonl"])
    line = _one_error_line(rc, err)
    assert "line 1" in line and "gen_len" in line and "max_tokens" in line


# ---- a row that fails in the engine (tiny model) ---------------------------------------------
POISONED_PROMPT = [2, 99, 98, 97]


def _tiny_rows():
    return [{"id": f"r{i}", "prompt": [2] + [(7 * i + k) % 400 + 4 for k in range(3 + i % 3)],
             "gen_len": 5} for i in range(5)]


@pytest.fixture(scope="module")
def tiny_clean(tiny_opt, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-clean")
    _write(folder / "in.jsonl", _tiny_rows())
    assert batch.main(["--path", str(tiny_opt[1]), "--input", str(folder / "in.jsonl"),
                       "--output", str(folder / "out.jsonl"), "--gpu-batch-size", "2"]) == 0
    return folder / "out.jsonl"


def test_a_row_that_fails_in_the_engine_fails_alone(tiny_opt, tiny_clean, tmp_path, capsys,
                                                    monkeypatch):
    """A block holding a row the engine cannot run is run again row by row: that row gets
    an error line, its block mates the answers the clean run gave them."""
    real = api.OffloadedLM.generate
    blocks = []

    def generate(self, prompts, *args, **kwargs):
        blocks.append(len(prompts))
        if POISONED_PROMPT in [list(p) for p in prompts]:
            raise RuntimeError("the engine failed on this row")
        return real(self, prompts, *args, **kwargs)

    monkeypatch.setattr(api.OffloadedLM, "generate", generate)
    rows = _tiny_rows()
    # the same length as r1 (four tokens): sorted next to it, so they share a block
    rows.insert(2, {"id": "bad", "prompt": POISONED_PROMPT, "gen_len": 5})
    _write(tmp_path / "in.jsonl", rows)
    rc, err = _run(capsys, ["--path", tiny_opt[1], "--input", tmp_path / "in.jsonl",
                            "--output", tmp_path / "out.jsonl", "--gpu-batch-size", "2"])
    assert rc == 0 and "Traceback" not in err, err
    assert 1 in blocks and 2 in blocks  # a block of two failed and ran again row by row
    got = {r["id"]: r for r in _lines(tmp_path / "out.jsonl")}
    assert got["bad"]["error"]["code"] == "generation_failed"
    assert "the engine failed on this row" in got["bad"]["error"]["message"]
    for want in _lines(tiny_clean):
        assert got[want["id"]] == want
    assert len(got) == len(rows)


def test_our_format_honours_seed(tiny_opt, tmp_path, capsys):
    """A sampled row with its own seed draws what the library draws with that seed."""
    prompt = [2, 11, 12, 13, 14]
    rows = [{"id": f"s{seed}", "prompt": prompt, "gen_len": 8, "temperature": 1.0,
             "seed": seed} for seed in (7, 8)]
    _write(tmp_path / "in.jsonl", rows)
    rc, err = _run(capsys, ["--path", tiny_opt[1], "--input", tmp_path / "in.jsonl",
                            "--output", tmp_path / "out.jsonl"])
    assert rc == 0, err
    got = {r["id"]: r["token_ids"] for r in _lines(tmp_path / "out.jsonl")}
    with OffloadedLM.load(path=tiny_opt[1], policy=Placement(), progress=False) as lm:
        for seed in (7, 8):
            ref = lm.generate([prompt], 8, SamplingConfig(temperature=1.0, seed=seed))
            assert got[f"s{seed}"] == ref.token_ids[0]
    assert got["s7"] != got["s8"]


# ---- the output file -------------------------------------------------------------------------
def test_a_damaged_end_of_the_output_is_dropped_and_run_again(tiny_opt, tiny_clean, tmp_path,
                                                              capsys):
    whole = tiny_clean.read_text().splitlines(keepends=True)
    _write(tmp_path / "in.jsonl", _tiny_rows())
    out = tmp_path / "out.jsonl"
    out.write_text("".join(whole[:2]) + "not json\n" + '{"note": "no id"}\n' + "\0\0\0")
    rc, err = _run(capsys, ["--path", tiny_opt[1], "--input", tmp_path / "in.jsonl",
                            "--output", out, "--gpu-batch-size", "2"])
    assert rc == 0 and "Traceback" not in err, err
    assert "warning" in err and "line 3" in err
    got = _lines(out)
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in _tiny_rows())
    want = {r["id"]: r for r in map(json.loads, whole)}
    for r in got:
        assert r == want[r["id"]]


@pytest.mark.parametrize("content, words", [
    ('{"id": "r0", "text": "", "error": null}\nnot json\n{"id": "r1", "text": "", '
     '"error": null}\n', ["line 2", "delete that line"]),
    ('{"id": "r0", "prompt": "a question"}\n', ["line 1", "new file"]),
    ("some notes\nmore notes\n", ["line 1", "new file"]),
], ids=["damage-before-a-result", "an-input-file", "a-text-file"])
def test_a_damaged_output_is_refused_in_one_line(tmp_path, capsys, content, words):
    _write(tmp_path / "in.jsonl", _tiny_rows())
    out = tmp_path / "out.jsonl"
    out.write_text(content)
    rc, err = _run(capsys, ["--model", "opt-125m", "--dummy", "--input",
                            tmp_path / "in.jsonl", "--output", out])
    line = _one_error_line(rc, err)
    for w in words:
        assert w in line, line
    assert out.read_text() == content  # left as it was


@pytest.mark.parametrize("spelling", ["same", "dotted", "link"])
def test_output_equal_to_input_is_refused(tmp_path, capsys, spelling):
    source = tmp_path / "in.jsonl"
    _write(source, _tiny_rows())
    before = source.read_text()
    output = {"same": source, "dotted": tmp_path / "." / "in.jsonl",
              "link": tmp_path / "link.jsonl"}[spelling]
    if spelling == "link":
        os.symlink(source, output)
    rc, err = _run(capsys, ["--model", "opt-125m", "--dummy", "--input", source,
                            "--output", output])
    line = _one_error_line(rc, err)
    assert "--output" in line and "--input" in line
    assert source.read_text() == before
