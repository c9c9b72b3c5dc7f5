"""The lm-evaluation-harness model (flexgen_infinigen.harness) against transformers and our
own perplexity command: log-likelihoods through the decode path, rolling windows, stop
strings, and a local task run end to end by ``simple_evaluate``."""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install "
                              "-e '.[eval]')")

from flexgen_infinigen.harness import OffloadedHarnessLM  # noqa: E402

PAIRS = [("The capital of France is", " Paris"),
         ("Water boils at a temperature of", " 100 degrees"),
         ("The capital of France is", " a city in Europe"),
         ("", "Once upon a time"),
         ("def add(a, b):\n    return", " a + b")]


@pytest.fixture(scope="module")
def tiny_with_tokenizer(smollm2_store, tmp_path_factory):
    """A tiny random Llama that uses SmolLM2's tokenizer (its vocabulary size), and its HF
    model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flexgen_infinigen.weights.hf_convert import convert_hf

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=3,
                      intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("tiny-tok")
    model.save_pretrained(folder)
    shutil.copy(smollm2_store / "tokenizer.json", folder / "tokenizer.json")
    return model, convert_hf(folder, folder / "store", "tiny-tok")


def _harness(store, **options):
    return OffloadedHarnessLM(path=str(store), **options)


def _requests(args_list):
    return [SimpleNamespace(args=args) for args in args_list]


def _hf_loglikelihood(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    with torch.no_grad():
        logits = model(torch.tensor([ctx + cont])).logits[0].float()
    logp = torch.log_softmax(logits[len(ctx) - 1:-1], dim=-1)
    target = torch.tensor(cont)
    return float(logp[torch.arange(len(cont)), target].sum()), \
        bool((logp.argmax(-1) == target).all())


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_loglikelihood_equals_transformers(which, request):
    if which == "tiny":
        model, store = request.getfixturevalue("tiny_with_tokenizer")
    else:
        store, model = request.getfixturevalue("smollm2_store"), \
            request.getfixturevalue("smollm2_hf")
    h = _harness(store)
    ours = h.loglikelihood(_requests(PAIRS), disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(PAIRS, ours):
        ctx, cont = h._split(context, continuation)
        ref, ref_greedy = _hf_loglikelihood(model, ctx, cont)
        assert logprob == pytest.approx(ref, abs=2e-3), (context, continuation)
        assert greedy == ref_greedy
    assert h.prefills.hits >= 1  # the repeated context was prefilled once
    h.lm.close()


def test_loglikelihood_rolling_equals_transformers_window_by_window(smollm2_store, smollm2_hf):
    """A document longer than ``max_length`` is scored in windows, every token once: the sum
    equals transformers' log-likelihood of the same windows."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    text = ("The river rose through the night, and by morning the lower streets of the town "
            "were under water. Boats moved between the houses where carts had gone the day "
            "before, and the baker handed bread out of an upper window. ") * 2
    h = _harness(smollm2_store, max_length=40)
    (ours,) = h.loglikelihood_rolling(_requests([(text,)]), disable_tqdm=True)
    ids = h._encode(text)
    windows = get_rolling_token_windows(ids, h.prefix_token_id, 40, 1)
    ref = sum(_hf_loglikelihood(smollm2_hf, list(c), list(t))[0]
              for c, t in map(make_disjoint_window, windows))
    assert len(ids) > 80 and ours == pytest.approx(ref, abs=5e-3)
    h.lm.close()


def test_loglikelihood_is_our_perplexity_command(smollm2_store, tmp_path):
    """``eval perplexity`` over windows (prefill, then decode and score) and the harness's
    log-likelihood of each window's second part after its first give the same number, with
    InfiniGen active."""
    import argparse
    import math

    from flexgen_infinigen import eval as eval_cmd
    from flexgen_infinigen.kv.options import DEFAULT_KV_FRACTION

    text = ("A lighthouse keeper wrote down the weather every hour for forty years, and the "
            "books he left now fill a shelf in the harbour office. ") * 12
    (tmp_path / "t.txt").write_text(text)
    args = eval_cmd.build_parser().parse_args(
        ["perplexity", "--path", str(smollm2_store), "--text", str(tmp_path / "t.txt"),
         "--seq-len", "96", "--prefill-len", "48", "--kv-policy", "infinigen",
         "--max-windows", "2"])
    result = eval_cmd.perplexity(args)
    h = _harness(smollm2_store, kv_policy="infinigen", max_kv_fraction=DEFAULT_KV_FRACTION)
    ids = h.lm.tokenizer.encode(text)
    pairs = [(ids[w * 96:w * 96 + 48], ids[w * 96 + 48:(w + 1) * 96]) for w in range(2)]
    scores = h._score(pairs, "windows", True)
    ppl = math.exp(-sum(s for s, _ in scores) / 96)
    assert isinstance(args, argparse.Namespace)
    assert ppl == pytest.approx(result["perplexity"], rel=1e-4)
    h.lm.close()


def test_generate_until_cuts_at_the_first_stop_string(smollm2_store):
    h = _harness(smollm2_store)
    context = "The capital of France is"
    (free,) = h.generate_until(_requests([(context, {"max_gen_toks": 12})]), True)
    words = free.split()
    assert len(words) >= 3
    stop = " " + words[2]
    (cut,) = h.generate_until(_requests([(context, {"until": [stop, "never seen"],
                                                    "max_gen_toks": 12})]), True)
    assert cut == free[:free.find(stop)]
    h.lm.close()


def test_bad_model_args_are_one_clear_error():
    from flexgen_infinigen.config import ConfigError

    with pytest.raises(ConfigError, match="percent"):
        OffloadedHarnessLM(percent="100 0")
    with pytest.raises(ConfigError, match="kv-policy"):
        OffloadedHarnessLM(kv_policy="nonsense")
    with pytest.raises(ConfigError, match="unknown model_args.*--colour"):
        OffloadedHarnessLM(colour="blue")


CHOICES = [("The sun rises in the", ["east", "west"], 0),
           ("Two plus two is", ["four", "seven"], 0),
           ("Ice is frozen", ["fire", "water"], 1),
           ("A week has seven", ["days", "oceans"], 0)]


def test_simple_evaluate_runs_a_local_task(smollm2_store, smollm2_hf, tmp_path, monkeypatch):
    """A two-choice task from a local JSON file (no network), full cache and InfiniGen: the
    harness returns accuracies, and the full cache's equals the accuracy transformers'
    log-likelihoods give on the same documents."""
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"context": c, "choices": ch, "label": y})
                              for c, ch, y in CHOICES) + "\n")
    (tmp_path / "task.yaml").write_text(
        "task: tiny_two_choice\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n")
    manager = TaskManager(include_path=str(tmp_path))
    h = _harness(smollm2_store)
    expected = 0
    for context, choices, label in CHOICES:
        scores = [_hf_loglikelihood(smollm2_hf, *h._split(context, " " + c))[0]
                  for c in choices]
        expected += int(max(range(len(choices)), key=scores.__getitem__) == label)
    h.lm.close()
    accs = {}
    for kv in ("full", "infinigen"):
        out = lm_eval.simple_evaluate(model="flexgen_infinigen",
                                      model_args=f"path={smollm2_store},kv_policy={kv}",
                                      tasks=["tiny_two_choice"], task_manager=manager,
                                      log_samples=False, bootstrap_iters=0)
        accs[kv] = out["results"]["tiny_two_choice"]["acc,none"]
        assert 0.0 <= accs[kv] <= 1.0
    assert accs["full"] == pytest.approx(expected / len(CHOICES))
