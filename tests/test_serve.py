"""The OpenAI-compatible server, driven by the official ``openai`` client on 127.0.0.1 (and raw
HTTP for what a client would not send), checked against the library's own generation; and
streaming outside the server (``OffloadedLM.stream``, ``run --stream``)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from flexgen_infinigen import OffloadedLM, Placement  # noqa: E402
from flexgen_infinigen.sampling import SamplingConfig  # noqa: E402
from flexgen_infinigen.text.chat import chat_prompt_ids, store_template  # noqa: E402
from flexgen_infinigen.text.incremental import TextStream  # noqa: E402

MODEL = "smollm2-135m"
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVERS: dict[str, subprocess.Popen] = {}  # url -> the process
PROMPTS = ["The capital of France is", "Once upon a time there was", "My favourite food is",
           "The best way to learn to code is", "Water boils at", "In 1969, the first",
           "The three primary colours are", "A good night's sleep"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(store, *flags, source: str = "--path") -> tuple[subprocess.Popen, str]:
    """A server of the weight store ``store`` (``source="--model"``: a model file or name)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flexgen_infinigen.serve", source,
                             str(store), "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not come up")


def _stop(proc: subprocess.Popen) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, err


@pytest.fixture(scope="module")
def server(smollm2_store):
    """A server with blocks of 4 x 2 rows, at most 12 waiting requests, and an API key."""
    proc, url = _start(smollm2_store, "--gpu-batch-size", "4", "--num-gpu-batches", "2",
                       "--max-wait-ms", "200", "--max-queue", "12", "--api-key", KEY)
    SERVERS[url] = proc
    yield url
    if proc.poll() is None:  # test_sigterm_drains_and_exits did not run
        _stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def lm(smollm2_store):
    with OffloadedLM.load(path=smollm2_store, policy=Placement(), progress=False) as lm:
        yield lm


def _in_thread(fn, *args, **kwargs):
    """``fn``'s result from a worker thread, where the server's engine runs too: on cores
    that other processes keep busy, torch ran many times slower from the main thread."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)))
    t.start()
    t.join()
    assert out, "the call failed (its error is printed above)"
    return out[0]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", headers=AUTH).text.splitlines():
        if line.startswith(f"flexgen_infinigen_{name} "):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {name}")


def test_completion_and_chat_equal_the_library(client, lm):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4,
                                    temperature=0, logprobs=2)
    ref = _in_thread(lm.generate, [PROMPTS[0]], 4, keep_logits=True)
    assert out.choices[0].text == ref.texts[0]
    assert out.usage.completion_tokens == len(ref.token_ids[0])
    # the chosen token's log-probability and the top ones, from the model's logits
    logprobs = ref.logits[0][:len(out.choices[0].logprobs.token_logprobs)].log_softmax(-1)
    chosen = logprobs.gather(1, logprobs.argmax(-1, keepdim=True)).squeeze(1)
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(chosen.tolist(), abs=1e-4)
    assert all(len(top) == 2 for top in out.choices[0].logprobs.top_logprobs)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                          temperature=0, logprobs=True)
    ids = chat_prompt_ids(lm.tokenizer, store_template(lm.store_path), messages)
    assert chat.choices[0].message.content == _in_thread(lm.generate, [ids], 3).texts[0]
    assert chat.choices[0].finish_reason == "length"
    assert len(chat.choices[0].logprobs.content) == 3
    assert all(e.logprob <= 0 for e in chat.choices[0].logprobs.content)


def test_seeded_sampling_and_stop_strings_equal_the_library(client, lm):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4,
                                    temperature=0.9, top_p=0.95, seed=7)
    ref = _in_thread(lm.generate, [PROMPTS[1]], 4, SamplingConfig(0.9, 0.95, 7))
    assert out.choices[0].text == ref.texts[0]
    greedy = _in_thread(lm.generate, [PROMPTS[0]], 4).texts[0]  # " Paris.\n\n"
    assert "\n" in greedy
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4,
                                     temperature=0, stop=["\n"])
    assert cut.choices[0].text == greedy[:greedy.index("\n")]
    assert cut.choices[0].finish_reason == "stop"


def test_streamed_equals_not_streamed(client):
    for kind in ("chat", "completion"):
        if kind == "chat":
            args = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                        max_tokens=5, temperature=0)
            whole = client.chat.completions.create(**args).choices[0].message.content
            chunks = list(client.chat.completions.create(**args, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            args = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=5, temperature=0)
            whole = client.completions.create(**args).choices[0].text
            chunks = list(client.completions.create(**args, stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole
        assert len(chunks) > 2  # piece by piece, not all at the end
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sixteen_concurrent_clients_equal_one_at_a_time(client, server):
    args = dict(model=MODEL, max_tokens=3, temperature=0)
    alone = {p: client.completions.create(prompt=p, **args).choices[0].text for p in PROMPTS}
    blocks, rows = _metric(server, "blocks_total"), _metric(server, "block_rows_total")
    joined = _metric(server, "requests_joined_total")
    results: dict[int, str] = {}

    def ask(i):
        results[i] = client.completions.create(prompt=PROMPTS[i % 8], **args).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {i: results[i] for i in range(16)} == {i: alone[PROMPTS[i % 8]] for i in range(16)}
    # they were served in shared blocks, not one by one: each started a block's row, or
    # took the row of an answer that had ended
    ran = _metric(server, "blocks_total") - blocks
    took = _metric(server, "block_rows_total") - rows + \
        _metric(server, "requests_joined_total") - joined
    assert took == 16 and ran < 16


def test_a_dropped_stream_frees_its_row(client, server):
    cancelled = _metric(server, "requests_cancelled_total")
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=400,
                                       temperature=0, stream=True)
    for n, _ in enumerate(stream):
        if n == 2:
            break
    stream.close()
    deadline = time.monotonic() + 60
    while _metric(server, "requests_cancelled_total") == cancelled:
        assert time.monotonic() < deadline, "the dropped row was never cancelled"
        time.sleep(0.2)
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2,
                                    temperature=0)
    assert out.choices[0].text


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not JSON"),
    (json.dumps({"model": MODEL}), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "hi", "n": 9}), 400, "n must be 1 to 8"),
    (json.dumps({"model": MODEL, "prompt": "hi", "tools": []}), 400, "tools"),
    (json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}), 400, "temperature"),
    (json.dumps({"model": MODEL, "prompt": "hi", "logprobs": 9}), 400, "0 to 5"),
    (json.dumps({"model": MODEL, "prompt": [5] * 8190, "max_tokens": 10}), 400,
     "context length"),
    (json.dumps({"model": "gpt-4", "prompt": "hi"}), 404, "not served"),
])
def test_malformed_bodies_get_openai_errors(server, body, status, words):
    r = httpx.post(f"{server}/v1/completions", content=body,
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status
    error = r.json()["error"]
    assert words in error["message"] and error["type"]
    assert httpx.get(f"{server}/health").status_code == 200  # and the server goes on


def test_n_choices_and_several_prompts_are_each_its_own_answer(client, lm):
    """n > 1 and a list of prompts: choice ``i * n + j`` is prompt i's j-th answer, each
    the library's for that prompt (greedy: all n alike); seeded sampling gives each choice
    its own seed; usage counts every prompt once and every choice's tokens."""
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=4,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    ref = _in_thread(lm.generate, PROMPTS[:2], 4)
    texts = ref.texts
    assert [c.text for c in out.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert out.usage.prompt_tokens == sum(len(lm.tokenizer.encode(p)) for p in PROMPTS[:2])
    assert out.usage.completion_tokens == 2 * sum(map(len, ref.token_ids))
    seeded = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], n=3,
        max_tokens=6, temperature=1.0, seed=5)
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], n=3,
        max_tokens=6, temperature=1.0, seed=5)
    texts = [c.message.content for c in seeded.choices]
    assert texts == [c.message.content for c in again.choices]  # each choice repeats
    one = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6,
        temperature=1.0, seed=6)
    assert one.choices[0].message.content == texts[1]  # choice j: seed + j


def test_streamed_choices_each_make_the_answer_they_make_unstreamed(client):
    """n > 1 and a list of prompts, streamed: one stream (one id), each chunk naming its
    choice; each choice's pieces join into the text the same body gives unstreamed (seeded
    sampling: every choice its own seed), each ends once, and the usage chunk counts every
    prompt once and every choice's tokens."""
    body = dict(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=5, temperature=1.0, seed=3)
    whole = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True,
                                            stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    texts, ends = {}, {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                ends[choice.index] = ends.get(choice.index, 0) + 1
    assert texts == {c.index: c.text for c in whole.choices}
    assert ends == {0: 1, 1: 1, 2: 1, 3: 1}
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], n=3,
                max_tokens=6, temperature=1.0, seed=5)
    answers = [c.message.content for c in client.chat.completions.create(**chat).choices]
    streamed = {}
    for c in client.chat.completions.create(**chat, stream=True):
        for choice in c.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + \
                (choice.delta.content or "")
    assert [streamed[i] for i in range(3)] == answers


def test_echo_scores_the_prompt_as_transformers_does(client, smollm2_hf, lm):
    """echo with logprobs: the prompt's text before the answer's, and each prompt token's
    log-probability (the first has none) equal to transformers' over the whole prompt; the
    answer's token is the one the prompt alone gives; a list of prompts each its own."""
    import torch
    ids = lm.tokenizer.encode(PROMPTS[0])
    out = client.completions.create(model=MODEL, prompt=[PROMPTS[0], PROMPTS[1]],
                                    max_tokens=1, temperature=0, echo=True, logprobs=1)
    first = out.choices[0]
    alone = _in_thread(lm.generate, [PROMPTS[0]], 1).texts[0]
    assert first.text == lm.tokenizer.decode(ids) + alone
    scored = first.logprobs.token_logprobs
    assert len(scored) == len(ids) + 1 and scored[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(smollm2_hf(torch.tensor([ids])).logits[0].float(), -1)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(scored[1:len(ids)]), want, atol=2e-3)
    assert first.logprobs.tokens[:len(ids)] == [lm.tokenizer.decode([t]) for t in ids]
    best = ref[:len(ids) - 1].max(-1).values  # the top entry is the most likely token's
    tops = [max(t.values()) for t in first.logprobs.top_logprobs[1:len(ids)]]
    assert torch.allclose(torch.tensor(tops), best, atol=2e-3)
    assert out.choices[1].text.startswith(PROMPTS[1])
    # streamed: the prompt and its entries first, then the answer's, as unstreamed
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1,
                                            temperature=0, echo=True, logprobs=1,
                                            stream=True))
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert pieces[0].text == lm.tokenizer.decode(ids)
    assert "".join(p.text for p in pieces) == first.text
    streamed = [v for p in pieces if p.logprobs for v in p.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(scored[1:], abs=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, extra_body={"echo": True},
                                       messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "echo"


def test_lm_eval_local_completions_scores_as_the_in_process_model(server, smollm2_store,
                                                                  tmp_path, monkeypatch):
    """lm-eval's ``local-completions`` model pointed at the server (echo and logprobs over
    token ids) scores a local two-choice task as lm-eval's in-process model does: the same
    accuracy and each choice's log-likelihood within float rounding."""
    import lm_eval
    import lm_eval.models.openai_completions  # noqa: F401 - registers local-completions
    from lm_eval.tasks import TaskManager

    import flexgen_infinigen.harness  # noqa: F401 - registers the in-process model
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    docs = [("The sun rises in the", ["east", "west"], 0),
            ("Two plus two is", ["four", "seven"], 0),
            ("Ice is frozen", ["fire", "water"], 1)]
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"context": c, "choices": ch, "label": y})
                              for c, ch, y in docs) + "\n")
    (tmp_path / "task.yaml").write_text(
        "task: served_two_choice\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n")
    tok = tmp_path / "tokenizer"  # lm-eval counts the context's tokens with its own copy
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes((Path(smollm2_store) / "tokenizer.json").read_bytes())
    (tok / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    manager = TaskManager(include_path=str(tmp_path))
    runs = {}
    for name, model, args in (
            ("served", "local-completions",
             f"model={MODEL},base_url={server}/v1/completions,tokenizer={tok},"
             "tokenizer_backend=huggingface,tokenized_requests=True"),
            ("in-process", "flexgen_infinigen", f"path={smollm2_store}")):
        out = lm_eval.simple_evaluate(model=model, model_args=args,
                                      tasks=["served_two_choice"], task_manager=manager,
                                      log_samples=True, bootstrap_iters=0)
        runs[name] = out
    accs = [r["results"]["served_two_choice"]["acc,none"] for r in runs.values()]
    assert accs[0] == accs[1]
    scores = [[ll for s in r["samples"]["served_two_choice"] for (ll, _), in s["resps"]]
              for r in runs.values()]
    assert len(scores[0]) == 2 * len(docs)
    assert scores[0] == pytest.approx(scores[1], abs=2e-3)


def test_the_client_sees_a_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}])
    # SmolLM2's template shows no tools: offering some is refused, naming the field; with
    # tool_choice "none" they are left out of the prompt and the chat is answered
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    with pytest.raises(openai.BadRequestError, match="shows no tools") as e:
        client.chat.completions.create(model=MODEL, messages=ask, tools=[weather])
    assert e.value.body["param"] == "tools"
    out = client.chat.completions.create(model=MODEL, messages=ask, tools=[weather],
                                         tool_choice="none", max_tokens=2, temperature=0)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls


def test_a_bounded_load(client, server):
    """A fixed number of requests from a few clients, streamed or not: every one answered
    once, and the server counts them."""
    finished = _metric(server, "requests_finished_total")
    answers: list[str] = []

    def worker(w):
        for i in range(6):
            args = dict(model=MODEL, prompt=PROMPTS[(w + i) % 8], max_tokens=1 + (i % 4),
                        temperature=0)
            if i % 2:
                chunks = list(client.completions.create(**args, stream=True))
                assert chunks[-1].choices[0].finish_reason
                answers.append("".join(c.choices[0].text for c in chunks))
            else:
                answers.append(client.completions.create(**args).choices[0].text)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 24 and all(answers)
    assert _metric(server, "requests_finished_total") - finished == 24
    assert _metric(server, "queue_depth") == 0


def test_stream_from_python_equals_generate(lm):
    pieces = _in_thread(lambda: list(lm.stream(PROMPTS[5], 4)))
    assert "".join(pieces) == _in_thread(lm.generate, [PROMPTS[5]], 4).texts[0]
    assert len(pieces) > 1


def test_text_stream_holds_back_stop_strings_and_half_characters(lm):
    ids = lm.tokenizer.encode("Hello world. ☃ Bye")
    stream = TextStream(lm.tokenizer, stops=["Bye"])
    out = "".join(stream.add(t) for t in ids) + stream.finish()
    assert out == "Hello world. ☃ " and stream.stopped
    stream = TextStream(lm.tokenizer)
    pieces = [stream.add(t) for t in ids]
    assert "\ufffd" not in "".join(pieces) and "".join(pieces) + stream.finish() == \
        "Hello world. ☃ Bye"


def test_run_streams_tokens(smollm2_store):
    # passive OpenMP waits: on cores other processes keep busy, spinning threads of the main
    # thread's team slow torch down many times (the server runs its engine in a thread)
    proc = subprocess.run([sys.executable, "-m", "flexgen_infinigen.run", "--path",
                           str(smollm2_store), "--prompt", PROMPTS[0], "--no-chat",
                           "--gen-len", "3", "--stream"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]  # the text, before the report
    assert first.startswith(" Paris") and first.strip() in proc.stdout.split("[generated]")[1]


def test_a_taken_port_is_one_error_before_loading(server):
    port = server.rsplit(":", 1)[1]
    proc = subprocess.run([sys.executable, "-m", "flexgen_infinigen.serve", "--port", port],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: cannot listen")


def test_api_key_and_full_queue(server):
    assert httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "hi"}
                      ).status_code == 401
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer nope"}
                     ).json()["error"]["code"] == "invalid_api_key"
    codes, texts = _ask_together(server, 30, 4)
    # 8 rows running and --max-queue 12 waiting: the rest are told to come back later
    assert 503 in codes and 200 in codes and len(codes) == 30
    assert len(texts) == codes.count(200) and all(texts)


SYSTEM = ("You are a careful assistant for a small bakery. Answer in one short sentence, "
          "name the bread, give its price in euros, and say whether it has seeds, nuts or "
          "milk in it. The breads are rye, spelt, white, sourdough, brioche and a seeded "
          "loaf; the shop opens at seven and closes at two.")


def _two_turns(client, max_tokens: int = 6):
    """(the second turn's messages, its answer): a chat whose second turn repeats the
    first's history, the first's answer and a new question."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What does the rye bread cost?"}]
    one = client.chat.completions.create(model=MODEL, messages=messages,
                                         max_tokens=max_tokens, temperature=0)
    messages += [{"role": "assistant", "content": one.choices[0].message.content},
                 {"role": "user", "content": "And the brioche?"}]
    return messages, client.chat.completions.create(model=MODEL, messages=messages,
                                                    max_tokens=max_tokens, temperature=0)


def test_a_chats_second_turn_prefills_only_what_is_new(client, lm, server):
    """The second turn finds the first turn's pages (its prompt and answer, kept when its
    block ended): usage reports the cached prompt tokens (whole pages), the metrics count
    them, and the answer is the library's, which prefills everything."""
    hits = _metric(server, "prefix_cache_hits_total")
    firsts = _metric(server, "time_to_first_token_seconds_count")
    messages, two = _two_turns(client)
    # two answers: each timed once to its first token and once to its end
    assert _metric(server, "time_to_first_token_seconds_count") - firsts == 2
    assert _metric(server, "e2e_request_latency_seconds_count") >= 2
    cached = two.usage.prompt_tokens_details.cached_tokens
    ids = chat_prompt_ids(lm.tokenizer, store_template(lm.store_path), messages)
    assert 64 <= cached < len(ids) and cached % 64 == 0  # whole pages, never the last token
    assert _metric(server, "prefix_cache_hits_total") - hits == cached
    assert two.choices[0].message.content == _in_thread(lm.generate, [ids], 6).texts[0]


def _check_stream_timing(url: str, messages: list[dict]) -> None:
    """A streamed chat: comments keep the connection while the prompt prefills (a 100-token
    prompt takes longer than --sse-keepalive-s 0.02), and the role chunk comes with the
    first token, not when the request is accepted."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=AUTH,
                      timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    data = [line for line in lines if line.startswith("data: {")]
    assert lines[0] == ": keep-alive"  # nothing before the prefill ends, the role included
    first = json.loads(data[0][6:])["choices"][0]["delta"]
    assert first == {"role": "assistant", "content": ""} and lines[-1] == "data: [DONE]"


def test_prefix_pages_outlive_a_restart(smollm2_store, tmp_path, lm):
    """With --prefix-cache-dir a new server answers a chat's second turn from the pages the
    last one left on disk, and a page cut short is a miss, not a wrong answer."""
    flags = ("--prefix-cache-gb", "0.001", "--prefix-cache-disk-gb", "1",
             "--prefix-cache-dir", str(tmp_path / "pages"), "--api-key", KEY,
             "--sse-keepalive-s", "0.02")
    proc, url = _start(smollm2_store, *flags)
    try:
        first = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        messages, _ = _two_turns(first)
    finally:
        _stop(proc)
    files = sorted((tmp_path / "pages").iterdir())
    assert files
    proc, url = _start(smollm2_store, *flags)
    try:
        later = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        again = later.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                              temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens >= 64
        _check_stream_timing(url, messages)
        for f in sorted((tmp_path / "pages").iterdir()):
            f.write_bytes(f.read_bytes()[:-5])  # every page cut short
        other = later.chat.completions.create(model=MODEL, messages=messages[:2],
                                              max_tokens=6, temperature=0)
        assert other.usage.prompt_tokens_details is None  # nothing cached: all prefilled
        ids = chat_prompt_ids(lm.tokenizer, store_template(lm.store_path), messages)
        assert again.choices[0].message.content == _in_thread(lm.generate, [ids], 6).texts[0]
        first_ids = chat_prompt_ids(lm.tokenizer, store_template(lm.store_path), messages[:2])
        assert other.choices[0].message.content == \
            _in_thread(lm.generate, [first_ids], 6).texts[0]
    finally:
        _stop(proc)


def _ask_together(url: str, n: int, max_tokens: int) -> tuple[list[int], list[str]]:
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": max_tokens, "temperature": 0}
    codes: list[int] = []
    texts: list[str] = []

    def ask():
        r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)
        codes.append(r.status_code)
        if r.status_code == 503:  # come back in about one block's time
            assert 1 <= int(r.headers["retry-after"]) <= 60
        if r.status_code == 200:
            texts.append(r.json()["choices"][0]["text"])
        else:
            assert r.json()["error"]["message"]

    threads = [threading.Thread(target=ask) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes, texts


def test_a_thinking_models_reasoning_is_its_own_field(smollm2_store, tmp_path, lm):
    """A template that opens the thought in the generation prompt (as DeepSeek-R1's does):
    the answer, which never closes it, is all reasoning: ``reasoning_content`` holds the
    library's text for the same prompt, streamed as reasoning deltas, and content is empty;
    ``--reasoning-format none`` would leave it in content (tests/test_reasoning.py)."""
    template = store_template(smollm2_store).replace(
        "'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'") + "{# </think> #}"
    assert "<think>" in template
    path = tmp_path / "thinking.jinja"
    path.write_text(template)
    proc, url = _start(smollm2_store, "--chat-template", str(path), "--api-key", KEY)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        ask = [{"role": "user", "content": "Why is the sky blue?"}]
        out = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=6,
                                             temperature=0)
        ids = chat_prompt_ids(lm.tokenizer, template, ask)
        expected = _in_thread(lm.generate, [ids], 6).texts[0].strip("\n")
        message = out.choices[0].message
        assert message.reasoning_content == expected and not message.content
        chunks = list(client.chat.completions.create(model=MODEL, messages=ask, max_tokens=6,
                                                     temperature=0, stream=True))
        thought = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                          for c in chunks if c.choices)
        assert thought.strip("\n") == expected
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finally:
        _stop(proc)


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}


def test_structured_output_holds_its_schema_beside_a_free_row(client, lm):
    """A json_schema answer parses and holds the schema (llguidance's mask, row by row), and
    a free request in the same block answers what it answers alone; a schema the library
    cannot compile is a 400 with its reason; json_object gives an object."""
    ask = [{"role": "user", "content": "Invent a person and give their name and age."}]
    free = {}
    other = threading.Thread(target=lambda: free.update(out=client.completions.create(
        model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0)))
    other.start()
    out = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=60, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    other.join()
    person = json.loads(out.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str)
    assert len(person["name"]) <= 12 and isinstance(person["age"], int)
    assert out.choices[0].finish_reason == "stop"  # the grammar ended: only the end was left
    assert free["out"].choices[0].text == _in_thread(lm.generate, [PROMPTS[3]], 8).texts[0]

    anything = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=40,
                                              temperature=0,
                                              response_format={"type": "json_object"})
    text = anything.choices[0].message.content
    assert text.lstrip().startswith("{")
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    with pytest.raises(openai.BadRequestError, match="strin") as e:
        client.chat.completions.create(
            model=MODEL, messages=ask, max_tokens=5, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "object", "properties": {"a": {"type": "strin"}}}}})
    assert e.value.body["param"] == "response_format"


def test_sigterm_drains_and_exits(server):
    """The last test of the module: SIGTERM while requests run and wait; every request
    already taken is answered, then the server exits."""
    proc = SERVERS[server]
    result: dict = {}
    admitted = _metric(server, "requests_admitted_total")
    asking = threading.Thread(target=lambda: result.update(
        zip(("codes", "texts"), _ask_together(server, 10, 6))))
    asking.start()
    deadline = time.monotonic() + 60  # every request taken (a later one would be refused)
    while _metric(server, "requests_admitted_total") - admitted < 10:
        assert time.monotonic() < deadline, "the requests were never taken"
        time.sleep(0.05)
    code, err = _stop(proc)
    asking.join()
    assert result["codes"] == [200] * 10 and all(result["texts"])
    assert code in (0, 143) and "every request taken was answered" in err
