"""Command line: offline generation over many prompts, resumable.

    python -m flexgen_infinigen.batch --input prompts.jsonl --output results.jsonl \\
        --percent 100 0 0 100 100 0 --gpu-batch-size 8 --num-gpu-batches 2

Each input line is a JSON object: ``id`` (unique), ``prompt`` (text or token ids) or
``messages`` (a chat, [{"role", "content"}], through the model's chat template), and
optionally ``gen_len``, ``temperature``, ``top_p``, ``repetition_penalty``. A file in the
OpenAI Batch API format (``custom_id``, ``method``, ``url``, ``body``; see
:mod:`.openai_batch`) is read as such and answered in that format. Prompts with the
same settings are sorted by length (less padding) and run in blocks of the policy's size;
each finished block is appended to ``--output`` (one line per id) and synced to disk. A
rerun skips the ids already written: an interrupted job loses at most the block in flight
and never writes an id twice.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .cli import openai_batch
from .cli.args import (
    add_model_args,
    add_policy_args,
    check_policy_args,
    policy_from_args,
    wants_plan,
)
from .config import DEFAULT_MODEL, ConfigError
from .kv import kv_policy_from_args
from .runtime.guards import check_output_path, run_command
from .sampling import SamplingConfig

SETTINGS = {"gen_len": int, "temperature": float, "top_p": float, "repetition_penalty": float}


def read_requests(path: str, defaults: dict) -> list[dict]:
    """The input lines, checked: one error naming the line for anything malformed."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read --input {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--input {path} is not UTF-8 text") from None
    requests, seen, first = [], set(), None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--input {path} line {n}"
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{where} is not JSON ({e.msg})") from None
        openai = openai_batch.is_openai(item)
        if first is None:
            first = (n, openai)
        elif openai != first[1]:
            formats = ("our format", "the OpenAI Batch format")
            raise ConfigError(f"{where} is in {formats[openai]} but line {first[0]} is in "
                              f"{formats[first[1]]}; one file holds one format")
        if openai:
            request = openai_batch.parse(item, where, defaults)
        else:
            request = _ours(item, where, defaults)
        if request["id"] in seen:
            raise ConfigError(f"{where}: id {request['id']!r} appears twice; ids must be "
                              "unique")
        seen.add(request["id"])
        requests.append(request)
    if not requests:
        raise ConfigError(f"--input {path} holds no requests (one JSON object per line)")
    return requests


def _ours(item, where: str, defaults: dict) -> dict:
    """A request in this command's own format (see the module docstring)."""
    if not isinstance(item, dict) or "id" not in item:
        raise ConfigError(f"{where} needs an object with an \"id\"")
    key = str(item["id"])
    if ("prompt" in item) == ("messages" in item):
        raise ConfigError(f"{where}: give exactly one of \"prompt\" and \"messages\"")
    prompt = item.get("prompt")
    if prompt is not None and not (isinstance(prompt, str) and prompt.strip() or
                                   isinstance(prompt, list) and prompt and
                                   all(isinstance(t, int) for t in prompt)):
        raise ConfigError(f"{where}: \"prompt\" must be non-empty text or token ids")
    messages = item.get("messages")
    if messages is not None and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages)):
        raise ConfigError(f"{where}: \"messages\" must be a list of {{role, content}}")
    settings = dict(defaults)
    for name, kind in SETTINGS.items():
        if name in item:
            try:
                settings[name] = kind(item[name])
            except (TypeError, ValueError):
                raise ConfigError(f"{where}: {name} must be a number") from None
    if settings["gen_len"] < 1:
        raise ConfigError(f"{where}: gen_len must be at least 1")
    SamplingConfig(settings["temperature"], settings["top_p"], 0,
                   settings["repetition_penalty"]).validate()
    return {"id": key, "format": "ours", "prompt": prompt, "messages": messages,
            "settings": settings, "refused": None, "stop": []}


def done_ids(path: str) -> set[str]:
    """Ids already in ``--output``. A last line cut short by a kill is removed first."""
    out = Path(path)
    if not out.is_file():
        return set()
    data = out.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with open(out, "r+b") as f:
            f.truncate(len(complete))
    ids = set()
    for line in complete.decode("utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            ids.add(str(row["custom_id"] if "custom_id" in row else row["id"]))
    return ids


def prompt_ids(lm, request: dict, chat: bool | None, template: str | None) -> list[int]:
    """A request's token ids: ``messages``, or a text ``prompt`` when ``chat``, through the
    model's chat ``template``; else the prompt as written."""
    from .text.chat import chat_prompt_ids

    messages = request["messages"]
    if messages is None and isinstance(request["prompt"], str) and chat \
            and template is not None:
        messages = [{"role": "user", "content": request["prompt"]}]
    if messages is not None:
        if template is None or lm.tokenizer is None:
            raise ConfigError(f"request {request['id']!r} has messages but the model has no "
                              "chat template")
        return chat_prompt_ids(lm.tokenizer, template, messages)
    return lm.encode([request["prompt"]])[0]


def planned(a, model: str, todo: list[dict]):
    """``--percent auto``: the optimizer's policy for the longest request (its text tokens
    plus a margin for a chat template) and the longest generation."""
    from .runtime.loading import find_weights
    from .text.tokenizer import load_tokenizer

    cfg, _, store = find_weights(model, a.path, a.dummy, a.seed, progress=True)
    tok = load_tokenizer(store.path, cfg) if store is not None else None
    longest = 1
    for r in todo:
        texts = [m["content"] for m in r["messages"]] if r["messages"] else [r["prompt"]]
        n = sum(len(t) if isinstance(t, list) else len(tok.encode(t)) if tok else len(t)
                for t in texts)
        longest = max(longest, n + 64 * len(texts))
    gen = max(r["settings"]["gen_len"] for r in todo)
    return policy_from_args(a, cfg, (longest, gen))


def _result(lm, request: dict, ids: list[int], text: str) -> dict:
    """One output line, in the request's format."""
    stopped = bool(ids) and ids[-1] in lm.stop_token_ids
    if request["format"] == "ours":
        return {"id": request["id"], "text": text, "token_ids": ids,
                "prompt_tokens": len(request["ids"]),
                "finish_reason": "stop" if stopped else "length"}
    text, cut = openai_batch.cut_at_stop(text, request["stop"])
    return openai_batch.response_line(request, text, len(ids), len(request["ids"]),
                                      "stop" if stopped or cut else "length", lm.cfg.name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flexgen_infinigen.batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_policy_args(p)
    g = p.add_argument_group("batch")
    g.add_argument("--input", required=True,
                   help="JSON lines: id, prompt or messages, ...; or an OpenAI Batch API file "
                        "(custom_id, method, url, body)")
    g.add_argument("--output", required=True, help="JSON lines, appended (resumable)")
    g.add_argument("--gen-len", type=int, default=64, help="default tokens per request")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="text prompts go through the model's chat template when it has one")
    return p


def main(argv=None) -> int:
    return run_command(_main, argv)


def _main(argv=None) -> int:
    from tqdm.auto import tqdm

    from .api import OffloadedLM
    from .text.chat import store_template

    a = build_parser().parse_args(argv)
    check_output_path(a.output, "--output")
    check_policy_args(a)
    defaults = {"gen_len": a.gen_len, "temperature": a.temperature, "top_p": a.top_p,
                "repetition_penalty": a.repetition_penalty}
    requests = read_requests(a.input, defaults)
    skip = done_ids(a.output)
    todo = [r for r in requests if r["id"] not in skip]
    print(f"{len(requests)} requests, {len(requests) - len(todo)} already in {a.output}",
          file=sys.stderr)
    if not todo:
        return 0
    kv = kv_policy_from_args(a)
    model = a.model if (a.model or a.path) else DEFAULT_MODEL
    policy, _ = planned(a, model, todo) if wants_plan(a) else policy_from_args(a)
    lm = OffloadedLM.load(model=model, path=a.path, dummy=a.dummy, policy=policy,
                          device=a.device, dtype=a.dtype, kv_policy=kv,
                          offload_dir=a.offload_dir, seed=a.seed)
    with lm, open(a.output, "a", encoding="utf-8") as out:
        template = store_template(lm.store_path)  # read once, not per request
        for r in [r for r in todo if r["refused"]]:  # answered at once, the job goes on
            out.write(json.dumps(openai_batch.error_line(r, r["refused"])) + "\n")
        out.flush()
        todo = [r for r in todo if not r["refused"]]
        for r in todo:  # an OpenAI completion is plain text, never a chat
            r["ids"] = prompt_ids(lm, r, a.chat and r["format"] == "ours", template)
        groups: dict[tuple, list[dict]] = {}
        for r in todo:
            groups.setdefault(tuple(sorted(r["settings"].items())), []).append(r)
        bar = tqdm(total=len(todo), desc="prompts", unit="prompt")
        tokens, start = 0, time.perf_counter()
        for key, group in groups.items():
            settings = dict(key)
            group.sort(key=lambda r: len(r["ids"]))
            sampling = SamplingConfig(settings["temperature"], settings["top_p"],
                                      settings.get("seed", a.seed),
                                      settings["repetition_penalty"])
            for i in range(0, len(group), policy.block_size):
                block = group[i:i + policy.block_size]
                gen = lm.generate([r["ids"] for r in block], settings["gen_len"], sampling)
                for r, ids, text in zip(block, gen.token_ids, gen.texts):
                    out.write(json.dumps(_result(lm, r, ids, text)) + "\n")
                    tokens += len(ids)
                out.flush()
                os.fsync(out.fileno())
                bar.update(len(block))
                bar.set_postfix(tok_per_s=f"{tokens / (time.perf_counter() - start):.1f}")
        bar.close()
    print(f"wrote {len(todo)} results to {a.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
