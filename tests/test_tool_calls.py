"""Tool calls (flexgen_infinigen.text.tool_calls and the request checks): each family's
written form parses to OpenAI's ``tool_calls`` with the arguments as written, text around a
call stays content, anything malformed or cut short stays text; a stream sends the text
before a call and the call's arguments piece by piece, which a client assembles into the
calls the whole answer holds; a request's tools, tool_choice and tool
messages are checked field by field. With the real Qwen2.5 GGUF (FLEXGEN_INFINIGEN_QWEN_GGUF),
a server answers a weather question with a call, streamed and not, and takes the result."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flexgen_infinigen.cli import openai_batch
from flexgen_infinigen.text.call_stream import CallStream
from flexgen_infinigen.text.tool_calls import format_of, parse

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_each_family_writes_its_calls_its_own_way():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call>')
    content, calls = parse(text, "hermes")
    assert content == "Let me look." and _calls(calls) == [("get_weather", {"city": "Paris"}),
                                                           ("get_weather", {"city": "Oslo"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2

    old = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    new = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
    for text in (old, new):
        content, calls = parse(text, "mistral")
        assert content is None and _calls(calls) == [("get_weather", {"city": "Rome"})]

    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}; ' \
           '{"name": "get_weather", "parameters": {"city": "Quito"}}'
    assert _calls(parse(text, "llama3")[1]) == [("get_weather", {"city": "Lima"}),
                                                ("get_weather", {"city": "Quito"})]


@pytest.mark.parametrize("text,fmt", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par', "hermes"),  # cut short
    ('<tool_call>{"arguments": {}}</tool_call>', "hermes"),  # no name
    ('<tool_call>{"name": "f", "arguments": "{not json"}</tool_call>', "hermes"),
    ("[TOOL_CALLS]get_weather[ARGS]{oops", "mistral"),
    ('{"name": "get_weather", "parameters": {"city": "Lim', "llama3"),
    ("It is sunny in Paris.", "hermes"),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>', None),  # no tools offered
])
def test_what_does_not_parse_stays_text(text, fmt):
    assert parse(text, fmt, {"get_weather", "f"}) == (text, [])


def test_bare_json_counts_only_when_it_names_an_offered_tool():
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert _calls(parse(text, "hermes", {"get_weather"})[1]) == [("get_weather",
                                                                  {"city": "Paris"})]
    assert parse(text, "hermes", {"other"}) == (text, [])
    assert parse(text, "hermes") == (text, [])


def _assembled(deltas: list[dict]) -> list[tuple[str, object]]:
    """Calls put together from their streamed deltas, as a client does."""
    calls: dict[int, list] = {}
    for d in deltas:
        assert set(d) <= {"index", "id", "type", "function"}
        if d["index"] not in calls:  # a call's first delta: id, type and name
            assert d["id"].startswith("call_") and d["type"] == "function"
            assert d["index"] == len(calls)
            calls[d["index"]] = [d["function"]["name"], ""]
        else:
            assert set(d["function"]) == {"arguments"}
        calls[d["index"]][1] += d["function"].get("arguments", "")
    return [(name, json.loads(args)) for name, args in calls.values()]


TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": [1, '
       '{"n": 2}]}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
       '{"city": "Oslo"}}\n</tool_call>')


@pytest.mark.parametrize("fmt,text,streams", [
    ("hermes", 'Checking now. <tool_call>{"name": "get_weather", "arguments": '
               '{"city": "Paris"}}</tool_call>', True),
    ("hermes", TWO, True),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     True),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', True),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', True),
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Paris"}}', True),  # bare
    # keys in the other order: held, and sent whole at the end
    ("hermes", '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>',
     False),
    ("hermes", "No call here, only <tool text that looks like one.", False),
])
def test_a_stream_sends_the_text_and_the_calls_as_written(fmt, text, streams):
    content, expected = parse(text, fmt, {"get_weather"})
    for size in (1, 3, 7, len(text)):  # the marker and the head split in every way
        stream = CallStream(fmt, {"get_weather"})
        sent, deltas, early = "", [], 0
        for i in range(0, len(text), size):
            more, calls = stream.add(text[i:i + size])
            sent, deltas, early = sent + more, deltas + calls, early + len(calls)
        rest, calls = stream.finish()
        assert _assembled(deltas + calls) == _calls(expected), size
        assert (sent + rest).strip() == (content or "").strip()
        assert "tool_call" not in sent and "TOOL_CALLS" not in sent or not expected
        if size == 1:  # each call's arguments went out piece by piece, before the end
            assert (early > 2 * len(expected)) == streams and not (streams and calls)


def test_a_streamed_call_cut_short_sends_what_was_written():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    stream = CallStream("hermes", {"get_weather"})
    _, deltas = stream.add(text)
    assert deltas[0]["function"]["name"] == "get_weather" and stream.called
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Par'
    assert stream.finish() == ("", [])  # not a call, but its head is out
    assert parse(text, "hermes", {"get_weather"}) == (text, [])  # unstreamed: text


def _request(body: dict) -> dict:
    return openai_batch.parse({"custom_id": "x", "url": "/v1/chat/completions",
                               "body": {"model": "m", **body}}, "line", {"gen_len": 4})


def test_tools_and_tool_messages_are_checked_field_by_field():
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "content": "18 C", "tool_call_id": "c1"}]
    ok = _request({"messages": chat, "tools": [WEATHER]})
    assert ok["refused"] is None and ok["tools"] == [WEATHER]
    # arguments as an object, as templates write them with tojson
    assert ok["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert ok["messages"][1]["content"] == "" and ok["messages"][2]["tool_call_id"] == "c1"
    assert _request({"messages": chat[:1], "tools": [WEATHER],
                     "tool_choice": "none"})["tools"] is None
    for body, param in [({"tools": [{"type": "function"}]}, "tools[0]"),
                        ({"tools": {"get_weather": 1}}, "tools"),
                        ({"tool_choice": "sometimes"}, "tool_choice")]:
        refused = _request({"messages": chat[:1], **body})
        assert refused["refused"] and refused["param"] == param, body
    # a call the answer must make: kept for the grammar (compiled once the model is loaded)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        forced = _request({"messages": chat[:1], "tools": [WEATHER], "tool_choice": choice})
        assert forced["refused"] is None and forced["forced_call"] == choice
        assert forced["tools"] == [WEATHER]
    bad = [*chat[:1], {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]
    assert _request({"messages": bad})["param"] == "messages[1].tool_calls[0].function.arguments"


def test_the_format_is_the_templates():
    assert format_of("{% for tool in tools %}<tool_call>{% endfor %}") == "hermes"
    assert format_of("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert format_of("<|python_tag|>{{ x }}") == "llama3"
    assert format_of("{{ messages }}") is None and format_of(None) is None


@pytest.fixture(scope="module")
def qwen_server():
    path = os.environ.get("FLEXGEN_INFINIGEN_QWEN_GGUF")
    if not path or not Path(path).is_file():
        pytest.skip("set FLEXGEN_INFINIGEN_QWEN_GGUF to the Qwen2.5-Coder-0.5B-Instruct GGUF "
                    "(../shared/models/qwen2.5-coder-0.5b.sh assembles it)")
    from test_serve import _start, _stop

    proc, url = _start(path, source="--model")
    yield url
    _stop(proc)


def test_a_server_answers_with_a_call_and_takes_its_result(qwen_server):
    pytest.importorskip("openai")
    import openai

    client = openai.OpenAI(base_url=f"{qwen_server}/v1", api_key="x", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    out = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER],
                                         max_tokens=40, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(client.chat.completions.create(model=model, messages=ask, tools=[WEATHER],
                                                 max_tokens=40, temperature=0, stream=True))
    deltas = [d.model_dump(exclude_none=True) for c in chunks if c.choices
              for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) > 2  # the arguments came piece by piece
    assert _assembled(deltas) == [("get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    follow = ask + [choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    again = client.chat.completions.create(model=model, messages=follow, tools=[WEATHER],
                                           max_tokens=20, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_required_call_holds_the_tools_schema(qwen_server):
    """tool_choice "required" and a named function: the answer is a call of that tool whose
    arguments hold its parameters' schema, even to a question that calls for none."""
    pytest.importorskip("openai")
    import openai

    client = openai.OpenAI(base_url=f"{qwen_server}/v1", api_key="x", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    clock = {"type": "function", "function": {
        "name": "get_time", "description": "The time in a timezone",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                       "properties": {"zone": {"type": "string", "maxLength": 20}}}}}
    ask = [{"role": "user", "content": "Say hello."}]
    for choice, name in (("required", None), ({"type": "function",
                                               "function": {"name": "get_time"}}, "get_time")):
        out = client.chat.completions.create(model=model, messages=ask, max_tokens=60,
                                             temperature=0, tools=[WEATHER, clock],
                                             tool_choice=choice)
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        args = json.loads(calls[0].function.arguments)
        if calls[0].function.name == "get_time":
            assert set(args) == {"zone"} and len(args["zone"]) <= 20
        else:
            assert name is None and "city" in args
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model=model, messages=ask, max_tokens=5,
                                       tools=[WEATHER], tool_choice={
                                           "type": "function", "function": {"name": "nope"}})
