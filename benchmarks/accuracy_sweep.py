"""Perplexity against relative KV size: full cache, oracle, InfiniGen variants, H2O, 4-bit cache.

    python benchmarks/accuracy_sweep.py                  # SmolLM2, 4 wikitext-2 windows (~60 min)
    python benchmarks/accuracy_sweep.py --quick          # 1 short window, 3 methods (~2 min)
    python benchmarks/accuracy_sweep.py --only infinigen # methods whose name starts so

Every number comes from the real decode path: each window's first ``--prefill-len`` tokens
are prefilled, the rest are fed one at a time with the KV policy active (teacher forcing),
and every next token is scored. The windows run together as one batch (same length, no
padding). Relative KV size counts every layer (the two that read the whole cache at 1.0);
the JSON also has the selecting layers' share alone (the paper's count) and the share moved.
A "corpus" calibration is a wikitext slice far from the windows.

A sweep appends a run to the ``runs`` list of ``benchmarks/results/accuracy_sweep.json``
(``--out`` another stem; ``--fresh`` a new list; ``--resume`` continues the last run when its
settings match); the .md table and the .png plot sum up every run, one row group a window length
(``--report-only`` rewrites them alone).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm.auto import tqdm

from flexgen_infinigen import OffloadedLM, Placement
from flexgen_infinigen.evals.metrics import perplexity, teacher_forced_nll
from flexgen_infinigen.kv import InfiniGenOptions, SelectionOptions
from flexgen_infinigen.kv.options import DEFAULT_MIN_KV
from flexgen_infinigen.kv.infinigen.spec_keys import bytes_per_key

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import artifacts  # noqa: E402

TEXT = ROOT.parent / "shared" / "data" / "wikitext2_test.txt"
OUT = artifacts.RESULTS / "accuracy_sweep"


def ig(**kw):
    # every layer chooses at every size (a CPU otherwise reads a layer under 12 MB whole,
    # which is every layer of these short windows): the sweep measures the choosing; a curve
    # point reads its fraction alone (no floor in rows: min_num_kv 4, as before the default
    # had one), the "infinigen default" row the defaults with their floor
    return "infinigen", {"options": InfiniGenOptions(**{"select_from_mb": 0.0,
                                                        "min_num_kv": 4, **kw})}, False


PARAGRAPH = ROOT / "benchmarks" / "data" / "calibration_paragraph.txt"  # the first built-in text


def methods(budgets: list[float], h2o_budgets: list[float], corpus: str) -> dict[str, tuple]:
    """name -> (kv policy, kv options, 4-bit cache), most important first; a curve is a name
    without '=' up to ' @'."""
    rows = {"full": ("full", None, False), "4-bit cache": ("full", None, True),
            "infinigen default": ig(min_num_kv=DEFAULT_MIN_KV)}
    for f in budgets:
        rows[f"infinigen @{f}"] = ig(max_kv_fraction=f)
    h2o = {f"h2o @{f}": ("h2o", {"hh_ratio": f / 2, "recent_ratio": f / 2}, False)
           for f in h2o_budgets}
    oracle = {f"oracle @{f}": ("oracle", {"options": SelectionOptions(max_kv_fraction=f,
                                                                      min_num_kv=4)},
                               False) for f in budgets}
    four_bit = {f"infinigen+4-bit @{f}": ("infinigen", {"options": InfiniGenOptions(
        max_kv_fraction=f, select_from_mb=0.0)}, True) for f in (budgets[-1], budgets[1])}
    # the rows every goal needs first (the ends of each curve), then the points between
    for group in (oracle, h2o):
        for name in (list(group)[-1], list(group)[1], list(group)[0]):
            rows[name] = group[name]
    rows.update(list(four_bit.items())[:1])
    variants = _variants(budgets[-1], corpus)
    rows.update(list(variants.items())[:4])  # the first rule and the calibrations
    rows.update(oracle)
    rows.update(h2o)
    rows.update(four_bit)
    rows.update(variants)
    for query in ("renorm", "own"):  # the better speculation queries, as curves
        for f in budgets:
            rows[f"infinigen-{query} @{f}"] = ig(max_kv_fraction=f, speculation_query=query)
    return rows


def _variants(f: float, corpus: str) -> dict[str, tuple]:
    """InfiniGen at budget ``f`` with one choice changed from the defaults."""
    rows = {}
    rows[f"first rule (margin, partial 0.3, paragraph) @{f}"] = ig(
        max_kv_fraction=f, selection="margin", speculation_keys="partial", calibration=PARAGRAPH)
    for name, kw in (("paragraph", dict(calibration=PARAGRAPH)),
                     ("corpus", dict(calibration=corpus)), ("prompt", dict(prompt_skew=True))):
        rows[f"infinigen keys=partial calibration={name} @{f}"] = ig(
            max_kv_fraction=f, speculation_keys="partial", **kw)
    for rule in ("cap", "artifact", "head-union", "margin"):
        rows[f"infinigen selection={rule} @{f}"] = ig(max_kv_fraction=f, selection=rule)
    for ratio in (0.3, 0.1, 0.5):
        rows[f"infinigen keys=partial ratio={ratio} @{f}"] = ig(
            max_kv_fraction=f, speculation_keys="partial", partial_weight_ratio=ratio)
    rows[f"infinigen keys=int2 @{f}"] = ig(max_kv_fraction=f, speculation_keys="int2")
    rows[f"infinigen keys=int4 ratio=0.5 @{f}"] = ig(max_kv_fraction=f, partial_weight_ratio=0.5)
    rows[f"infinigen sink=4 recent=16 @{f}"] = ig(max_kv_fraction=f, keep_sink=4,
                                                  keep_recent=16)
    rows[f"infinigen calibration=paragraph @{f}"] = ig(max_kv_fraction=f, calibration=PARAGRAPH)
    rows[f"infinigen keys=partial ratio=0.2 @{f}"] = ig(
        max_kv_fraction=f, speculation_keys="partial", partial_weight_ratio=0.2)
    return rows


def score(store, windows, prefill, kv, kw, compress) -> dict:
    policy = Placement.from_percent([100, 0, 0, 100, 100, 0], gpu_batch_size=len(windows),
                                 compress_cache=compress)
    start = time.perf_counter()
    with OffloadedLM.load(path=store, policy=policy, kv_policy=kv, kv_options=kw,
                          progress=False) as lm:
        nll = teacher_forced_nll(lm, [w[:prefill] for w in windows],
                                 [w[prefill:] for w in windows])
        report = lm.engine.kv_policy.report()
        cfg = lm.cfg
    row = {"perplexity": perplexity(nll), "nll_per_window": nll.mean(1).tolist(),
           "relative_kv_size": report.get("relative_kv_size", 1.0),
           "relative_kv_size_speculative": report.get("relative_kv_size_speculative"),
           "kv_fetch_fraction": report.get("kv_fetch_fraction", 1.0),
           "tokens": int(nll.numel()), "seconds": time.perf_counter() - start,
           "kv_report": {k: v for k, v in report.items() if "per_layer" not in k}}
    if compress:  # a 4-bit cache's rows in fp16-equivalent bytes
        row["relative_kv_size"] *= FOUR_BIT
        row["kv_fetch_fraction"] *= FOUR_BIT
    if kv == "infinigen":  # the speculation keys' device bytes per token and KV head, in fp16
        o = kw["options"]
        r = max(1, round(o.ratio * cfg.head_dim))
        row["speculation_key_bytes_fp16"] = bytes_per_key(o.speculation_keys, r, 2)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default=str(TEXT))
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--budgets", nargs="+", type=float, default=[0.05, 0.085, 0.12, 0.18],
                   help="per selecting layer (InfiniGen, oracle); the variants run at the last")
    p.add_argument("--h2o-budgets", nargs="+", type=float, default=[0.1, 0.15, 0.2, 0.25])
    p.add_argument("--resume", action="store_true",
                   help="continue the last run in the output JSON (same settings): keep its "
                        "methods, run the rest")
    p.add_argument("--fresh", action="store_true", help="start the runs list anew")
    p.add_argument("--report-only", action="store_true",
                   help="only write the markdown and plot from the output JSON's runs")
    p.add_argument("--only", nargs="*", default=None, help="methods whose name starts so")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(OUT), help="the artifact stem (STEM.json, .md, .png)")
    a = p.parse_args(argv)
    stem = Path(a.out).with_suffix("")
    if a.quick:
        a.seq_len, a.prefill_len, a.windows, a.budgets = 384, 128, 1, [0.1, 0.18]
        a.only = a.only or ["full", "oracle", "infinigen @"]
    if a.report_only:
        write_outputs(stem)
        return 0
    if not a.quick:
        print("the full sweep takes about an hour on 2 CPU cores; --quick takes about 2 "
              "minutes", file=sys.stderr)
    text_path = Path(a.text)
    if not text_path.is_file():
        print(f"error: {text_path} is absent; pass --text (wikitext-2 test split)",
              file=sys.stderr)
        return 2
    from flexgen_infinigen.config import get_config
    from flexgen_infinigen.text.tokenizer import load_tokenizer
    from flexgen_infinigen.weights.embedded import default_model_store
    store = default_model_store(progress=False)
    ids = load_tokenizer(store, get_config("smollm2-135m")).encode(
        text_path.read_text(encoding="utf-8"))
    stride = (len(ids) - 2048) // a.windows  # windows spread over the text; its tail calibrates
    windows = [ids[i * stride:i * stride + a.seq_len] for i in range(a.windows)]
    corpus = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
    corpus.write(load_tokenizer(store, get_config("smollm2-135m")).decode(ids[-1024:]))
    corpus.close()
    table = methods(a.budgets, a.h2o_budgets, corpus.name)
    if a.only:
        table = {k: v for k, v in table.items() if any(k.startswith(o) for o in a.only)}
    settings = {k: v for k, v in vars(a).items()
                if k not in ("out", "resume", "only", "report_only", "fresh")}
    settings["text"] = text_path.name
    settings["window_starts"] = [i * stride for i in range(a.windows)]
    doc = {"runs": []} if a.fresh else artifacts.load(stem)
    results, index = {}, len(doc["runs"])  # the run this sweep writes: a new one
    if a.resume and doc["runs"] and doc["runs"][-1].get("settings") == settings:
        index -= 1  # or the last, continued
        results = {r["method"]: r for r in doc["runs"][-1]["rows"]}
    command = ["benchmarks/accuracy_sweep.py", *(sys.argv[1:] if argv is None else argv)]
    meta = artifacts.run_meta(command)
    for name, (kv, kw, compress) in tqdm(table.items(), desc="sweep", unit="method"):
        if name in results:
            continue
        results[name] = {"method": name, **score(store, windows, a.prefill_len, kv, kw,
                                                 compress)}
        r = results[name]
        tqdm.write(f"{name:50s} ppl {r['perplexity']:8.3f}  kv {r['relative_kv_size']:.3f} "
                   f"(spec {r['relative_kv_size_speculative'] or 0:.3f}, moved "
                   f"{r['kv_fetch_fraction']:.3f})  {r['seconds']:.0f}s")
        save(stem, doc, index, meta, settings, results)  # after every method: resumable
    write_outputs(stem)
    return 0


def save(stem: Path, doc: dict, index: int, meta: dict, settings: dict, results: dict) -> None:
    """The sweep so far as run ``index`` of ``doc`` (appended the first time), written."""
    full = results.get("full")
    for r in results.values():
        r["vs_full_pct"] = (100 * (r["perplexity"] / full["perplexity"] - 1)
                            if full and r is not full else None)
    run = {"meta": meta, "settings": settings, "rows": list(results.values())}
    doc["runs"][index:index + 1] = [run]
    doc.setdefault("model", "smollm2-135m")
    artifacts.save(stem, doc)


# 4-bit codes plus an fp16 scale and minimum per 64 values, against an fp16 cache (the
# convention of the papers; the runtime dtype on a CPU is float32, where it would be 0.156)
FOUR_BIT = (0.5 + 2 * 2 / 64) / 2
COLUMNS = [("relative KV size", "relative_kv_size", "{:.3f}"),
           ("perplexity", "perplexity", "{:.3f}"), ("vs full (%)", "vs_full_pct", "{:+.2f}")]
ORDER = ("full", "infinigen default", "infinigen @", "infinigen", "oracle @", "4-bit cache",
         "h2o @")


def _rank(name: str) -> tuple:
    """Rows in reading order: the ORDER groups, the larger budget first in each."""
    group = next((i for i, o in enumerate(ORDER) if name.startswith(o)), len(ORDER))
    budget = name.rpartition(" @")[2] if " @" in name else ""
    try:
        return group, -float(budget), name
    except ValueError:
        return group, 0.0, name


def _window(run: dict) -> str:
    """A run's windows as a table key: ``1,024 (256 prefilled)``."""
    st = run["settings"]
    return f"{st['seq_len']:,} ({st['prefill_len']:,} prefilled)"


def _by_window(doc: dict) -> dict[str, list[dict]]:
    """Every run's rows, each with its run's window, grouped by window (shortest first)."""
    runs = sorted(doc["runs"], key=lambda r: (r["settings"]["seq_len"],
                                              r["settings"]["prefill_len"]))
    out: dict[str, list[dict]] = {}
    for run in runs:
        out.setdefault(_window(run), []).append(
            {**run, "rows": [{**row, "window": _window(run)} for row in run["rows"]]})
    return out


def markdown(doc: dict) -> str:
    if not doc["runs"]:
        return "# Perplexity against relative KV size\n\nNo runs yet.\n"
    st = doc["runs"][-1]["settings"]
    lines = [f"# SmolLM2-135M, WikiText-2: perplexity against relative KV size, "
             f"{st['windows']} windows a length", "", artifacts.meta_line(doc["runs"]), "",
             "| window (tokens) | method | " + " | ".join(h for h, _, _ in COLUMNS) + " |",
             "|" + "---|" * (2 + len(COLUMNS))]
    for window, runs in _by_window(doc).items():
        groups = artifacts.grouped(runs, ["method"])
        for (name,), rows in sorted(groups.items(), key=lambda kv: _rank(kv[0][0])):
            cells = [window, name] + [artifacts.spread((r.get(f) for r in rows), fmt)
                                      for _, f, fmt in COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Each cell: median (min-max, N runs). Relative KV size: rows attention read "
              "over rows cached, every layer counted (the two that read the whole cache at "
              "1.0); the 4-bit rows in fp16-equivalent bytes. vs full: against the full "
              "cache's perplexity over the same windows in the same run."]
    return "\n".join(lines) + "\n"


def plot(path: Path, doc: dict) -> None:
    plt = artifacts.pyplot()
    if plt is None:
        return
    windows = _by_window(doc)
    if not windows:
        return
    fig, axes = plt.subplots(1, len(windows), figsize=(5.5 * len(windows), 4.5), squeeze=False)
    for ax, (window, runs) in zip(axes[0], windows.items()):
        med = {name: (statistics.median(r["relative_kv_size"] for r in rows),
                      statistics.median(r["perplexity"] for r in rows))
               for (name,), rows in artifacts.grouped(runs, ["method"]).items()}
        curves: dict[str, list] = {}
        for name, pt in med.items():
            if " @" in name and "=" not in name:
                curves.setdefault(name.split(" @")[0], []).append(pt)
        for label, pts in curves.items():
            ax.plot(*zip(*sorted(pts)), "-o", label=label)
        for name, marker in (("4-bit cache", "^"), ("infinigen default", "*")):
            if name in med:
                ax.plot(*med[name], marker, markersize=9, label=name)
        if "full" in med:
            ax.axhline(med["full"][1], color="gray", ls="--", label="full")
        ax.set(xlabel="relative KV size (rows read / rows cached)",
               ylabel="perplexity (median over runs)", title=f"window {window}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"SmolLM2-135M, WikiText-2, decode path ({len(doc['runs'])} runs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(stem: Path) -> None:
    """``STEM.md`` and ``STEM.png`` from every run in ``STEM.json``."""
    doc = artifacts.load(stem)
    text = markdown(doc)
    stem.with_suffix(".md").write_text(text)
    plot(stem.with_suffix(".png"), doc)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
