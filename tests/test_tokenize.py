"""``/tokenize`` and ``/detokenize`` against the tokenizer itself: the ids are the ones the
``tokenizers`` library gives for the store's ``tokenizer.json``, a chat's count is the one a
chat completion reports as its prompt tokens, and bad input is one 400 naming the field."""
from __future__ import annotations

from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
tokenizers = pytest.importorskip("tokenizers")

from test_serve import MODEL, _start, _stop  # noqa: E402

KEY = "tokenize-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXT = "Hello there: what is 2 + 2? <|im_start|>system"


@pytest.fixture(scope="module")
def server(smollm2_codes_store):
    proc, url = _start(smollm2_codes_store, "--api-key", KEY)
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def reference(smollm2_codes_store):
    return tokenizers.Tokenizer.from_file(str(Path(smollm2_codes_store) / "tokenizer.json"))


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60)


@pytest.mark.parametrize("field", ["content", "prompt"])
def test_tokenize_gives_the_tokenizers_ids_and_detokenize_inverts_it(server, reference, field):
    r = _post(server, "/tokenize", {field: TEXT, "with_pieces": True})
    assert r.status_code == 200, r.text
    out = r.json()
    # control-token text typed by a client is text, as a served prompt's is: no control id
    assert reference.token_to_id("<|im_start|>") not in out["tokens"]
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    assert reference.decode(out["tokens"], skip_special_tokens=False) == TEXT
    assert len(out["pieces"]) == len(out["tokens"])
    back = _post(server, "/detokenize", {"tokens": out["tokens"]}).json()
    assert back["content"] == back["prompt"] == TEXT
    # text without control-token text: exactly the library's ids
    simple = "The capital of France is"
    got = _post(server, "/tokenize", {field: simple}).json()["tokens"]
    assert got == reference.encode(simple, add_special_tokens=False).ids


def test_a_chats_count_is_the_completions_prompt_tokens(server):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."}]
    counted = _post(server, "/tokenize", {"messages": messages}).json()["count"]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY)
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                            temperature=0)
    assert counted == answer.usage.prompt_tokens


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"content": "a", "prompt": "b"}, "prompt"),
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [1, 49152]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_bad_input_is_one_400_naming_the_field(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert httpx.get(f"{server}/health").status_code == 200


def test_the_key_is_needed(server):
    r = httpx.post(f"{server}/tokenize", json={"content": "hi"}, timeout=60)
    assert r.status_code == 401
