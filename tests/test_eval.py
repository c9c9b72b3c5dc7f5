"""The perplexity command: decode-path scoring equals one forward pass; budget 1.0 is exact."""
from __future__ import annotations

import json
import math

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen import eval as evaluation
from flexgen_infinigen.evals.metrics import perplexity, teacher_forced_nll


def test_decode_path_perplexity_equals_a_single_forward(tiny_opt):
    model, store = tiny_opt
    gen = torch.Generator().manual_seed(1)
    window = [2] + torch.randint(10, 500, (47,), generator=gen).tolist()
    prefill = 16
    with torch.no_grad():
        logits = model(torch.tensor([window])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    ref = -logp[torch.arange(prefill - 1, len(window) - 1), torch.tensor(window[prefill:])]
    policy = Placement.from_percent([50, 50, 0, 100, 100, 0])
    with OffloadedLM.load(path=store, policy=policy, progress=False) as lm:
        nll = teacher_forced_nll(lm, [window[:prefill]], [window[prefill:]])[0]
    assert (nll - ref).abs().max().item() < 1e-4
    assert perplexity(nll) == pytest.approx(math.exp(ref.mean().item()), rel=1e-5)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from flexgen_infinigen.run import FILLER_TEXT

    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(FILLER_TEXT * 4, encoding="utf-8")
    return path


def _ppl(store, text_file, tmp_path, *extra):
    out = tmp_path / "out.json"
    assert evaluation.main(["perplexity", "--path", str(store), "--text", str(text_file),
                            "--seq-len", "160", "--prefill-len", "96", "--max-windows", "2",
                            "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_every_policy_at_budget_one_gives_full_perplexity(smollm2_store, text_file, tmp_path):
    full = _ppl(smollm2_store, text_file, tmp_path)
    assert full["windows"] == 2 and full["tokens_scored"] == 128
    for extra in (["--kv-policy", "infinigen", "--alpha", "inf", "--max-kv-fraction", "1"],
                  ["--kv-policy", "h2o", "--hh-ratio", "0.5", "--recent-ratio", "0.5"]):
        got = _ppl(smollm2_store, text_file, tmp_path, *extra)
        assert got["perplexity"] == pytest.approx(full["perplexity"], rel=1e-4)
        assert got["relative_kv_size"] == pytest.approx(1.0)
    small = _ppl(smollm2_store, text_file, tmp_path, "--kv-policy", "h2o")
    assert small["relative_kv_size"] < 0.3
    assert len(small["relative_kv_size_per_layer"]) == 30


@pytest.mark.parametrize("args, fix", [
    (["--text", "/no/such.txt"], "--text"),
    (["--seq-len", "100", "--prefill-len", "100"], "--prefill-len"),
    (["--seq-len", "9000"], "--seq-len"),
    (["--seq-len", "4096", "--prefill-len", "64"], "fewer than one window"),
])
def test_bad_input(capsys, text_file, smollm2_store, args, fix):
    base = ["perplexity", "--path", str(smollm2_store), "--text", str(text_file)]
    if args[0] == "--text":
        base = base[:3]
    code = evaluation.main(base + args)
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fix in err[0]


def test_empty_text(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert evaluation.main(["perplexity", "--text", str(empty)]) == 2
    assert "empty" in capsys.readouterr().err
