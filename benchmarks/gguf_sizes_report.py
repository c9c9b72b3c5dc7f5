"""The markdown table, the plot and the docs/results.md section of ``gguf_sizes.py``, from
every run in its JSON (the runs with the newest run's lengths: a table mixes no settings).

    python benchmarks/gguf_sizes_report.py [STEM] [--docs [RESULTS_MD]]

Each cell: median (min-max, N runs) over the runs (``artifacts.table``). Lines: our runtime,
llama.cpp and the bound (the step's must-read bytes over the measured read bandwidth, as
tokens/s) for each model.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import artifacts  # noqa: E402

TITLE = "Dense Q4_K_M models against llama.cpp"
# an artifact set of gpt-oss files (``--out``) has its own section
MOE_TITLE = "gpt-oss with MXFP4 experts against llama.cpp"
# and a run with KV policies beside the full cache (--kv-policies), at a long depth
LONG_TITLE = "A Q4_K_M model's decode at a long depth against llama.cpp"
# what that section's policy rows are, in its md and on the results page alike
LONG_NOTE = "infinigen: the default (own query, 4% of rows, >= 256; layers 0-1 read all)."


def title_of(doc: dict) -> str:
    return doc.get("title") or TITLE


def moe(doc: dict) -> bool:
    return title_of(doc) == MOE_TITLE
SETTINGS = ("depth", "gen", "prefill", "batch", "batch_prompt", "threads")


def latest_settings(runs: list[dict]) -> dict | None:
    for run in reversed(runs):
        if run["rows"]:
            return {k: run["rows"][0].get(k) for k in SETTINGS}
    return None


def columns(s: dict) -> list[tuple]:
    """The table's columns; a run without a batch row (``--batch 0``) shows none of its."""
    return [c for c in _all_columns(s) if s["batch"] or "batch" not in c[1]]


def _all_columns(s: dict) -> list[tuple]:
    return [("decode tok/s, depth 0", "decode_0_tokens_s", "{:.3g}"),
            (f"decode tok/s, depth {s['depth']}", "decode_depth_tokens_s", "{:.3g}"),
            (f"prefill tok/s ({s['prefill']})", "prefill_tokens_s", "{:.3g}"),
            (f"batch {s['batch']} tok/s", "batch_tokens_s", "{:.3g}"),
            ("x llama.cpp, depth 0", "x_llama_decode_0", "{:.2f}"),
            (f"x llama.cpp, depth {s['depth']}", "x_llama_decode_depth", "{:.2f}"),
            ("x llama.cpp, prefill", "x_llama_prefill", "{:.2f}"),
            (f"x llama.cpp, batch {s['batch']}", "x_llama_batch", "{:.2f}"),
            ("first token s", "ttft_s", "{:.3g}"),
            ("loaded s", "load_s", "{:.3g}"),
            ("peak RSS GB", "peak_rss_gb", "{:.3g}"),
            ("weights GB", "weights_placed_gb", "{:.3g}")]


def table(doc: dict) -> tuple[str, dict | None, list[dict]]:
    """(the markdown table, the lengths it shows, the runs it sums up)."""
    s = latest_settings(doc["runs"])
    if s is None:
        return "No runs yet.\n", None, []

    def same(r):
        return all(r.get(k) == v for k, v in s.items())
    runs = [run for run in doc["runs"] if any(same(r) for r in run["rows"])]
    return artifacts.table(runs, ["model", "program"], columns(s), where=same), s, runs


def note(s: dict, long: bool = False) -> str:
    return (f"Batch 1 decode after a 1-token prompt (depth 0) and a {s['depth']}-token one "
            f"(median step of {s['gen']} tokens after the first two; llama.cpp: `llama-bench` "
            f"tg{s['gen']} at `-d`); prefill: a {s['prefill']}-token prompt, warm; "
            + (f"batch {s['batch']}: total decode tokens/s of {s['batch']} sequences of "
               f"{s['batch_prompt']} prompt tokens (llama.cpp: `llama-batched-bench -npl "
               f"{s['batch']}`); " if s["batch"] else "")
            + "llama.cpp's flash attention off or on, whichever was faster; "
            "x llama.cpp: our rate over llama.cpp's in the same run. "
            "First token: from our process's start (interpreter, load, the prefill prompt); "
            "loaded: from the process's start to the model ready (no prompt yet). "
            f"bound: every tensor but `token_embd` (a MoE model: with only the experts a "
            f"step's rows route to, expected) plus the f16 KV at the depth (gpt-oss: its "
            f"windowed layers' window), over the read bandwidth measured before the run; "
            f"{s['threads']} threads for both."
            + (" " + LONG_NOTE if long else ""))


def markdown(doc: dict) -> str:
    text, s, runs = table(doc)
    if s is None:
        return f"# {title_of(doc)}\n\n{text}"
    return (f"# {title_of(doc)}\n\n{artifacts.meta_line(runs)}; read bandwidth "
            f"{_bandwidths(runs)}\n\n{text}\n{note(s, title_of(doc) == LONG_TITLE)}\n")


def _bandwidths(runs: list[dict]) -> str:
    bw = [r["bandwidth_gb_s"] for run in runs for r in run["rows"] if r.get("bandwidth_gb_s")]
    return f"{min(bw):.1f}–{max(bw):.1f} GB/s" if bw else "not recorded"


def plot(doc: dict, path: Path) -> None:
    """One panel a rate (decode at both depths, the batch's); a bar a program and model,
    its median over the runs, each run a dot; the bound a dashed line over the model."""
    plt = artifacts.pyplot()
    _, s, runs = table(doc)
    if plt is None or s is None:
        return
    groups = artifacts.grouped(runs, ["model", "program"],
                               lambda r: all(r.get(k) == v for k, v in s.items()))
    models = list(dict.fromkeys(k[0] for k in groups))
    programs = [p for p in dict.fromkeys(k[1] for k in groups) if p != "bound"]
    panels = [("decode_0_tokens_s", "batch 1, depth 0"),
              ("decode_depth_tokens_s", f"batch 1, depth {s['depth']}"),
              ("batch_tokens_s", f"batch {s['batch']} (total)")][:3 if s["batch"] else 2]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 + 2.2 * len(models) * 1.5, 4.2))
    width = 0.8 / max(1, len(programs))
    for ax, (field, title) in zip(axes, panels):
        for j, prog in enumerate(programs):
            for i, model in enumerate(models):
                values = [r[field] for r in groups.get((model, prog), []) if field in r]
                if not values:
                    continue
                x = i + (j - (len(programs) - 1) / 2) * width
                ax.bar(x, statistics.median(values), width, color=f"C{j}", alpha=0.7,
                       label=prog if i == 0 else None)
                ax.plot([x] * len(values), values, "k.", markersize=4)
        for i, model in enumerate(models):  # the bound: a line across the model's bars
            values = [r[field] for r in groups.get((model, "bound"), []) if field in r]
            if values:
                ax.hlines(statistics.median(values), i - 0.45, i + 0.45, colors="k",
                          linestyles="--", label="bound" if i == 0 else None)
        ax.set_xticks(range(len(models)), models, rotation=15, ha="right", fontsize=8)
        ax.set(title=title, ylabel="tokens/s")
        ax.grid(axis="y", alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"{'gpt-oss, MXFP4 experts' if moe(doc) else 'Dense Q4_K_M'}, random codes "
                 f"({len(runs)} run"
                 f"{'s' if len(runs) != 1 else ''})")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(doc: dict, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text(markdown(doc))
    plot(doc, stem.with_suffix(".png"))


def docs_section(doc: dict, stem: Path, results_md: Path) -> str:
    """This benchmark's section of docs/results.md: the machine, dates, commits and links;
    the commands; the table; what the columns mean."""
    text, s, runs = table(doc)
    rel = Path(_relative(stem, results_md.parent))
    links = ", ".join(f"[{ext}]({rel.with_suffix('.' + ext)})" for ext in ("json", "md", "png"))
    metas = [run["meta"] for run in runs]
    cpus = ", ".join(dict.fromkeys(f"{m.get('cpu')}, {m.get('cores')} cores" for m in metas))
    dates = ", ".join(dict.fromkeys(str(m.get("date")) for m in metas))
    commits = ", ".join(f"`{c}`" for c in dict.fromkeys(str(m.get("commit")) for m in metas))
    commands = "\n".join(dict.fromkeys(_command(str(m.get("command"))) for m in metas))
    lines = [f"## {title_of(doc)}",
             textwrap.fill(f"{cpus}; read bandwidth {_bandwidths(runs)}; {dates}, {commits}; "
                           f"{links}.", 100),
             "```bash", commands, "```", text.rstrip("\n"), ""]
    if s is not None:
        # a link is never broken across lines, or markdown would not render it
        lines.append(textwrap.fill(
            ("Random codes, MXFP4 experts and Q8_0 matrices" if moe(doc) else
             "Random codes in llama.cpp's Q4_K_M mix")
            + f", one file for both; {s['threads']} threads; "
            "llama.cpp's better flash-attention setting; bound: a step's bytes over the measured "
            "bandwidth ([columns](../benchmarks/README.md"
            "#gguf_sizespy-dense-7b-14b-q4_k_m-models-against-llamacpp-on-the-same-file)).",
            100, break_long_words=False, break_on_hyphens=False))
        if title_of(doc) == LONG_TITLE:
            lines.append(textwrap.fill(LONG_NOTE, 100))
    return "\n".join(lines) + "\n"


# a local path in a command, as the results page writes it
PLACEHOLDERS = {"--out-dir": "G", "--prefill-dir": "P", "--llama-bench": "path/to/llama-bench",
                "--llama-batched-bench": "path/to/llama-batched-bench"}


def _command(command: str) -> str:
    """A run's command with its local folders as placeholders, wrapped at 100 columns."""
    words = shlex.split(command)
    words = [w if not i else "STEM" if words[i - 1] == "--out" and Path(w).is_absolute()
             else PLACEHOLDERS.get(words[i - 1], w) for i, w in enumerate(words)]
    lines, line = [], ""
    for w in (shlex.quote(w) for w in words):
        if line and len(line) + len(w) + 3 > 100:
            lines.append(line + " \\")
            line = "    " + w
        else:
            line = f"{line} {w}" if line else w
    return "\n".join([*lines, line])


def _relative(stem: Path, folder: Path) -> str:
    import os
    return os.path.relpath(stem.resolve(), folder.resolve())


def write_docs(doc: dict, stem: Path, results_md: Path) -> None:
    """Replace this benchmark's section of ``results_md`` (from its heading to the next
    ``## ``), or add it at the end; the file is written whole or not at all."""
    import os

    section = docs_section(doc, stem, results_md)
    old = results_md.read_text() if results_md.is_file() else "# Results\n"
    lines = old.splitlines(keepends=True)
    head = f"## {title_of(doc)}"
    start = next((i for i, line in enumerate(lines) if line.rstrip() == head), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))
        new = "".join(lines[:start]) + section + ("\n" if end < len(lines) else "") \
            + "".join(lines[end:])
    tmp = results_md.with_name(results_md.name + ".tmp")
    tmp.write_text(new)
    os.replace(tmp, results_md)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("stem", nargs="?", default=str(artifacts.RESULTS / "gguf_sizes"))
    p.add_argument("--docs", nargs="?", default=None,
                   const=str(Path(__file__).resolve().parents[1] / "docs" / "results.md"))
    a = p.parse_args(argv)
    stem = Path(a.stem).with_suffix("") if a.stem.endswith(".json") else Path(a.stem)
    doc = artifacts.load(stem)
    write_outputs(doc, stem)
    if a.docs:
        write_docs(doc, stem, Path(a.docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
