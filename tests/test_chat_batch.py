"""The chat template, the repetition penalty (against transformers), and the resumable batch
command."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.sampling import SamplingConfig


def test_chat_answers_a_question(smollm2_store, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flexgen_infinigen.run", "--path",
                           str(smollm2_store), "--prompt", "What is the capital of France?",
                           "--gen-len", "24", "--json", tmp_path / "r.json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert "Paris" in report["texts"][0]
    assert report["token_ids"][0][-1] == 2  # stopped at the end of its turn (<|im_end|>)


def test_chat_template_renders_like_transformers(smollm2_store):
    """Our jinja rendering of the stored template equals transformers' apply_chat_template."""
    from transformers import PreTrainedTokenizerFast

    from flexgen_infinigen.text.chat import chat_prompt_ids, store_template
    from flexgen_infinigen.text.tokenizer import load_tokenizer

    template = store_template(smollm2_store)
    tok = load_tokenizer(smollm2_store)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.tok, bos_token="<|im_start|>",
                                 eos_token="<|im_end|>")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another?"}]
    ref = hf.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                 tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert chat_prompt_ids(tok, template, messages) == list(ref)


def test_repetition_penalty_matches_transformers(tiny_llama):
    model, store = tiny_llama
    prompt = [1, 5, 9, 5, 9, 5, 9, 33, 44]
    with OffloadedLM.load(path=store, policy=Placement(), progress=False) as lm:
        out = lm.generate([prompt], 12, SamplingConfig(repetition_penalty=1.8),
                          stop_token_id=None)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                             do_sample=False, repetition_penalty=1.8, pad_token_id=0)
    assert out.token_ids[0] == ref[0, len(prompt):].tolist()
    with OffloadedLM.load(path=store, policy=Placement(), progress=False) as lm:
        plain = lm.generate([prompt], 12, stop_token_id=None)
    assert plain.token_ids != out.token_ids  # the penalty changed something


def _batch(args, cwd):
    return subprocess.run([sys.executable, "-m", "flexgen_infinigen.batch", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_batch_resumes_without_duplicates(tiny_opt, tmp_path):
    requests = [{"id": f"r{i}", "prompt": [2] + [(7 * i + k) % 400 + 4 for k in range(3 + i)]}
                for i in range(7)]
    requests[3]["gen_len"] = 3
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in requests) + "\n")
    common = ["--path", tiny_opt[1], "--input", tmp_path / "in.jsonl", "--gen-len", "5",
              "--gpu-batch-size", "2", "--no-chat"]
    whole = _batch([*common, "--output", tmp_path / "whole.jsonl"], tmp_path)
    assert whole.returncode == 0, whole.stderr
    reference = {r["id"]: r for r in _lines(tmp_path / "whole.jsonl")}
    assert sorted(reference) == sorted(r["id"] for r in requests)
    assert len(reference["r3"]["token_ids"]) == 3 and len(reference["r0"]["token_ids"]) == 5
    # an interruption: the first block written, the next one cut mid-line
    lines = (tmp_path / "whole.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "resumed.jsonl").write_text("".join(lines[:2]) + lines[2][:10])
    again = _batch([*common, "--output", tmp_path / "resumed.jsonl"], tmp_path)
    assert again.returncode == 0, again.stderr
    got = _lines(tmp_path / "resumed.jsonl")
    assert sorted(r["id"] for r in got) == sorted(reference)  # every id exactly once
    for r in got:
        assert r == reference[r["id"]]


@pytest.mark.parametrize("line, words", [
    ('{"prompt": "hi"}', ["line 1", "id"]),
    ('{"id": 1}', ["line 1", "prompt", "messages"]),
    ('{"id": 1, "prompt": "hi", "gen_len": 0}', ["gen_len"]),
    ('not json', ["line 1", "not JSON"]),
])
def test_batch_bad_input_is_one_line_before_loading(tmp_path, line, words):
    (tmp_path / "in.jsonl").write_text(line + "\n")
    proc = _batch(["--model", "opt-125m", "--dummy", "--input", tmp_path / "in.jsonl",
                   "--output", tmp_path / "out.jsonl"], tmp_path)
    err = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    for w in words:
        assert w in err[0]


def test_batch_duplicate_ids(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    proc = _batch(["--model", "opt-125m", "--dummy", "--input", tmp_path / "in.jsonl",
                   "--output", tmp_path / "out.jsonl"], tmp_path)
    assert proc.returncode == 2 and "appears twice" in proc.stderr


def _openai(custom_id, url, **body):
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_openai_batch_gives_our_texts(smollm2_store, tmp_path):
    """The same chat and completion requests in our format and in the OpenAI Batch format,
    greedy: the same texts and token counts; unsupported options refused on their own line
    while the rest of the job runs; a stop string cuts the text."""
    ours = [{"id": "c", "messages": QUESTION, "gen_len": 8, "temperature": 0},
            {"id": "p", "prompt": "The capital of France is", "gen_len": 8, "temperature": 0}]
    theirs = [_openai("c", CHAT, messages=QUESTION, max_tokens=8, temperature=0),
              _openai("p", COMPLETION, prompt="The capital of France is", max_tokens=8,
                      temperature=0, model="anything"),
              _openai("two", CHAT, messages=QUESTION, n=2, stream=True),
              _openai("lp", CHAT, messages=QUESTION, echo=True),
              _openai("tools", CHAT, messages=QUESTION, tools=[{"type": "function"}]),
              _openai("cut", COMPLETION, prompt="The capital of France is", max_tokens=8,
                      temperature=0, stop=["France", " Paris"])]
    for name, rows in (("ours", ours), ("theirs", theirs)):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
        proc = _batch(["--path", smollm2_store, "--input", tmp_path / f"{name}.jsonl",
                       "--output", tmp_path / f"{name}.out.jsonl", "--no-chat"], tmp_path)
        assert proc.returncode == 0, proc.stderr
    mine = {r["id"]: r for r in _lines(tmp_path / "ours.out.jsonl")}
    got = {r["custom_id"]: r for r in _lines(tmp_path / "theirs.out.jsonl")}
    assert sorted(got) == sorted(r["custom_id"] for r in theirs)
    chat, completion = got["c"]["response"]["body"], got["p"]["response"]["body"]
    assert got["c"]["response"]["status_code"] == 200 and got["c"]["error"] is None
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": mine["c"]["text"]}
    assert completion["choices"][0]["text"] == mine["p"]["text"]
    for key, body in (("c", chat), ("p", completion)):
        usage = body["usage"]
        assert usage["completion_tokens"] == len(mine[key]["token_ids"])
        assert usage["prompt_tokens"] == mine[key]["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert body["choices"][0]["finish_reason"] == mine[key]["finish_reason"]
    for key, word in (("two", "stream"), ("lp", "echo"), ("tools", "tools")):
        assert got[key]["response"] is None and word in got[key]["error"]["message"]
    cut = got["cut"]["response"]["body"]["choices"][0]
    assert " Paris" in mine["p"]["text"]
    assert cut["text"] == mine["p"]["text"].split(" Paris")[0]
    assert cut["finish_reason"] == "stop"


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}


def test_openai_batch_holds_lines_to_their_json_schema(smollm2_store, tmp_path):
    """A json_schema line answers JSON that holds its schema beside a free line, which
    answers what it answers without one; a schema the grammar library cannot compile is
    refused on its own line, with the library's reason; without refilled rows a
    constrained line is refused, naming the flag."""
    ask = [{"role": "user", "content": "Invent a person and give their name and age."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}
    lines = [_openai("person", CHAT, messages=ask, max_tokens=60, temperature=0,
                     response_format=fmt),
             _openai("free", COMPLETION, prompt="The capital of France is", max_tokens=8,
                     temperature=0),
             _openai("bad", CHAT, messages=ask, max_tokens=5, response_format=bad)]
    (tmp_path / "in.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    proc = _batch(["--path", smollm2_store, "--input", tmp_path / "in.jsonl", "--output",
                   tmp_path / "out.jsonl"], tmp_path)
    assert proc.returncode == 0 and "1 of them errors" in proc.stderr, proc.stderr
    got = {r["custom_id"]: r for r in _lines(tmp_path / "out.jsonl")}
    choice = got["person"]["response"]["body"]["choices"][0]
    person = json.loads(choice["message"]["content"])
    assert set(person) == {"name", "age"} and isinstance(person["name"], str)
    assert len(person["name"]) <= 12 and isinstance(person["age"], int)
    assert choice["finish_reason"] == "stop"
    assert got["bad"]["response"] is None and "strin" in got["bad"]["error"]["message"]
    assert got["bad"]["error"]["param"] == "response_format"
    with OffloadedLM.load(path=smollm2_store, progress=False) as lm:
        alone = lm.generate(["The capital of France is"], 8).texts[0]
    assert got["free"]["response"]["body"]["choices"][0]["text"] == alone
    proc = _batch(["--path", smollm2_store, "--input", tmp_path / "in.jsonl", "--output",
                   tmp_path / "blocks.jsonl", "--no-refill"], tmp_path)
    refused = {r["custom_id"]: r for r in _lines(tmp_path / "blocks.jsonl")}["person"]
    assert refused["response"] is None and "--no-refill" in refused["error"]["message"]


def test_openai_batch_resumes(tiny_opt, tmp_path):
    rows = [_openai(f"r{i}", COMPLETION, prompt=[2] + [(5 * i + k) % 400 + 4 for k in range(4)],
                    max_tokens=4, temperature=0) for i in range(5)]
    (tmp_path / "in.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    common = ["--path", tiny_opt[1], "--input", tmp_path / "in.jsonl", "--gpu-batch-size", "2"]
    assert _batch([*common, "--output", tmp_path / "whole.jsonl"], tmp_path).returncode == 0
    whole = {r["custom_id"]: r for r in _lines(tmp_path / "whole.jsonl")}
    lines = (tmp_path / "whole.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "resumed.jsonl").write_text("".join(lines[:2]) + lines[2][:15])
    again = _batch([*common, "--output", tmp_path / "resumed.jsonl"], tmp_path)
    assert again.returncode == 0, again.stderr
    got = _lines(tmp_path / "resumed.jsonl")
    assert sorted(r["custom_id"] for r in got) == sorted(whole)  # every request once
    for r in got:
        assert r["response"]["body"]["choices"] == whole[r["custom_id"]]["response"]["body"][
            "choices"]


@pytest.mark.parametrize("lines, words", [
    ([_openai("a", COMPLETION, prompt="x"), {"id": "b", "prompt": "y"}],
     ["line 2", "our format", "line 1", "OpenAI"]),
    ([_openai("a", "/v1/embeddings", input="x")], ["line 1", "/v1/embeddings"]),
    ([{"custom_id": "a", "url": CHAT}], ["line 1", "body"]),
    ([_openai("a", COMPLETION, prompt="x"), _openai("a", COMPLETION, prompt="y")],
     ["line 2", "twice"]),
])
def test_openai_batch_bad_lines_are_one_error_before_loading(tmp_path, lines, words):
    (tmp_path / "in.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    proc = _batch(["--model", "opt-125m", "--dummy", "--input", tmp_path / "in.jsonl",
                   "--output", tmp_path / "out.jsonl"], tmp_path)
    err = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    for w in words:
        assert w in err[0], (w, err[0])


def test_openai_batch_serves_choices_logprobs_and_echo(smollm2_store, smollm2_hf, tmp_path):
    """``n`` choices, each as the line seeded ``seed + j`` answers alone; a completion's echo
    with logprobs scores its prompt as transformers does; a chat's greedy logprobs name the
    tokens of its answer, each the most likely. Without refilled rows such a line is refused,
    naming the flag."""
    import torch

    prompt = "The capital of France is"
    lines = [_openai("three", CHAT, messages=QUESTION, n=3, max_tokens=6, temperature=1.0,
                     seed=7),
             *[_openai(f"seed{j}", CHAT, messages=QUESTION, max_tokens=6, temperature=1.0,
                       seed=7 + j) for j in range(3)],
             _openai("echo", COMPLETION, prompt=prompt, max_tokens=2, temperature=0,
                     echo=True, logprobs=1),
             _openai("lp", CHAT, messages=QUESTION, max_tokens=5, temperature=0,
                     logprobs=True, top_logprobs=2)]
    (tmp_path / "in.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    proc = _batch(["--path", smollm2_store, "--input", tmp_path / "in.jsonl", "--output",
                   tmp_path / "out.jsonl"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = {r["custom_id"]: r["response"]["body"] for r in _lines(tmp_path / "out.jsonl")}
    three = got["three"]["choices"]
    assert [c["index"] for c in three] == [0, 1, 2]
    assert [c["message"]["content"] for c in three] == [
        got[f"seed{j}"]["choices"][0]["message"]["content"] for j in range(3)]
    assert len({c["message"]["content"] for c in three}) > 1  # sampled apart
    alone = sum(got[f"seed{j}"]["usage"]["completion_tokens"] for j in range(3))
    assert got["three"]["usage"]["completion_tokens"] == alone
    assert got["three"]["usage"]["prompt_tokens"] == got["seed0"]["usage"]["prompt_tokens"]

    with OffloadedLM.load(path=smollm2_store, progress=False) as lm:
        ids = lm.tokenizer.encode(prompt)
        answer = lm.generate([prompt], 2).texts[0]
    echo = got["echo"]["choices"][0]
    assert echo["text"] == lm.tokenizer.decode(ids) + answer
    scored = echo["logprobs"]["token_logprobs"]
    assert len(scored) == len(ids) + 2 and scored[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(smollm2_hf(torch.tensor([ids])).logits[0].float(), -1)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(scored[1:len(ids)]), want, atol=2e-3)

    lp = got["lp"]["choices"][0]
    entries = lp["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == lp["message"]["content"]
    for e in entries:  # greedy: the chosen token is the most likely of its two alternatives
        assert len(e["top_logprobs"]) == 2 and e["logprob"] <= 0
        assert e["logprob"] == pytest.approx(max(t["logprob"] for t in e["top_logprobs"]))

    proc = _batch(["--path", smollm2_store, "--input", tmp_path / "in.jsonl", "--output",
                   tmp_path / "blocks.jsonl", "--no-refill"], tmp_path)
    refused = {r["custom_id"]: r for r in _lines(tmp_path / "blocks.jsonl")}
    for key, param in (("three", "n"), ("echo", "logprobs"), ("lp", "logprobs")):
        assert refused[key]["response"] is None and refused[key]["error"]["param"] == param
        assert "--no-refill" in refused[key]["error"]["message"]
    assert refused["seed0"]["error"] is None


def test_openai_batch_splits_a_thinking_models_reasoning(smollm2_store, tmp_path):
    """A template that opens the thought in the generation prompt: a batch chat's answer,
    which never closes it, is all ``reasoning_content`` (the library's text for the same
    prompt) and its content empty, in a plain line and in one with logprobs alike, as the
    server answers."""
    from flexgen_infinigen.text.chat import chat_prompt_ids, store_template

    template = store_template(smollm2_store).replace(
        "'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'") + "{# </think> #}"
    path = tmp_path / "thinking.jinja"
    path.write_text(template)
    ask = [{"role": "user", "content": "Why is the sky blue?"}]
    lines = [_openai("plain", CHAT, messages=ask, max_tokens=6, temperature=0),
             _openai("scored", CHAT, messages=ask, max_tokens=6, temperature=0, logprobs=True)]
    (tmp_path / "in.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    proc = _batch(["--path", smollm2_store, "--input", tmp_path / "in.jsonl", "--output",
                   tmp_path / "out.jsonl", "--chat-template", path], tmp_path)
    assert proc.returncode == 0, proc.stderr
    with OffloadedLM.load(path=smollm2_store, progress=False) as lm:
        ids = chat_prompt_ids(lm.tokenizer, template, ask)
        expected = lm.generate([ids], 6).texts[0].strip("\n")
    got = {r["custom_id"]: r["response"]["body"] for r in _lines(tmp_path / "out.jsonl")}
    for key in ("plain", "scored"):
        message = got[key]["choices"][0]["message"]
        assert message["reasoning_content"] == expected and not message["content"], key


def test_openai_batch_answers_a_forced_call_as_tool_calls(smollm2_store, tmp_path):
    """A template that teaches <tool_call> blocks: a batch line whose tool_choice names a
    function answers with that call in ``tool_calls``, its arguments holding the tool's
    schema (what the template teaches reaches the answer's reading)."""
    from flexgen_infinigen.text.chat import store_template

    path = tmp_path / "tools.jinja"
    path.write_text(store_template(smollm2_store) + "{# <tool_call></tool_call> #}")
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 12}}}}}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    lines = [_openai("call", CHAT, messages=ask, max_tokens=40, temperature=0, tools=[weather],
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})]
    (tmp_path / "in.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    proc = _batch(["--path", smollm2_store, "--input", tmp_path / "in.jsonl", "--output",
                   tmp_path / "out.jsonl", "--chat-template", path], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (line,) = _lines(tmp_path / "out.jsonl")
    choice = line["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and set(args) == {"city"}
    assert len(args["city"]) <= 12 and choice["message"]["content"] is None
