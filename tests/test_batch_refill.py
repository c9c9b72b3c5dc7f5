"""``batch`` refills rows: a row whose answer has ended takes the next prompt at the next step
(``serving.offline`` through the server's scheduler), each row with its own settings. At
temperature 0 every output line equals the one ``--no-refill`` writes (blocks of prompts with
the same settings, each to its longest answer), token for token, on the default model's
8-bit codes; and prompts did join running blocks (fewer blocks than ``--no-refill`` runs)."""
from __future__ import annotations

import json

from flexgen_infinigen import OffloadedLM, Placement, batch
from flexgen_infinigen.sampling import SamplingConfig
from flexgen_infinigen.serving.metrics import Metrics
from flexgen_infinigen.serving.offline import JobRequest, answer_all

TEXTS = ["The capital of France is", "Once upon a time there was a small dragon who",
         "Water boils at", "My favourite food is", "In 1969, the first", "One, two, three,",
         "The three primary colours are red,"]
LENGTHS = [2, 14, 3, 6, 12, 4, 2]


def _lines(path) -> dict[str, dict]:
    return {x["id"]: x for x in map(json.loads, path.read_text().splitlines())}


def test_refilled_rows_write_what_blocks_write(smollm2_codes_store, tmp_path):
    rows = [{"id": f"r{i}", "prompt": t, "gen_len": n, **({"stop": [","]} if i == 5 else {})}
            for i, (t, n) in enumerate(zip(TEXTS, LENGTHS))]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = {}
    for mode in ("--refill", "--no-refill"):
        path = tmp_path / f"{mode}.jsonl"
        assert batch.main(["--path", str(smollm2_codes_store), "--input",
                           str(tmp_path / "in.jsonl"), "--output", str(path), "--no-chat",
                           "--gpu-batch-size", "2", mode]) == 0
        out[mode] = _lines(path)
    assert out["--refill"] == out["--no-refill"]
    assert [len(out["--refill"][f"r{i}"]["token_ids"]) for i in range(len(rows))] != LENGTHS


def test_requests_join_the_rows_that_end(smollm2_codes_store):
    with OffloadedLM.load(path=smollm2_codes_store, policy=Placement(gpu_batch_size=2),
                          progress=False) as lm:
        jobs = [JobRequest("completion", lm.tokenizer.encode(t), n, SamplingConfig(), [], None,
                           False, False, "m") for t, n in zip(TEXTS, LENGTHS)]
        metrics = Metrics()
        ended = list(answer_all(lm, jobs, metrics=metrics))
        assert sorted(id(r) for r, _ in ended) == sorted(id(r) for r in jobs)
        assert all(event[0] == "done" for _, event in ended)
        for job, n in zip(jobs, LENGTHS):
            alone = lm.generate([job.ids], n).token_ids[0]
            assert job.token_ids == alone
        # answers of different lengths: later prompts took ended rows mid-block (blocks of
        # two without that: four)
        counts = metrics.snapshot()["counts"]
        assert counts["requests_joined_prefilled"] >= 2 and counts["blocks"] < 4


def test_equal_sampled_prompts_draw_differently_and_again_the_same(smollm2_codes_store,
                                                                   tmp_path):
    """Each row has a generator of its own: a line without a seed takes the job's plus its
    place in the file, so equal prompts at temperature 1 draw differently, and a rerun of
    the job draws the same again."""
    rows = [{"id": f"s{i}", "prompt": "Once upon a time", "gen_len": 16, "temperature": 1.0}
            for i in range(3)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = []
    for run in range(2):
        path = tmp_path / f"out{run}.jsonl"
        assert batch.main(["--path", str(smollm2_codes_store), "--input",
                           str(tmp_path / "in.jsonl"), "--output", str(path), "--no-chat",
                           "--gpu-batch-size", "2"]) == 0
        texts.append([_lines(path)[f"s{i}"]["text"] for i in range(3)])
    assert len(set(texts[0])) == 3 and texts[0] == texts[1]
