"""The sampling fields clients send (issue 72, part 3): top_k, min_p, the penalties,
logit_bias, ignore_eos, stop_token_ids and the model's generation_config.json defaults.

The sampler against transformers' logits processors (and a plain torch computation of
OpenAI's presence and frequency penalties) on fixed logits; the request layer's refusals and
ignored fields; and the server end to end with the official ``openai`` client (``extra_body``
for the fields OpenAI does not define)."""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from flexgen_infinigen.cli import openai_batch
from flexgen_infinigen.sampling import (
    Sampler,
    SamplingConfig,
    generation_defaults,
    probabilities,
    row_chooser,
)

lp = pytest.importorskip("transformers.generation.logits_process")

VOCAB = 64
COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"


def _logits(seed: int, rows: int = 3, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _hf_probs(logits: torch.Tensor, *warpers) -> torch.Tensor:
    scores = logits.clone()
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    for w in warpers:
        scores = w(ids, scores)
    return torch.softmax(scores, -1)


# ---- the sampler, against transformers ----------------------------------------------------

@pytest.mark.parametrize("top_k", [1, 5, 40])
def test_top_k_matches_transformers(top_k):
    logits = _logits(top_k)
    ours = probabilities(logits, SamplingConfig(temperature=0.7, top_k=top_k))
    ref = _hf_probs(logits, lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(top_k))
    torch.testing.assert_close(ours, ref)
    assert int((ours > 0).sum(-1).max()) == top_k


@pytest.mark.parametrize("top_k", [-1, 0, VOCAB, VOCAB + 5])
def test_top_k_off_keeps_every_token(top_k):
    logits = _logits(1)
    ours = probabilities(logits, SamplingConfig(temperature=1.0, top_k=top_k))
    torch.testing.assert_close(ours, torch.softmax(logits, -1))


@pytest.mark.parametrize("min_p", [0.02, 0.2, 0.9])
def test_min_p_matches_transformers(min_p):
    logits = _logits(int(min_p * 100))
    ours = probabilities(logits, SamplingConfig(temperature=1.3, min_p=min_p))
    ref = _hf_probs(logits, lp.TemperatureLogitsWarper(1.3), lp.MinPLogitsWarper(min_p))
    torch.testing.assert_close(ours, ref)
    assert (ours > 0).sum() < ours.numel()  # something was cut


def test_top_k_top_p_min_p_together_match_transformers():
    """transformers' order: temperature, top-k, top-p (on what top-k left), min-p."""
    logits = _logits(5)
    cfg = SamplingConfig(temperature=0.9, top_k=20, top_p=0.8, min_p=0.05)
    ours = probabilities(logits, cfg)
    ref = _hf_probs(logits, lp.TemperatureLogitsWarper(0.9), lp.TopKLogitsWarper(20),
                    lp.TopPLogitsWarper(0.8), lp.MinPLogitsWarper(0.05))
    torch.testing.assert_close(ours, ref)


def test_draws_stay_in_the_kept_set():
    logits = _logits(9, rows=1)
    sampler = Sampler(SamplingConfig(temperature=1.0, top_k=3, seed=4))
    kept = set(logits[0].topk(3).indices.tolist())
    drawn = {int(sampler(logits, step=i)[0]) for i in range(200)}
    assert drawn <= kept and len(drawn) == 3


def test_repetition_penalty_matches_transformers():
    """A greedy row with the repetition penalty over its prompt and its own tokens: every
    step's choice is the argmax of transformers' processor over the same sequence."""
    steps = [_logits(100 + i, rows=1)[0] for i in range(12)]
    prompt = [int(steps[0].argmax()), 3, 7]  # the unpenalised first choice is in the prompt
    chooser = row_chooser(SamplingConfig(repetition_penalty=1.7), prompt)
    hf = lp.RepetitionPenaltyLogitsProcessor(1.7)
    seq = list(prompt)
    for i, x in enumerate(steps):
        got = int(chooser(x[None], i, 0)[0])
        want = int(hf(torch.tensor([seq]), x[None].clone())[0].argmax())
        assert got == want
        seq.append(got)
    assert seq[len(prompt)] != int(steps[0].argmax())  # the penalty changed the choice


def test_logit_bias_matches_transformers_sequence_bias():
    logits = _logits(11)
    bias = ((4, 5.0), (9, -3.5), (20, 100.0))
    cfg = SamplingConfig(temperature=1.0, logit_bias=bias)
    hf = lp.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias])
    want = hf(torch.zeros(3, 1, dtype=torch.long), logits.clone())
    ours = probabilities(Sampler(cfg)._moved(logits.clone(), 0, 0), cfg)
    torch.testing.assert_close(ours, torch.softmax(want, -1))
    greedy = Sampler(SamplingConfig(logit_bias=((20, 100.0),)))
    assert greedy(logits).tolist() == [20, 20, 20]


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 0.7), (0.4, 0.9),
                                                  (-1.0, 0.5)])
def test_openai_penalties_match_their_definition(presence, frequency):
    """OpenAI's: logit - presence * (count > 0) - frequency * count, over the tokens this row
    generated (not its prompt), for each row of a GPU batch on its own."""
    rows, steps = 3, 10
    logits = [_logits(200 + i, rows=rows, vocab=8) for i in range(steps)]  # few tokens: repeats
    sampler = Sampler(SamplingConfig(presence_penalty=presence, frequency_penalty=frequency))
    counts, changed = torch.zeros(rows, 8), False
    for i, x in enumerate(logits):
        want = (x - presence * (counts > 0) - frequency * counts).argmax(-1)
        got = sampler(x, i, 0)
        assert got.tolist() == want.tolist()
        changed |= got.tolist() != x.argmax(-1).tolist()
        counts[torch.arange(rows), got] += 1
    assert changed  # the penalties moved some choice
    # a new block (step 0 again) starts with nothing generated
    assert sampler(logits[0], 0, 0).tolist() == logits[0].argmax(-1).tolist()


# ---- the request layer: checks, ignored fields, generation_config -------------------------

def _line(kind: str = COMPLETION, **fields) -> dict:
    body = {"model": "m", "max_tokens": 2, **fields}
    body.setdefault("prompt" if kind == COMPLETION else "messages",
                    "Hi" if kind == COMPLETION else [{"role": "user", "content": "Hi"}])
    return {"custom_id": "a", "url": kind, "body": body}


def _parse(kind: str = COMPLETION, **fields) -> dict:
    return openai_batch.parse(_line(kind, **fields), "line 1",
                              {"gen_len": 4, "repetition_penalty": 1.0}, vocab_size=VOCAB)


@pytest.mark.parametrize("fields, param", [
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"top_k": True}, "top_k"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"min_p": "0.1"}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"), ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"), ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"n": 0}, "n"), ({"n": 129}, "n"),
    ({"n": 2.0}, "n"), ({"echo": "yes"}, "echo"), ({"logprobs": 6}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"best_of": 2}, "best_of"),
])
def test_bad_values_are_refused_by_name(fields, param):
    request = _parse(**fields)
    assert request["param"] == param, request["refused"]


def test_chat_only_fields_are_checked_on_a_chat():
    assert _parse(CHAT, chat_template_kwargs=[1])["param"] == "chat_template_kwargs"
    assert _parse(CHAT, documents={"a": 1})["param"] == "documents"
    ok = _parse(CHAT, chat_template_kwargs={"enable_thinking": False},
                documents=[{"title": "t", "text": "x"}])
    assert ok["refused"] is None
    assert ok["template_kwargs"] == {"enable_thinking": False}
    assert ok["documents"] == [{"title": "t", "text": "x"}]


def test_served_values_reach_the_settings():
    r = _parse(top_k=0, min_p=0.1, presence_penalty=-2, frequency_penalty=2,
               repetition_penalty=1.2, logit_bias={"7": -100, "3": 2.5}, stop_token_ids=[1, 2],
               ignore_eos=True, seed=5)
    assert r["refused"] is None
    s = r["settings"]
    assert (s["top_k"], s["min_p"], s["presence_penalty"], s["frequency_penalty"]) == \
        (0, 0.1, -2.0, 2.0)
    assert s["logit_bias"] == ((3, 2.5), (7, -100.0)) and s["stop_token_ids"] == (1, 2)
    assert s["ignore_eos"] is True and s["repetition_penalty"] == 1.2


def test_fields_that_change_nothing_are_ignored_and_named():
    r = _parse(user="u1", metadata={"k": "v"}, store=False, service_tier="auto",
               parallel_tool_calls=True)
    assert r["refused"] is None
    assert r["ignored"] == ["metadata", "parallel_tool_calls", "service_tier", "store", "user"]


def _folder_with(tmp_path, config: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_generation_config_defaults_and_precedence(tmp_path):
    folder = _folder_with(tmp_path, {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                     "min_p": 2.0, "repetition_penalty": 1.05,
                                     "do_sample": True, "max_new_tokens": 9})
    defaults = generation_defaults(folder)
    # min_p 2.0 is out of range: left out, not an error
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                        "repetition_penalty": 1.05}
    assert generation_defaults(tmp_path / "nowhere") == {}
    r = _parse(temperature=0.0)
    openai_batch.apply_model_defaults(r, defaults)
    s = r["settings"]  # the request's own value first, then the model's
    assert (s["temperature"], s["top_p"], s["top_k"], s["repetition_penalty"]) == \
        (0.0, 0.95, 20, 1.05)
    plain = _parse()
    assert (plain["settings"]["temperature"], plain["settings"]["top_p"]) == (1.0, 1.0)


def test_server_parse_reads_the_store_defaults_and_logs_ignored_once(tmp_path, caplog):
    from flexgen_infinigen.serving import parse as requests

    folder = _folder_with(tmp_path, {"temperature": 0.5, "top_k": 7})
    lm = SimpleNamespace(cfg=SimpleNamespace(vocab_size=VOCAB, max_positions=64),
                         tokenizer=None, store_path=folder)
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "top_p": 0.9, "user": "u",
            "metadata": {"a": "b"}, "stop_token_ids": [5], "ignore_eos": True}
    with caplog.at_level(logging.INFO, logger="uvicorn.error"):
        req = requests.parse("completion", body, lm, None, 16, {"m"})
    assert (req.sampling.temperature, req.sampling.top_k, req.sampling.top_p) == (0.5, 7, 0.9)
    assert req.ignore_eos and req.stop_token_ids == (5,)
    lines = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
    assert len(lines) == 1 and "metadata, user" in lines[0]
    with pytest.raises(requests.ApiError) as e:
        requests.parse("completion", {**body, "logit_bias": {"64": 1}}, lm, None, 16, {"m"})
    assert e.value.param == "logit_bias"


def test_hf_conversion_keeps_generation_config(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from flexgen_infinigen.weights.hf_convert import convert_hf

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                         intermediate_size=64, num_attention_heads=2,
                                         num_key_value_heads=1, max_position_embeddings=32))
    model.save_pretrained(tmp_path)
    _folder_with(tmp_path, {"temperature": 0.7, "top_k": 30, "bos_token_id": 1})
    store = convert_hf(tmp_path, tmp_path / "store", "tiny")
    assert generation_defaults(store) == {"temperature": 0.7, "top_k": 30}


# ---- the server, with the official client -------------------------------------------------

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
MODEL = "smollm2-135m"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def served(smollm2_store, tmp_path_factory):
    """A server (blocks of 4 rows, info log to a file) and its client and log."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve-log") / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "flexgen_infinigen.serve", "--path",
                                 str(smollm2_store), "--port", str(port), "--gpu-batch-size",
                                 "4", "--num-gpu-batches", "1", "--max-wait-ms", "400",
                                 "--log-level", "info"], stdout=subprocess.DEVNULL,
                                stderr=err)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client, log
    proc.terminate()
    proc.wait(60)


def _complete(client, **fields):
    extra = {k: fields.pop(k) for k in ("top_k", "min_p", "repetition_penalty", "ignore_eos",
                                        "stop_token_ids") if k in fields}
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
    return client.completions.create(**{**args, **fields}, extra_body=extra or None).choices[0]


def test_logit_bias_forces_a_token_and_stop_token_ids_stop(served):
    client, _ = served
    plain = _complete(client)
    # token 1000: a piece the plain answer never chooses first, forced at temperature 0
    forced = _complete(client, logit_bias={"1000": 100})
    tokens = forced.logprobs.tokens
    assert tokens == [tokens[0]] * 4 and tokens[0] != plain.logprobs.tokens[0]
    assert forced.text == tokens[0] * 4
    stopped = _complete(client, logit_bias={"1000": 100}, stop_token_ids=[1000])
    assert stopped.finish_reason == "stop" and stopped.text == ""
    other = _complete(client, logit_bias={"1000": 100}, stop_token_ids=[999])
    assert other.finish_reason == "length" and other.text == forced.text


def test_ignore_eos_runs_to_max_tokens(served):
    """The end token forced by a bias (<|im_end|>, id 2, SmolLM2's turn end): the answer
    ends at once; with ignore_eos it runs to max_tokens."""
    client, _ = served
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Say yes."}],
                max_tokens=12, temperature=0, logit_bias={"2": 100})
    short = client.chat.completions.create(**args)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens == 1
    long = client.chat.completions.create(**args, extra_body={"ignore_eos": True})
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 12


def test_greedy_row_unchanged_beside_rows_with_other_settings(served):
    """Four requests in one block: a plain greedy one, and three whose rows set penalties,
    a bias, top-k and min-p; the greedy answer is the one it has alone."""
    client, _ = served
    alone = _complete(client, max_tokens=16).text
    others = [dict(presence_penalty=2, frequency_penalty=1.5, max_tokens=16),
              dict(repetition_penalty=1.5, logit_bias={"1000": 5}, max_tokens=16),
              dict(temperature=0.9, top_k=5, min_p=0.1, seed=3, max_tokens=16)]
    results: dict[int, str] = {}

    def go(i, fields):
        results[i] = _complete(client, **fields).text

    threads = [threading.Thread(target=go, args=(i, f))
               for i, f in enumerate([dict(max_tokens=16)] + others)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == alone
    assert results[1] != alone  # the penalties did change that row's answer


def test_refusals_name_the_field(served):
    client, _ = served
    cases = [(dict(extra_body={"top_k": -5}), "top_k"),
             (dict(logit_bias={"abc": 1}), "logit_bias"),
             (dict(presence_penalty=3), "presence_penalty"),
             (dict(n=999), "n"), (dict(best_of=2), "best_of"),
             (dict(extra_body={"tools": [{"type": "function"}]}), "tools")]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **fields)
        assert e.value.body["param"] == param, e.value.body


def test_ignored_fields_answer_200_and_are_logged_once(served):
    client, log = served
    before = log.read_text().count("ignores fields")
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi."}], max_tokens=2,
        temperature=0, user="someone", metadata={"k": "v"}, store=False,
        service_tier="auto")
    assert out.choices[0].finish_reason in ("stop", "length")
    time.sleep(0.2)
    lines = [ln for ln in log.read_text().splitlines() if "ignores fields" in ln]
    assert len(lines) == before + 1
    assert "metadata, service_tier, store, user" in lines[-1]


# ---- batch: the same fields in an OpenAI Batch file ---------------------------------------

def test_batch_serves_the_fields(tiny_llama, tmp_path, capsys):
    """A forced token (logit_bias) that is also a stop id ends its line at one token; the
    same line without the stop id runs to max_tokens; ignored fields are named once."""
    from flexgen_infinigen import batch

    def line(key, **body):
        return {"custom_id": key, "method": "POST", "url": COMPLETION,
                "body": {"model": "m", "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0,
                         "logit_bias": {"7": 100}, **body}}

    rows = [line("stop", stop_token_ids=[7], user="a"), line("run", user="b"),
            line("bad", stop_token_ids=[10**6])]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert batch.main(["--path", str(tiny_llama[1]), "--input", str(tmp_path / "in.jsonl"),
                       "--output", str(tmp_path / "out.jsonl"), "--gpu-batch-size", "2",
                       "--num-gpu-batches", "1"]) == 0
    err = capsys.readouterr().err
    out = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").open())}
    stop, run = out["stop"]["response"]["body"], out["run"]["response"]["body"]
    assert stop["usage"]["completion_tokens"] == 1
    assert stop["choices"][0]["finish_reason"] == "stop"
    assert run["usage"]["completion_tokens"] == 6
    assert run["choices"][0]["finish_reason"] == "length"
    assert out["bad"]["error"]["param"] == "stop_token_ids"
    assert err.count("ignored: user") == 1
