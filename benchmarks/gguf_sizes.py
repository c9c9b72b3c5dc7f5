"""Dense Q4_K_M models at the sizes people run (7B to 14B), our runtime against llama.cpp on
the same file, in the same run, beside the bound a decode step's reads set.

    python benchmarks/gguf_sizes.py --out-dir /data/gguf \\
        --llama-bench path/to/llama-bench --llama-batched-bench path/to/llama-batched-bench
    python benchmarks/gguf_sizes.py --out-dir /tmp/g --models qwen2.5-7b --layers 2 --runs 1 \\
        --quick --llama-bench ... --llama-batched-bench ...     # the plumbing, in minutes

Files: ``random_kquant_gguf.py`` writes each model's GGUF under ``--out-dir`` once (real
shapes, random codes in llama.cpp's Q4_K_M mix; ``--layers N``: the first N layers, all else
the same); a file already there is used as it is.

Before any timing a warm-up process loads each file at batch 1 and at the batch and decodes
two tokens (a first use makes the runtime's store and compiles its kernels: no measured
start counts them; the file is then in the page cache for both programs). Each run
(``--runs``, default 3), for each model, measures in turn:

- ours, batch 1, in a fresh process: the time to the first token of a ``--prefill``-token
  (512) prompt from the process's start (interpreter, imports, load, prefill: what a user
  waits for); then, warm, that prompt's prefill tokens/s; decode tokens/s after a 1-token
  prompt (depth 0) and after a ``--depth``-token one (4096; its prefill is kept on disk and
  read back by later runs); the process's peak RSS and the weights' placed bytes;
- ours, batch 8, in another process: 8 prompts of ``--batch-prompt`` (128) tokens, total
  decode tokens/s;
- llama.cpp: ``llama-bench`` decode at depths 0 and ``--depth``, prefill of ``--prefill``
  tokens; ``llama-batched-bench`` with 8 parallel sequences of the same lengths as ours;
  each with flash attention off and on, the better kept (``gguf_sizes_llama.py``);
- the bound: the bytes a decode step must read (every tensor of the file but
  ``token_embd``, which is only looked up, plus the f16 K and V rows at the depth, llama.cpp's
  cache) over the read bandwidth measured just before the run (``long_context.read_bandwidth``,
  one large ``sum`` on all threads), as tokens/s.

A decode rate is the median step after the first two (as ``long_context.py`` and
``moe_decode.py`` time it): ``--gen`` (32) tokens a row. Repeats are separate runs of both
programs in turn, so that a ratio to llama.cpp is taken within a run.

Writes ``benchmarks/results/gguf_sizes.{json,md,png}`` (``--out``; a run appends to the
JSON's ``runs``, ``--fresh`` starts anew); ``--docs`` also rewrites this benchmark's section
of docs/results.md; ``--report-only`` rebuilds the md, png (and with ``--docs`` the section)
from the JSON without measuring.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this checkout, not an install
import artifacts  # noqa: E402
import random_gpt_oss_gguf as moe_files  # noqa: E402
import random_kquant_gguf as files  # noqa: E402

OUT = artifacts.RESULTS / "gguf_sizes"
# every model's shape: the dense Q4_K_M ones and gpt-oss with MXFP4 experts
SHAPES = {**files.SHAPES, **moe_files.SHAPES}


def files_of(key: str):
    """The module that writes and describes ``key``'s file (random_kquant_gguf for the dense
    models, random_gpt_oss_gguf for gpt-oss): ``file_name``, ``file_bytes``, ``write_gguf``,
    ``describe``, ``decode_read_bytes`` and ``kv_read_bytes``."""
    return moe_files if key in moe_files.SHAPES else files
DEFAULT_MODELS = ["qwen2.5-7b", "llama-3.1-8b", "qwen2.5-14b"]
# (depth, gen, prefill, batch prompt): the full run's lengths and --quick's
LENGTHS = {"full": (4096, 32, 512, 128), "quick": (512, 8, 64, 16)}


# --- the bound -----------------------------------------------------------------------------

def bound_row(key: str, layers: int, s: dict, bandwidth: float) -> dict:
    """Tokens/s if a step took only its must-read bytes at ``bandwidth``: the weights a step
    at that batch reads (a MoE model's: the experts its tokens route to) and the KV rows."""
    f = files_of(key)
    mid = s["gen"] / 2  # the generated tokens' mean depth

    def rate(batch, context):
        return batch * bandwidth / (f.decode_read_bytes(key, layers, batch)
                                    + batch * f.kv_read_bytes(key, layers, context))
    return {"decode_0_tokens_s": rate(1, mid), "decode_depth_tokens_s": rate(1, s["depth"] + mid),
            **({"batch_tokens_s": rate(s["batch"], s["batch_prompt"] + mid)} if s["batch"]
               else {}),
            "must_read_weight_bytes": f.decode_read_bytes(key, layers, 1),
            "bandwidth_gb_s": bandwidth / 1e9}


# --- one run -------------------------------------------------------------------------------

def one_run(a, key: str, gguf: Path, settings: dict, run: int, prefill_dir: str) -> list[dict]:
    """Our rows, llama.cpp's and the bound's of one run of one model."""
    import gguf_sizes_llama as llama
    from gguf_sizes_ours import in_subprocess
    from long_context import read_bandwidth

    full = SHAPES[key].layers
    layers = a.layers or full
    label = SHAPES[key].name + ("" if layers == full else f", {layers} of {full} layers")
    base = {"model": label, "model_key": key, "layers": layers, "run": run, **settings}
    bandwidth = read_bandwidth()
    spec = {"gguf": str(gguf), "prefill_dir": prefill_dir, **settings}
    rows = []
    for kv in a.kv_policies:
        ours = {**base, "program": program_of(kv)}
        for b in (1, settings["batch"]) if settings["batch"] else (1,):
            got = in_subprocess({**spec, "batch": b, "kv_policy": kv}, a.timeout)
            print(f"{label}, {ours['program']}, batch {b}: {_summary(got)}", flush=True)
            if "error" in got:
                ours[f"error_batch_{b}"] = got["error"]
            elif b == 1:
                ours.update(got)
            else:  # the batch's own process: its start and memory under their own names
                ours.update({k if k.startswith("batch_") else f"batch_{k}": v
                             for k, v in got.items()})
        rows.append(ours)
    if a.llama_bench or a.llama_batched_bench:
        theirs = {**base, "program": "llama.cpp"}
        extra = tuple(a.llama_args.split())
        if a.llama_bench:
            got = llama.decode_and_prefill(a.llama_bench, str(gguf), settings["threads"], 1,
                                           [0, settings["depth"]], settings["gen"],
                                           settings["prefill"], a.timeout, extra)
            _take(theirs, "decode_0", got["decode"][0])
            _take(theirs, "decode_depth", got["decode"][settings["depth"]])
            _take(theirs, "prefill", got["prefill"])
        if a.llama_batched_bench and settings["batch"]:
            _take(theirs, "batch", llama.batched(
                a.llama_batched_bench, str(gguf), settings["threads"], 1,
                settings["batch_prompt"], settings["gen"], settings["batch"], a.timeout))
        print(f"{label}, llama.cpp: {_summary(theirs)}", flush=True)
        for ours in rows:
            for f in ("decode_0", "decode_depth", "prefill", "batch"):
                if f"{f}_tokens_s" in ours and f"{f}_tokens_s" in theirs:
                    ours[f"x_llama_{f}"] = ours[f"{f}_tokens_s"] / theirs[f"{f}_tokens_s"]
        rows.append(theirs)
    rows.append({**base, "program": "bound", **bound_row(key, layers, settings, bandwidth)})
    for r in rows:
        r["bandwidth_gb_s"] = bandwidth / 1e9
        for f in ("peak_rss_bytes", "weights_placed_bytes", "batch_peak_rss_bytes"):
            if f in r:
                r[f.replace("_bytes", "_gb")] = r[f] / 1e9
    return rows


def _take(row: dict, field: str, result: dict) -> None:
    """A llama.cpp result (one sample a run) into ``row`` as ``FIELD_tokens_s``."""
    if "error" in result:
        row[f"error_{field}"] = result["error"]
        return
    row[f"{field}_tokens_s"] = statistics.median(result["samples"])
    row[f"{field}_fa"] = result["fa"]
    row[f"{field}_command"] = result["command"]
    if result.get("other_fa_median"):
        row[f"{field}_other_fa_tokens_s"] = result["other_fa_median"][0]


def _summary(r: dict) -> str:
    shown = {k: round(v, 3) for k, v in r.items()
             if isinstance(v, float) and (k.endswith("tokens_s") or k.endswith("_s"))}
    errors = {k: v for k, v in r.items() if k.startswith("error")}
    return json.dumps({**shown, **errors})


# --- the command ---------------------------------------------------------------------------

def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(SHAPES))
    p.add_argument("--out-dir", default=None,
                   help="the folder of the GGUF files (written there once, 5-20 GB each)")
    p.add_argument("--layers", type=int, default=None,
                   help="a cut: the files' first N layers (everything else the whole model's)")
    p.add_argument("--runs", type=int, default=3, help="runs of both programs, in turn")
    p.add_argument("--quick", action="store_true",
                   help="short lengths (depth 512, prefill 64, batch prompts 16, 8 tokens)")
    p.add_argument("--depth", type=int, default=None, help="the deep decode's depth (4096)")
    p.add_argument("--gen", type=int, default=None, help="tokens decoded a row (32)")
    p.add_argument("--prefill", type=int, default=None, help="the prefill's prompt (512)")
    p.add_argument("--batch", type=int, default=8,
                   help="the batch row's sequences (0: no batch row)")
    p.add_argument("--kv-policies", nargs="+", default=["full"], metavar="POLICY",
                   help="our KV cache policies, a row each (e.g. full infinigen: InfiniGen "
                        "beside the full cache at --depth; one kept prefill serves both)")
    p.add_argument("--batch-prompt", type=int, default=None,
                   help="the batch row's prompt tokens a sequence (128)")
    p.add_argument("--threads", type=int, default=None,
                   help="threads for both programs (default: torch's, one a core)")
    p.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary")
    p.add_argument("--llama-batched-bench", default=None,
                   help="llama.cpp's llama-batched-bench binary (the batch row)")
    p.add_argument("--llama-args", default="", help="more llama-bench arguments, e.g. "
                   "'--repack 0'")
    p.add_argument("--prefill-dir", default=None,
                   help="keep our deep prefills there (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a process")
    p.add_argument("--out", default=str(OUT), help="the artifact set's stem")
    p.add_argument("--fresh", action="store_true", help="start the JSON's runs anew")
    p.add_argument("--docs", nargs="?", const=str(ROOT / "docs" / "results.md"), default=None,
                   metavar="RESULTS_MD", help="also rewrite this benchmark's section of "
                   "docs/results.md (or the file given)")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the md and png (and --docs) from the JSON; measure nothing")
    return p, p.parse_args(argv)


def settings_of(a) -> dict:
    import torch
    depth, gen, prefill, batch_prompt = LENGTHS["quick" if a.quick else "full"]
    return {"depth": a.depth or depth, "gen": a.gen or gen, "prefill": a.prefill or prefill,
            "batch": a.batch, "batch_prompt": a.batch_prompt or batch_prompt,
            "threads": a.threads or torch.get_num_threads()}


def program_of(kv_policy: str) -> str:
    """Our row's name: the full cache's plainly, another policy's beside it."""
    return "flexgen_infinigen" if kv_policy == "full" else f"flexgen_infinigen, {kv_policy}"


def main(argv=None) -> int:
    p, a = parse(argv)
    import gguf_sizes_llama as llama
    from gguf_sizes_ours import in_subprocess
    from gguf_sizes_report import write_docs, write_outputs

    stem = Path(a.out).with_suffix("") if a.out.endswith(".json") else Path(a.out)
    if a.report_only:
        doc = artifacts.load(stem)
        write_outputs(doc, stem)
        if a.docs:
            write_docs(doc, stem, Path(a.docs))
        print(f"wrote {stem}.md, .png" + (f" and {a.docs}" if a.docs else ""))
        return 0
    # every bad input stops here, before a file is written or a model loaded
    if a.out_dir is None:
        p.error("--out-dir is needed: the folder the GGUF files are (or will be) in")
    if a.runs < 1 or a.batch == 1 or a.batch < 0:
        p.error("--runs must be at least 1, and --batch at least 2 (or 0: no batch row)")
    from flexgen_infinigen.kv import POLICIES
    unknown = [k for k in a.kv_policies if k not in POLICIES]
    if unknown:
        p.error(f"--kv-policies: no policy {', '.join(unknown)}; one of {', '.join(POLICIES)}")
    for key in a.models:
        if a.layers is not None and not 1 <= a.layers <= SHAPES[key].layers:
            p.error(f"--layers {a.layers}: {SHAPES[key].name} has 1.."
                    f"{SHAPES[key].layers} layers")
    a.llama_bench = llama.check_binary("--llama-bench", a.llama_bench)
    a.llama_batched_bench = llama.check_binary("--llama-batched-bench", a.llama_batched_bench)
    if not (a.llama_bench or a.llama_batched_bench):
        print("no --llama-bench / --llama-batched-bench: llama.cpp is not measured",
              flush=True)
    earlier = {"runs": []} if a.fresh else artifacts.load(stem)  # refuses an old-format file
    out_dir = Path(a.out_dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: out_dir / files_of(k).file_name(k, a.layers) for k in a.models}
    todo = [k for k, path in paths.items() if not path.is_file()]
    files.check_room(out_dir, sum(files_of(k).file_bytes(SHAPES[k], a.layers) for k in todo))
    settings = settings_of(a)

    for key in todo:
        files_of(key).write_gguf(key, paths[key], a.layers)
    for path in paths.values():
        got = in_subprocess({"gguf": str(path), "warm": True, **settings,
                             "batch": settings["batch"] or 1}, a.timeout)
        if "error" in got:
            raise SystemExit(f"error: our runtime cannot load {path}: {got['error']}")
    prefill_dir = a.prefill_dir or tempfile.mkdtemp(prefix="gguf-sizes-prefills-")
    rows: list[dict] = []
    meta = artifacts.run_meta(None if argv is None else ["benchmarks/gguf_sizes.py", *argv])
    try:
        for run in range(a.runs):
            for key in a.models:
                rows += one_run(a, key, paths[key], settings, run, prefill_dir)
    finally:
        if a.prefill_dir is None:
            import shutil
            shutil.rmtree(prefill_dir, ignore_errors=True)
        if rows:  # whatever was measured is kept, also after an error or ^C
            doc = save(stem, earlier, meta, rows, a, settings, paths)
            write_outputs(doc, stem)
            if a.docs:
                write_docs(doc, stem, Path(a.docs))
            print(f"appended a run to {stem}.json; wrote {stem}.md, .png", flush=True)
    return 0


def save(stem: Path, earlier: dict, meta: dict, rows: list[dict], a, settings: dict,
         paths: dict) -> dict:
    from machine import machine_info

    bw = [r["bandwidth_gb_s"] for r in rows if "bandwidth_gb_s" in r]
    run = {"meta": {**meta, "machine": machine_info(), "settings": settings,
                    "bandwidth_gb_s": round(statistics.median(bw), 1) if bw else None},
           "files": {k: {**files_of(k).describe(k, a.layers or SHAPES[k].layers),
                         "file": p.name, "file_bytes": p.stat().st_size}
                     for k, p in paths.items() if p.is_file()},
           "rows": rows}
    from gguf_sizes_report import LONG_TITLE, MOE_TITLE
    gpt_oss = all(k in moe_files.SHAPES for k in paths)
    title = MOE_TITLE if gpt_oss else LONG_TITLE if a.kv_policies != ["full"] else None
    doc = {**earlier, "runs": [*earlier["runs"], run],
           **({"title": title} if title else {}),
           "benchmark": "gguf_sizes.py: dense Q4_K_M models (random codes, real shapes), our "
                        "runtime and llama.cpp on the same file in the same run, beside the "
                        "decode step's must-read bound",
           "files_note": "random codes in llama.cpp's Q4_K_M mix (random_kquant_gguf.py); "
                         + "; ".join(f"{files.SHAPES[k].name}: {n}"
                                     for k, n in files.NOTES.items())
                         + "; gpt-oss: random codes, MXFP4 experts and Q8_0 matrices "
                           "(random_gpt_oss_gguf.py)"}
    artifacts.save(stem, doc)
    return doc


if __name__ == "__main__":
    sys.exit(main())
