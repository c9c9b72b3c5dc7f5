"""Command line: offline generation over many prompts, resumable.

    python -m flexgen_infinigen.batch --input prompts.jsonl --output results.jsonl \\
        --percent 100 0 0 100 100 0 --gpu-batch-size 8 --num-gpu-batches 2

Each input line is a JSON object: ``id`` (unique), ``prompt`` (text or token ids) or
``messages`` (a chat, [{"role", "content"}], through the model's chat template), and
optionally ``gen_len`` (or ``max_tokens``), ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``seed``,
``stop``, ``stop_token_ids`` and ``ignore_eos`` (checked and meant as the server's:
:mod:`.sampling`). A file in the OpenAI Batch API format
(``custom_id``, ``method``, ``url``, ``body``; see :mod:`.cli.openai_batch`) is read as such
and answered in that format. Prompts are sorted by length (less padding) and run in blocks of
the policy's size; a row whose answer has ended takes the next prompt at the next step (its
prompt prefilled alone into the row, each row with its own settings: ``--no-refill`` runs
blocks of prompts with the same settings to their longest answer instead). Each answer is
appended to ``--output`` (one line per id) as it ends, and synced to disk. A rerun skips the
ids already written: an interrupted job loses at most the answers in flight and never
writes an id twice.

A request that cannot run (a refused value, a prompt outside the model's vocabulary or
positions, a row that fails in the engine) gets an error line of its own and the job goes
on; a block that fails runs again one row at a time, so its other rows are answered as they
would have been (see :mod:`.cli.batch_file`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .cli import openai_batch
from .cli import request_checks as checks
from .cli.args import (
    add_model_args,
    add_policy_args,
    check_policy_args,
    check_sampling_args,
    policy_from_args,
    wants_plan,
)
from .cli.batch_file import FAILED, INVALID, done_ids, error_line, read_requests, result_line
from .cli.batch_file import same_file
from .config import DEFAULT_MODEL, ConfigError
from .kv import kv_policy_from_args
from .guards import check_output_path, run_command
from .sampling import SamplingConfig, generation_defaults

__all__ = ["done_ids", "main", "read_requests"]


def prompt_ids(lm, request: dict, chat: bool | None, template: str | None) -> list[int]:
    """A request's token ids: ``messages``, or a text ``prompt`` when ``chat``, through the
    model's chat ``template``; else the prompt as written."""
    messages = request["messages"]
    if messages is None and isinstance(request["prompt"], str) and chat \
            and template is not None:
        messages = [{"role": "user", "content": request["prompt"]}]
    if messages is not None:
        if template is None or lm.tokenizer is None:
            raise ConfigError(f"request {request['id']!r} has messages but the model has no "
                              "chat template")
        rendered = {**request, "messages": messages}
        ids = openai_batch.chat_ids(lm.tokenizer, template, rendered)
        for name in ("tool_format", "harmony", "thought"):  # what the template teaches the
            request[name] = rendered.get(name)  # answer's reading
        return ids
    return lm.encode([request["prompt"]])[0]


def planned(a, model: str, todo: list[dict]):
    """``--percent auto``: the optimizer's policy for the longest request (its text tokens
    plus a margin for a chat template) and the longest generation."""
    from .engine.loading import find_weights
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
    if a.refill:  # what a refilled block's caches hold (serving.offline): free columns
        # before its prompts, and four times its longest answer in steps
        longest, gen = longest + min(longest, 1024), 4 * gen
    return policy_from_args(a, cfg, (longest, gen))


def _cut_at_stop(lm, request: dict, ids: list[int], text: str) -> tuple[list[int], str, bool]:
    """(ids, text, whether a stop string ended it): the text up to the request's first stop
    string, and the tokens up to the one that completed it."""
    text, cut = openai_batch.cut_at_stop(text, request["stop"])
    if not cut:
        return ids, text, False
    lo, hi = 1, len(ids)  # the fewest tokens whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if openai_batch.cut_at_stop(lm.tokenizer.decode(ids[:mid]), request["stop"])[1]:
            hi = mid
        else:
            lo = mid + 1
    return ids[:lo], text, True


def _stop_ids(lm, settings: dict) -> set[int] | None:
    """The ids that end a row of these settings; None: the model's own (the engine stops
    on them itself)."""
    if not settings.get("ignore_eos") and not settings.get("stop_token_ids"):
        return None
    return set(settings.get("stop_token_ids", ())) | \
        (set() if settings.get("ignore_eos") else set(lm.stop_token_ids))


def _result(lm, request: dict, ids: list[int], text: str) -> dict:
    """One output line, in the request's format."""
    stops = _stop_ids(lm, request["settings"])
    if stops is None:
        stopped = bool(ids) and ids[-1] in lm.stop_token_ids
    else:  # the rows ran on past their stop ids: cut at the first (kept in the ids, as the
        # model's end token is; not in the text)
        at = next((i for i, t in enumerate(ids) if t in stops), None)
        stopped = at is not None
        if stopped:
            ids = ids[:at + 1]
            text = lm.tokenizer.decode(ids[:at]) if lm.tokenizer else ""
    ids, text, cut = _cut_at_stop(lm, request, ids, text)
    return result_line(request, ids, text, len(request["ids"]),
                       "stop" if stopped or cut else "length", lm.cfg.name)


def _prepare(lm, request: dict, chat: bool, template: str | None) -> str | None:
    """Set the request's token ids; a message when this request cannot run on this model."""
    try:
        ids = prompt_ids(lm, request, chat, template)
    except checks.Refused as e:
        request["param"] = e.param
        return str(e)
    except ConfigError as e:
        return str(e)
    except Exception as e:  # a tokenizer or template fault is this prompt's own
        return f"the prompt cannot be encoded ({_first_line(e)})"
    gen_len = request["settings"]["gen_len"]
    if not ids:
        return "the prompt is empty; give at least one token"
    try:  # ids the embedding can look up (a text's are; given ones may not be)
        checks.token_ids(ids, lm.cfg.vocab_size)
        settings = request["settings"]
        checks.token_ids([t for t, _ in settings.get("logit_bias", ())], lm.cfg.vocab_size,
                         "logit_bias")
        checks.token_ids(list(settings.get("stop_token_ids", ())), lm.cfg.vocab_size,
                         "stop_token_ids")
    except checks.Refused as e:
        request["param"] = e.param
        return str(e)
    if len(ids) + gen_len > lm.cfg.max_positions:
        request["param"] = "max_tokens" if request["format"] == "openai" else "gen_len"
        return (f"the prompt ({len(ids)} tokens) plus {gen_len} generated is over "
                f"{lm.cfg.name}'s {lm.cfg.max_positions} positions; shorten one of them")
    request["ids"] = ids
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip(": ")


def _answer(lm, block: list[dict], gen_len: int, sampling: SamplingConfig,
            stop_token_id: int | None = -1) -> list[dict]:
    """The output lines of one block. A block that fails runs again one row at a time, so
    only the row that fails gets an error line (a greedy row gets the tokens it would have
    had; a sampled one draws from a generator of its own then); a disk's fault stops the
    job."""
    try:
        gen = lm.generate([r["ids"] for r in block], gen_len, sampling,
                          stop_token_id=stop_token_id)
    except OSError:
        raise
    except Exception as e:
        failure = e
    else:
        return [_result(lm, r, ids, text) for r, ids, text in
                zip(block, gen.token_ids, gen.texts)]
    if len(block) > 1:
        return [line for r in block
                for line in _answer(lm, [r], gen_len, sampling, stop_token_id)]
    message = _first_line(failure)
    print(f"warning: request {block[0]['id']!r} failed ({message}); its output line holds "
          "the error", file=sys.stderr)
    return [error_line(block[0], message,
                       INVALID if isinstance(failure, ConfigError) else FAILED)]


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
    g.add_argument("--refill", action=argparse.BooleanOptionalAction, default=True,
                   help="a row whose answer has ended takes the next prompt at the next step "
                        "(its prefill alone, then it decodes beside the others); "
                        "--no-refill runs blocks of prompts with the same settings, each "
                        "until its longest answer ends")
    return p


def main(argv=None) -> int:
    return run_command(_main, argv)


def _write(out, lines: list[dict]) -> None:
    """Append whole lines and put them on the disk: a kill loses no line written."""
    for line in lines:
        out.write(json.dumps(line) + "\n")
    out.flush()
    os.fsync(out.fileno())


def _generated(line: dict) -> int:
    """Tokens an output line reports generating (0 for an error)."""
    if line.get("token_ids") is not None:
        return len(line["token_ids"])
    response = line.get("response") or {}
    return response.get("body", {}).get("usage", {}).get("completion_tokens", 0)


def _main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    check_output_path(a.output, "--output")
    if same_file(a.input, a.output):
        raise ConfigError(f"--output {a.output} is the --input file; the results go to "
                          "another file: give a new name")
    check_policy_args(a)
    check_sampling_args(a)
    if a.gen_len < 1:
        raise ConfigError(f"--gen-len must be at least 1 (got {a.gen_len})")
    defaults = {"gen_len": a.gen_len, "temperature": a.temperature, "top_p": a.top_p,
                "repetition_penalty": a.repetition_penalty}
    requests = read_requests(a.input, defaults)
    skip = done_ids(a.output)
    todo = [r for r in requests if r["id"] not in skip]
    print(f"{len(requests)} requests, {len(requests) - len(todo)} already in {a.output}",
          file=sys.stderr)
    if not todo:
        return 0
    with open(a.output, "a", encoding="utf-8") as out:
        # refused at once, before any loading: the job goes on with the rest
        refused = [error_line(r, r["refused"]) for r in todo if r["refused"]]
        _write(out, refused)
        todo = [r for r in todo if not r["refused"]]
        failed = _run(a, todo, out) if todo else 0
    errors = len(refused) + failed
    print(f"wrote {len(todo) + len(refused)} lines to {a.output}"
          + (f" ({errors} of them errors: see their \"error\")" if errors else ""),
          file=sys.stderr)
    return 0


def _run(a, todo: list[dict], out) -> int:
    """Answer ``todo`` into ``out``; returns how many got an error line."""
    from tqdm.auto import tqdm

    from .api import OffloadedLM

    kv = kv_policy_from_args(a)
    model = a.model if (a.model or a.path) else DEFAULT_MODEL
    policy, _ = planned(a, model, todo) if wants_plan(a) else policy_from_args(a)
    lm = OffloadedLM.load(model=model, path=a.path, dummy=a.dummy, policy=policy,
                          device=a.device, dtype=a.dtype, kv_policy=kv,
                          offload_dir=a.offload_dir, seed=a.seed)
    failed = 0
    with lm:
        template = _template(lm, a)  # read once, not per request
        model_defaults = generation_defaults(lm.store_path)
        if a.repetition_penalty != 1.0:  # the flag, when set, is the job's own default
            model_defaults.pop("repetition_penalty", None)
        ignored = sorted({name for r in todo for name in r.get("ignored", ())})
        if ignored:  # once per job, not per line
            print(f"note: fields that do not change an answer are ignored: "
                  f"{', '.join(ignored)}", file=sys.stderr)
        for r in todo:  # OpenAI lines: a field left out takes the model's default
            if r["format"] == "openai":
                openai_batch.apply_model_defaults(r, model_defaults)
        ready, refused = [], []
        from .serving.offline import LineGrammars
        grammars = LineGrammars(lm, a.refill and lm.tokenizer is not None)
        for r in todo:  # an OpenAI completion is plain text, never a chat
            why = _prepare(lm, r, a.chat and r["format"] == "ours", template) or \
                grammars.compile(r) or _rows_needed(r, grammars.refilled)
            (ready.append(r) if why is None else refused.append(error_line(r, why)))
        _write(out, refused)
        failed += len(refused)
        bar = tqdm(total=len(ready), desc="prompts", unit="prompt")
        tokens, start = 0, time.perf_counter()

        def written(lines: list[dict], prompts: int) -> None:
            nonlocal failed, tokens
            _write(out, lines)
            failed += sum(line["error"] is not None for line in lines)
            tokens += sum(map(_generated, lines))
            bar.update(prompts)
            bar.set_postfix(tok_per_s=f"{tokens / (time.perf_counter() - start):.1f}")

        if a.refill and lm.tokenizer is not None:  # (a row's end is found in its text)
            _refilled(lm, a, ready, written, grammars)
        else:
            _blocks(lm, a, ready, policy.block_size, written)
        bar.close()
    return failed


def _sampling(a, settings: dict, seed: int | None = None) -> SamplingConfig:
    """A line's sampling: its own seed, else ``seed`` (default the job's)."""
    return SamplingConfig(
        settings["temperature"], settings["top_p"],
        settings.get("seed", a.seed if seed is None else seed),
        settings["repetition_penalty"], settings.get("top_k", -1), settings.get("min_p", 0.0),
        settings.get("presence_penalty", 0.0), settings.get("frequency_penalty", 0.0),
        settings.get("logit_bias", ()))


def _blocks(lm, a, ready: list[dict], block_size: int, written) -> None:
    """Blocks of prompts with the same settings, shortest first, each run to its longest
    answer (or until every row has ended)."""
    groups: dict[tuple, list[dict]] = {}
    for r in ready:
        groups.setdefault(tuple(sorted(r["settings"].items())), []).append(r)
    for key, group in groups.items():
        settings = dict(key)
        group.sort(key=lambda r: len(r["ids"]))
        # own stop ids: the rows run on, and each is cut at its first stop id
        stop_token_id = -1 if _stop_ids(lm, settings) is None else None
        for i in range(0, len(group), block_size):
            block = group[i:i + block_size]
            written(_answer(lm, block, settings["gen_len"], _sampling(a, settings),
                            stop_token_id), len(block))


def _refilled(lm, a, ready: list[dict], written, grammars) -> None:
    """Every prompt a row of the server's scheduler, each with its own settings; a row whose
    answer ends takes the next prompt (:mod:`.serving.offline`). A request that failed (its
    block with it) runs again alone, as ``_blocks`` would run it; one held to a grammar gets
    its error line instead (a block of its own has no grammar)."""
    from .serving.offline import answer_all
    from .serving.requests import combined

    jobs = [job for i, r in enumerate(ready) for job in _jobs(lm, a, r, i, grammars)]
    decode = lm.tokenizer.decode if lm.tokenizer else (lambda _: "")
    failed, choices, gone = [], {}, set()
    for job, event in answer_all(lm, jobs):
        line = job.line
        if _choices(line):  # a body of choices: written once they have all ended
            if id(line) in gone:
                continue
            if event[0] != "done":
                gone.add(id(line))
                written([error_line(line, _first_line(event[1]))], 1)
                continue
            ended = choices.setdefault(id(line), [])
            ended.append(job)
            if len(ended) == line["n"]:
                ended.sort(key=lambda j: j.index)
                written([openai_batch.body_line(line, combined(
                    ended, [j.answer() for j in ended]))], 1)
        elif event[0] == "done":
            written([_result(lm, line, job.token_ids, decode(job.token_ids))], 1)
        elif job.constraint is not None:
            written([error_line(line, _first_line(event[1]))], 1)
        else:
            failed.append(job)
    for job in failed:  # once the scheduler has stopped: the engine runs one block at a time
        settings = job.line["settings"]
        written(_answer(lm, [job.line], settings["gen_len"], job.sampling,
                        -1 if _stop_ids(lm, settings) is None else None), 1)


def _choices(request: dict) -> bool:
    """Whether a line's answer is the server's body of choices: ``n`` > 1, log-probabilities
    or an echo (a plain line's is the engine's tokens, cut at its stops)."""
    return request["format"] == "openai" and (
        request["n"] > 1 or request["top_logprobs"] is not None or request["echo"])


def _rows_needed(request: dict, refilled: bool) -> str | None:
    """The reason a line cannot run when its fields need the refilled rows and the job has
    none."""
    if refilled or not _choices(request):
        return None
    request["param"] = "n" if request["n"] > 1 else \
        "logprobs" if request["top_logprobs"] is not None else "echo"
    return (f"{request['param']} is answered in refilled rows: drop --no-refill (and give a "
            "model with a tokenizer)")


def _jobs(lm, a, request: dict, place: int, grammars) -> list:
    """A line's rows: one per choice. A line without its own seed draws from the job's seed
    plus its place in the file (each row has a generator of its own, so equal prompts still
    draw differently); choice ``j`` draws from that seed plus ``j``, as the server's do."""
    from .serving.offline import JobRequest

    settings, rich = request["settings"], _choices(request)
    seed = settings.get("seed", a.seed + place)
    harmony = rich and bool(request.get("harmony"))
    out = []
    for j in range(request["n"] if rich else 1):
        job = JobRequest(request["kind"] if rich else "completion", request["ids"],
                         settings["gen_len"], _sampling(a, {**settings, "seed": seed + j}),
                         list(request.get("stop") or []),
                         request["top_logprobs"] if rich else None, False, False,
                         lm.cfg.name, ignore_eos=bool(settings.get("ignore_eos")),
                         stop_token_ids=tuple(settings.get("stop_token_ids", ())),
                         tool_format=request.get("tool_format"), tools=request.get("tools"),
                         harmony=harmony,
                         reasoning="harmony" if harmony else request.get("thought"),
                         constraint=grammars.constraint(request), line=request)
        job.index, job.first_of_prompt = j, j == 0
        if rich and request["echo"]:  # the prompt's text, and each token's, before the answer
            job.echo = [lm.tokenizer.decode([t]) for t in request["ids"]]
            job.echo_text = lm.tokenizer.decode(request["ids"])
        out.append(job)
    return out


def _template(lm, a) -> str | None:
    """The chat template: ``--chat-template FILE`` when given, else the store's."""
    from .text.chat import chat_template

    return chat_template(lm.store_path, a.chat_template)


if __name__ == "__main__":
    sys.exit(main())
