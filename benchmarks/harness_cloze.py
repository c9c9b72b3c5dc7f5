"""A local multiple-choice task through lm-evaluation-harness: WikiText-2 cloze questions,
scored for each KV policy (full, InfiniGen and H2O at two budgets, a 4-bit cache).

    python benchmarks/harness_cloze.py                   # SmolLM2, 60 questions, ~1,500 tokens
    python benchmarks/harness_cloze.py --questions 20 --context 512      # a quick look

A question is a window of WikiText-2 (``../shared/data`` or ``--data``) cut just before a word
that already appeared at least 300 tokens earlier in the window and not in its last 200
tokens, so that the far context helps; the choices are that word and three other words of
the window of similar length (seeded). The task is written as a JSON Lines file plus a task
YAML in a temporary folder (no network) and run by ``lm_eval.simple_evaluate`` with the
``flexgen_infinigen`` model, once per policy. Each run is appended to the ``runs`` list of
``benchmarks/results/harness_cloze.json`` (``--tag`` another name, ``--fresh`` a new list);
``harness_cloze.md`` and ``.png`` sum up every run (``--report-only`` rewrites them alone).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import artifacts  # noqa: E402

OUT = artifacts.RESULTS
DATA = ROOT.parent / "shared" / "data" / "wikitext2_test.txt"
# label -> model_args beyond the model (fractions: the share of each KV head's context read)
POLICIES = {
    "full": "kv_policy=full",
    "infinigen@0.2": "kv_policy=infinigen,max_kv_fraction=0.2",
    "infinigen@0.1": "kv_policy=infinigen,max_kv_fraction=0.1",
    "h2o@0.2": "kv_policy=h2o,hh_ratio=0.1,recent_ratio=0.1",
    "h2o@0.1": "kv_policy=h2o,hh_ratio=0.05,recent_ratio=0.05",
    "full-4bit": "kv_policy=full,compress_cache=true",
}
WORD = re.compile(r"[A-Za-z][a-z]{4,}")


def questions(text: str, count: int, chars: int, seed: int) -> list[dict]:
    """Cloze questions from ``text``: contexts of about ``chars`` characters."""
    rng = random.Random(seed)
    out, tries = [], 0
    while len(out) < count and tries < 50 * count:
        tries += 1
        start = rng.randrange(0, len(text) - chars - 200)
        window = text[start:start + chars + 200]
        matches = list(WORD.finditer(window))
        late = [m for m in matches if m.start() > chars]
        rng.shuffle(late)
        for m in late:
            word, cut = m.group(), m.start()
            context = window[:cut]
            if not context.endswith(" ") or word in context[-800:]:
                continue
            if context[:-1200].count(word) == 0:  # seen, and far back
                continue
            others = sorted({w.group() for w in matches if w.group() != word
                             and abs(len(w.group()) - len(word)) <= 2})
            if len(others) < 3:
                continue
            choices = rng.sample(others, 3) + [word]
            rng.shuffle(choices)
            out.append({"context": context.rstrip(" "), "choices": choices,
                        "label": choices.index(word)})
            break
    if len(out) < count:
        raise SystemExit(f"found only {len(out)} questions in the text; lower --questions")
    return out


COLUMNS = [("accuracy", "acc"), ("stderr", "acc_stderr"), ("minutes", "minutes")]


def write(stem: Path) -> None:
    """``STEM.md`` (medians over every run) and ``STEM.png`` from ``STEM.json``."""
    doc = artifacts.load(stem)
    runs = doc["runs"]
    st = runs[-1]["settings"] if runs else {}
    title = (f"# WikiText-2 cloze through lm-evaluation-harness ({st.get('model')}, "
             f"{st.get('questions')} questions, ~{st.get('context_chars')} characters of "
             "context, 4 choices)")
    stem.with_suffix(".md").write_text(
        f"{title}\n\n{artifacts.meta_line(runs)}\n\n"
        + artifacts.table(runs, ["policy"], COLUMNS, fmt="{:.3g}")
        + "\nEach cell: median (min-max, N runs); stderr: the harness's standard error of "
          "the accuracy.\n")
    plt = artifacts.pyplot()
    if plt is None:
        return
    groups = artifacts.grouped(runs, ["policy"])
    names = [k[0] for k in groups]
    acc = [sorted(r["acc"] for r in rows)[len(rows) // 2] for rows in groups.values()]
    err = [groups[(n,)][0].get("acc_stderr") or 0 for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, acc, yerr=err, capsize=4)
    ax.set(ylabel="accuracy", ylim=(0, 1), title=f"WikiText-2 cloze ({len(runs)} runs)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model_args' model (default: SmolLM2)")
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--questions", type=int, default=60)
    p.add_argument("--context", type=int, default=6000, help="characters of context")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="harness_cloze", help="the artifact stem under results/")
    p.add_argument("--fresh", action="store_true", help="start the runs list anew")
    p.add_argument("--report-only", action="store_true",
                   help="only rewrite the .md and .png from the runs in the JSON")
    a = p.parse_args(argv)
    if a.report_only:
        write(OUT / a.tag)
        return 0
    if not Path(a.data).is_file():
        raise SystemExit(f"{a.data} is missing: give --data (a UTF-8 text)")
    import lm_eval
    from lm_eval.tasks import TaskManager

    import flexgen_infinigen.harness  # noqa: F401  (registers the model)

    docs = questions(Path(a.data).read_text(encoding="utf-8"), a.questions, a.context, a.seed)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "cloze.jsonl"
        data.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
        (Path(folder) / "cloze.yaml").write_text(
            "task: wikitext_cloze\ndataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
            "test_split: test\noutput_type: multiple_choice\n"
            "doc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
            "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n")
        manager = TaskManager(include_path=folder)
        for label in a.policies:
            args = POLICIES[label] + (f",model={a.model}" if a.model else "")
            start = time.perf_counter()
            out = lm_eval.simple_evaluate(model="flexgen_infinigen", model_args=args,
                                          tasks=["wikitext_cloze"], task_manager=manager,
                                          log_samples=False, bootstrap_iters=1000)
            res = out["results"]["wikitext_cloze"]
            rows.append({"policy": label, "model_args": args, "acc": res["acc,none"],
                         "acc_stderr": res.get("acc_stderr,none"),
                         "seconds": time.perf_counter() - start})
            print(f"{label}: acc {res['acc,none']:.3f}", flush=True)
    settings = {"questions": a.questions, "context_chars": a.context, "seed": a.seed,
                "model": a.model or "smollm2-135m", "data": Path(a.data).name}
    command = ["benchmarks/harness_cloze.py", *(sys.argv[1:] if argv is None else argv)]
    for r in rows:
        r["minutes"] = r["seconds"] / 60
    artifacts.append_run(OUT / a.tag, {"meta": artifacts.run_meta(command),
                                       "settings": settings, "rows": rows}, fresh=a.fresh,
                         benchmark="harness_cloze.py: WikiText-2 cloze questions through "
                                   "lm-evaluation-harness, one score per KV policy")
    write(OUT / a.tag)
    print(f"appended a run to {OUT / a.tag}.json; wrote .md, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
