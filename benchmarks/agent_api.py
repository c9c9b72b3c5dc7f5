"""agent_api.py: the agent API against a running server, with the official ``openai`` client.

- **JSON schema:** 20 chat requests with a ``json_schema`` ``response_format`` on the default
  model; each answer is checked with ``jsonschema`` (valid, and ended by the grammar).
- **Constrained decoding's cost:** 8 requests at once (one block of 8 rows), free against
  held to a schema whose one string field is long enough never to close, both running to
  ``max_tokens``; total tokens/s of each, alternated over ``--rounds`` (a run's value: their
  median).
- **Tool calls** (with ``--qwen GGUF``, the real Qwen2.5-Coder-0.5B-Instruct): 20 forced
  calls (``tool_choice`` a named function) whose arguments are checked against the tool's
  schema, unstreamed and streamed (the streamed call's argument deltas joined as a client
  joins them), and 20 two-step conversations with ``tool_choice: "auto"`` (a call, its
  result, a final answer); and the 20 ``json_schema`` requests on this model too.

    python benchmarks/agent_api.py --qwen path/to/qwen2.5-coder-0.5b-instruct.gguf

Appends a run to ``results/agent_api.json`` and rewrites ``.md`` and ``.png``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import artifacts  # noqa: E402
from machine import machine_info  # noqa: E402
from serve_load import start_server, stop_server  # noqa: E402

OUT = HERE / "results" / "agent_api"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24}}}
LONG = {"type": "object", "additionalProperties": False, "required": ["story"],
        "properties": {"story": {"type": "string", "minLength": 2000}}}
TOPICS = ["a baker", "a pilot", "a chess player", "a nurse", "a painter", "a farmer",
          "a teacher", "a sailor", "a chemist", "a poet", "a miner", "a judge", "a singer",
          "a tailor", "a cook", "a mechanic", "a librarian", "a runner", "a potter", "a monk"]
CITIES = ["Paris", "Oslo", "Lima", "Kyoto", "Cairo", "Quito", "Lagos", "Perth", "Delhi",
          "Tunis", "Hanoi", "Dakar", "Sofia", "Accra", "Minsk", "Tokyo", "Rome", "Riga",
          "Bern", "Doha"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string"},
                                  "unit": {"type": "string", "enum": ["C", "F"]}}}}}


def client_of(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)


def json_schema_part(client, model: str, n: int) -> dict:
    """Answers held to PERSON: how many validate and how many the grammar ended."""
    import jsonschema

    valid = ended = 0
    for topic in TOPICS[:n]:
        out = client.chat.completions.create(
            model=model, max_tokens=80, temperature=0,
            messages=[{"role": "user", "content": f"Invent {topic}: name, age and city."}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON, "strict": True}})
        ended += out.choices[0].finish_reason == "stop"
        try:
            jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"valid": valid, "ended": ended, "total": n}


def concurrent(client, model: str, n: int, max_tokens: int, schema: dict | None) -> float:
    """Total tokens/s of ``n`` chat requests sent at once (one block)."""
    done: list[int] = []
    go = threading.Barrier(n + 1)

    def ask(i):
        extra = {"response_format": {"type": "json_schema", "json_schema": {
            "name": "story", "schema": schema}}} if schema else {}
        go.wait()
        out = client.chat.completions.create(
            model=model, max_tokens=max_tokens, temperature=0,
            messages=[{"role": "user", "content": f"Tell a story about {TOPICS[i]}."}],
            extra_body={"ignore_eos": True}, **extra)
        done.append(out.usage.completion_tokens)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    go.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    assert len(done) == n and all(t == max_tokens for t in done), done
    return sum(done) / seconds


def tool_part(client, model: str, n: int) -> dict:
    """Forced calls checked against the tool's schema; two-step conversations completed."""
    import jsonschema

    forced = streamed = convos = 0
    named = {"type": "function", "function": {"name": "get_weather"}}
    for city in CITIES[:n]:
        ask = [{"role": "user", "content": f"What is the weather like in {city}?"}]
        out = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER],
                                             tool_choice=named, max_tokens=60, temperature=0)
        calls = out.choices[0].message.tool_calls or []
        try:
            jsonschema.validate(json.loads(calls[0].function.arguments),
                                WEATHER["function"]["parameters"])
            forced += calls[0].function.name == "get_weather"
        except (IndexError, ValueError, jsonschema.ValidationError):
            pass
        chunks = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER],
                                                tool_choice=named, max_tokens=60,
                                                temperature=0, stream=True)
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        try:
            jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)),
                                WEATHER["function"]["parameters"])
            streamed += deltas[0].function.name == "get_weather"
        except (IndexError, ValueError, jsonschema.ValidationError):
            pass
        first = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER],
                                               max_tokens=60, temperature=0)
        call = (first.choices[0].message.tool_calls or [None])[0]
        if call is None:
            continue
        follow = ask + [first.choices[0].message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"city": city, "temperature_c": 18})}]
        last = client.chat.completions.create(model=model, messages=follow, tools=[WEATHER],
                                              tool_choice="none", max_tokens=40,
                                              temperature=0)
        convos += bool(last.choices[0].message.content)
    return {"forced_valid": forced, "streamed_valid": streamed, "conversations": convos,
            "total": n}


def rows_of(run: dict) -> list[dict]:
    rows = []
    js = run["json_schema"]
    rows.append({"model": "SmolLM2-135M", "check": "json_schema answers valid",
                 "count": js["valid"], "of": js["total"]})
    rows.append({"model": "SmolLM2-135M", "check": "json_schema answers ended by the grammar",
                 "count": js["ended"], "of": js["total"]})
    # a run's rounds give one value (their median), so the table's N counts runs
    for case, values in run["speed"].items():
        rows.append({"model": "SmolLM2-135M", "check": f"batch 8, {case}",
                     "tokens_s": statistics.median(values)})
    ratios = [held / free for free, held in zip(run["speed"]["free"],
                                                 run["speed"]["held to a schema"])]
    rows.append({"model": "SmolLM2-135M", "check": "batch 8, held / free",
                 "ratio": statistics.median(ratios)})
    if run.get("tools"):
        t = run["tools"]
        rows.append({"model": "Qwen2.5-Coder-0.5B", "check": "forced calls valid",
                     "count": t["forced_valid"], "of": t["total"]})
        if "streamed_valid" in t:
            rows.append({"model": "Qwen2.5-Coder-0.5B", "check": "forced calls valid, streamed",
                         "count": t["streamed_valid"], "of": t["total"]})
        rows.append({"model": "Qwen2.5-Coder-0.5B", "check": "two-step conversations done",
                     "count": t["conversations"], "of": t["total"]})
    if run.get("qwen_json_schema"):
        js = run["qwen_json_schema"]
        rows.append({"model": "Qwen2.5-Coder-0.5B", "check": "json_schema answers valid",
                     "count": js["valid"], "of": js["total"]})
    return rows


COLUMNS = [("count", "count", "{:.0f}"), ("of", "of", "{:.0f}"), ("tokens/s", "tokens_s"),
           ("ratio", "ratio")]


def markdown(doc: dict) -> str:
    runs = doc["runs"]
    return (f"# Agent API\n\n{artifacts.meta_line(runs)}\n\n"
            + artifacts.table(runs, ["model", "check"], COLUMNS))


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = artifacts.grouped(doc["runs"], ["check"], lambda r: "tokens_s" in r)
    names = [k[0] for k in groups]
    values = [statistics.median(r["tokens_s"] for r in rows) for rows in groups.values()]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(names, values)
    ax.set_xlabel("total decode tokens/s (median of runs)")
    ax.set_title("SmolLM2-135M, one block of 8 rows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--qwen", type=Path, default=None,
                   help="the Qwen2.5-Coder-0.5B-Instruct GGUF: the tool-call part")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--fresh", action="store_true", help="start STEM.json's runs anew")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args()
    out = a.out.with_suffix("") if a.out.suffix == ".json" else a.out
    if not a.report_only:
        run = {"meta": artifacts.run_meta(["benchmarks/agent_api.py", *sys.argv[1:]],
                                          machine_info=machine_info())}
        proc, url = start_server((8, 1), 300)
        try:
            client = client_of(url)
            model = client.models.list().data[0].id
            run["json_schema"] = json_schema_part(client, model, a.requests)
            run["speed"] = {"free": [], "held to a schema": []}
            for _ in range(a.rounds):  # alternated: drift hits both alike
                run["speed"]["free"].append(concurrent(client, model, 8, a.max_tokens, None))
                run["speed"]["held to a schema"].append(
                    concurrent(client, model, 8, a.max_tokens, LONG))
        finally:
            stop_server(proc)
        if a.qwen is not None:
            proc, url = start_server((1, 1), 50, "--model", str(a.qwen))
            try:
                client = client_of(url)
                model = client.models.list().data[0].id
                run["tools"] = tool_part(client, model, a.requests)
                run["qwen_json_schema"] = json_schema_part(client, model, a.requests)
            finally:
                stop_server(proc)
        run["rows"] = rows_of(run)
        artifacts.append_run(out, run, fresh=a.fresh, benchmark=__doc__.split("\n")[0])
    doc = artifacts.load(out)
    out.with_suffix(".md").write_text(markdown(doc))
    plot(doc, out.with_suffix(".png"))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
