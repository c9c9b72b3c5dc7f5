"""gpt-oss's harmony answers (flexgen_infinigen.text.harmony): the examples of OpenAI's
harmony format split into reasoning, content and tool calls, the whole answer and the stream
alike in every cut; a harmony vocabulary keeps its markers in the decoded text and ends an
answer at ``<|return|>`` and ``<|call|>``, not at ``<|end|>``; token ids through the
server's stream give the chunks a client assembles into the unstreamed message; and a server
over a tiny gpt-oss with a harmony tokenizer answers a forced call with arguments that hold
the tool's schema, streamed and not."""
from __future__ import annotations

import json
import re

import pytest

from flexgen_infinigen.text.harmony import HarmonyStream, speaks, split
from flexgen_infinigen.text.incremental import TextStream
from flexgen_infinigen.text.tool_calls import format_of

SPECIALS = ["<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>",
            "<|return|>", "<|call|>", "<|constrain|>"]
CALL = ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|>'
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"location": "San Francisco"}')
CASES = [
    # (answer as decoded, reasoning, content, calls as (name, arguments))
    ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide '
     'answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.',
     'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", []),
    (CALL, "Need to use function get_weather.", None,
     [("get_weather", {"location": "San Francisco"})]),
    # the recipient in the role's header, and a preamble to the user before the call
    ('<|channel|>commentary<|message|>Checking the weather.<|end|><|start|>assistant '
     'to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Oslo"}',
     None, "Checking the weather.", [("get_weather", {"location": "Oslo"})]),
    # cut by max_tokens: inside the analysis, inside a call's arguments, inside a header
    ("<|channel|>analysis<|message|>Thinking about", "Thinking about", "", []),
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"loc',
     None, '{"loc', []),
    ("<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>fin",
     "Done.", "", []),
    ("A model that wrote no harmony at all.", None, "A model that wrote no harmony at all.", []),
]


def _events(text: str, size: int, **kw) -> list[tuple[str, object]]:
    stream = HarmonyStream(**kw)
    out = []
    for i in range(0, len(text), size):
        out += stream.add(text[i:i + size])
    return out + stream.finish()


@pytest.mark.parametrize("answer,reasoning,content,calls", CASES)
def test_the_answer_and_the_stream_split_alike(answer, reasoning, content, calls):
    thought, said, found = split(answer)
    assert (thought, said) == (reasoning, content)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in found] == calls
    for size in (1, 2, 5, len(answer)):  # markers split across pieces in every way
        events = _events(answer, size)
        assert "".join(v for k, v in events if k == "reasoning") == (reasoning or "")
        streamed = [[v["function"]["name"], ""] for k, v in events if k == "call"]
        args = "".join(v for k, v in events if k == "arguments")
        if streamed:
            streamed[-1][1] = args
        valid = [v for k, v in events if k == "valid"]
        good = [(n, json.loads(a)) for n, a in streamed if valid == [True]]
        assert good == calls
        # a call cut short was streamed as a call; unstreamed it is the content
        said = "".join(v for k, v in events if k == "content")
        assert said == (content or "") or (valid == [False] and args == content)


def test_without_reasoning_or_tools_the_parts_are_content():
    assert split(CALL, reasoning=False, tools=False) == (
        None, 'Need to use function get_weather.{"location": "San Francisco"}', [])
    events = _events(CALL, 3, reasoning=False, tools=False)
    assert {k for k, _ in events} == {"content"}


def test_the_template_says_harmony():
    template = "{{ '<|start|>' }}assistant<|channel|>final<|message|>{{ m }}<|end|>"
    assert speaks(template) and format_of(template) == "harmony"
    assert not speaks("<|im_start|>{{ m }}<|im_end|>") and not speaks(None)


def _tokenizer_file(path, specials=tuple(SPECIALS)):
    """A byte-level tokenizer whose specials are harmony's (what gpt-oss's o200k_harmony
    marks special), saved as ``tokenizer.json``."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(path))
    return path


@pytest.fixture
def tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    from flexgen_infinigen.text.tokenizer import Tokenizer

    return Tokenizer.from_file(_tokenizer_file(tmp_path / "tokenizer.json"))


def test_a_harmony_vocabulary_keeps_its_markers_and_ends_at_return_and_call(tokenizer,
                                                                           tmp_path):
    ids = tokenizer.encode(CALL)
    specials = {t: tokenizer.tok.token_to_id(t) for t in SPECIALS}
    assert specials["<|channel|>"] in ids and tokenizer.decode(ids) == CALL
    assert tokenizer.stop_token_ids >= {specials["<|return|>"], specials["<|call|>"]}
    assert specials["<|end|>"] not in tokenizer.stop_token_ids
    # a vocabulary without harmony's channels still ends a turn at <|end|> (Phi's)
    from flexgen_infinigen.text.tokenizer import Tokenizer

    plain = Tokenizer.from_file(_tokenizer_file(tmp_path / "plain.json",
                                                ("<|endoftext|>", "<|end|>")))
    assert plain.tok.token_to_id("<|end|>") in plain.stop_token_ids
    assert plain.decode(plain.encode("a<|end|>b")) == "ab"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "pattern": "^[A-Za-z ]{1,10}$"}},
    "required": ["location"], "additionalProperties": False}}}


@pytest.mark.parametrize("answer", [CASES[0][0], CALL, CASES[2][0], CASES[3][0]])
def test_the_served_stream_assembles_into_the_served_message(tokenizer, answer):
    from flexgen_infinigen.serving.requests import ServeRequest
    from flexgen_infinigen.serving.stream import ChoiceStream

    served = ServeRequest("chat", [1], 64, None, [], None, True, False, "m",
                          tool_format="harmony", tools=[WEATHER], reasoning="harmony",
                          harmony=True)
    ids = tokenizer.encode(answer)
    text, stream, chunks = TextStream(tokenizer), ChoiceStream(served), []
    for token in ids:  # as the engine hands out each token's final text
        chunks += stream.chunks("token", text.add(token), None)
    chunks += stream.chunks("done", text.finish(), "stop")
    message = served.response(text.text, "stop", [])["choices"][0]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    calls = {}
    for d in deltas:
        for c in d.get("tool_calls", ()):
            calls.setdefault(c["index"], [c["function"].get("name"), ""])[1] += \
                c["function"]["arguments"]
    expected = message["message"]
    thought, said, found = split(answer)  # the answer as written, markers and all
    assert expected.get("reasoning_content") == thought and expected["content"] == said
    assert len(expected.get("tool_calls", ())) == len(found)
    assert reasoning == (expected.get("reasoning_content") or "")
    assert content == (expected["content"] or "")
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in expected.get("tool_calls", ())]
    reason = chunks[-1]["choices"][0]["finish_reason"]
    assert reason == message["finish_reason"] == ("tool_calls" if calls else "stop")
    assert "<|" not in reasoning + content  # no marker reaches the client


# A harmony template in gpt-oss's shape (its published one is not in this repository): the
# tools in a developer message, calls as commentary messages to functions.NAME, tool results
# from functions.NAME, and the generation prompt <|start|>assistant.
TEMPLATE = """\
{%- if tools -%}<|start|>developer<|message|># Tools
{%- for t in tools %} {{ t.function.name }}: {{ t.function.parameters | tojson }}{% endfor -%}
<|end|>{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' and m.tool_calls -%}
<|start|>assistant to=functions.{{ m.tool_calls[0].function.name }}<|channel|>commentary \
json<|message|>{{ m.tool_calls[0].function.arguments | tojson }}<|call|>
{%- elif m.role == 'assistant' -%}
<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'tool' -%}
<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\
{{ m.content | tojson }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    """A server of a tiny random gpt-oss whose tokenizer and template are harmony's."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("llguidance")
    import torch
    from test_serve import _start, _stop

    from flexgen_infinigen.weights.hf_convert import convert_hf

    folder = tmp_path_factory.mktemp("harmony")
    _tokenizer_file(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    ids = {t: 256 + i for i, t in enumerate(SPECIALS)}
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|return|>"],
        pad_token_id=ids["<|endoftext|>"])
    transformers.GptOssForCausalLM(config).save_pretrained(folder)
    store = convert_hf(folder, folder / "store", "gpt-oss-tiny", progress=False)
    proc, url = _start(store, "--gpu-batch-size", "2")
    yield url
    _stop(proc)


def test_a_gpt_oss_server_makes_a_forced_call_streamed_and_not(harmony_server):
    """A named tool_choice is held by the harmony grammar (a commentary message to the
    function, its body the tool's schema): the answer is that call, ended by <|call|>, and
    the stream's deltas assemble into the unstreamed arguments."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{harmony_server}/v1", api_key="x", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    ask = dict(model=model, messages=[{"role": "user", "content": "Weather in Oslo?"}],
               tools=[WEATHER], tool_choice={"type": "function",
                                             "function": {"name": "get_weather"}},
               temperature=0, max_tokens=80)
    out = client.chat.completions.create(**ask)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather"
    # the schema, checked by hand: one key, a string of 1-10 letters or spaces
    assert set(args) == {"location"}, args
    assert re.fullmatch(r"[A-Za-z ]{1,10}", args["location"]), args

    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and len(deltas) > 2
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # the call and its result go back through the template; the answer is harmony again
    follow = ask["messages"] + [choice.message.model_dump(exclude_none=True),
                                {"role": "tool", "tool_call_id": call.id, "content": "4 C"}]
    again = client.chat.completions.create(model=model, messages=follow, tools=[WEATHER],
                                           max_tokens=12, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert "<|" not in (again.choices[0].message.content or "")
