"""How well each speculation choice picks the tokens layer i+1 attends to (a fast diagnostic).

    python benchmarks/selection_recall.py              # SmolLM2, 2 wikitext windows, every variant
    python benchmarks/selection_recall.py --windows 4
    python benchmarks/selection_recall.py --only pages     # those variants' rows updated

One full-cache forward pass per window (teacher forcing with the full cache, so every
variant is judged on the same hidden states) records each layer's attention input, query,
keys and values. Then, for every decode position past the prefill and every layer that
selects, the variant speculates as the runtime does (layer i's attention input through layer
i+1's query weights, projected on the kept skewed columns, scored against the speculation
keys, turned into rows by the selection rule), and is scored against the exact attention:

* ``recall``: the share of the true attention mass (query heads averaged) on the chosen
  tokens plus the new one;
* ``output_error``: relative L2 error of the attention output over the chosen tokens.

It does not replace the perplexity sweep (``accuracy_sweep.py``), which runs the real decode
path where errors compound; it ranks variants in seconds instead of minutes each.

Each run appends to the ``runs`` list of ``--out``'s JSON (``--fresh``: a new list); the .md
table and the .png sum up the runs with the newest run's model, windows and budget.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from flexgen_infinigen import OffloadedLM
from flexgen_infinigen.kv.infinigen.skew import (DEFAULT_CALIBRATION, key_gram, projection,
                                                 query_gram)
from flexgen_infinigen.kv.selection_rules import Budget, select
from flexgen_infinigen.kv.infinigen.spec_keys import SpeculationKeys, bytes_per_key
from flexgen_infinigen.kv.infinigen.spec_pages import PAGE_KINDS, SpeculationPages
from flexgen_infinigen.kernels.attention import attend, mask_bias

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import artifacts  # noqa: E402

TEXT = ROOT.parent / "shared" / "data" / "wikitext2_test.txt"
PARAGRAPH = ROOT / "benchmarks" / "data" / "calibration_paragraph.txt"
OUT = artifacts.INVESTIGATIONS / "selection_recall"
DEFAULT = dict(rule="mass", alpha=math.inf, fraction=0.18, keys="int4", ratio=1.0,
               calibration="built-in", prompt_skew=False, column_score="q", sink=0, recent=0,
               query="guess")
VARIANTS = [
    ("defaults (int4 keys, mass, built-in text)", {}),
    ("oracle (exact scores, mass)", dict(exact=True)),
    ("first rule: margin, alpha 5, partial 0.3, paragraph",
     dict(rule="margin", alpha=5.0, keys="partial", ratio=0.3, calibration="paragraph")),
    ("selection=cap", dict(rule="cap")),
    ("selection=margin alpha 5", dict(rule="margin", alpha=5.0)),
    ("selection=artifact alpha 5", dict(rule="artifact", alpha=5.0)),
    ("selection=head-union", dict(rule="head-union")),
    ("keys=partial ratio=0.1", dict(keys="partial", ratio=0.1)),
    ("keys=partial ratio=0.2", dict(keys="partial", ratio=0.2)),
    ("keys=partial ratio=0.3", dict(keys="partial", ratio=0.3)),
    ("keys=partial ratio=0.5", dict(keys="partial", ratio=0.5)),
    ("keys=partial ratio=1.0", dict(keys="partial", ratio=1.0)),
    ("keys=int4 ratio=0.5", dict(ratio=0.5)),
    ("keys=int2", dict(keys="int2")),
    ("keys=int8", dict(keys="int8")),
    ("keys=partial 0.3, calibration=paragraph", dict(keys="partial", ratio=0.3,
                                                     calibration="paragraph")),
    ("keys=partial 0.3, calibration=corpus", dict(keys="partial", ratio=0.3,
                                                  calibration="corpus")),
    ("keys=partial 0.3, calibration=built-in+prompt", dict(keys="partial", ratio=0.3,
                                                           prompt_skew=True)),
    ("keys=partial 0.3, column-score=qk", dict(keys="partial", ratio=0.3, column_score="qk")),
    ("calibration=paragraph", dict(calibration="paragraph")),
    ("sink=4 recent=16", dict(sink=4, recent=16)),
    ("keys=pages16 (page bounds, whole pages)", dict(keys="pages16")),
    ("keys=pages16 ratio=0.3", dict(keys="pages16", ratio=0.3)),
    ("keys=pages8", dict(keys="pages8")),
    ("query=renorm (layer i's residual through layer i+1's own norm)", dict(query="renorm")),
    ("query=post-attn (the residual after layer i's attention)", dict(query="post-attn")),
    ("query=exact (the layer's own query, int4 keys)", dict(query="exact")),
    ("query=exact keys=int8", dict(query="exact", keys="int8")),
    ("fraction=0.085", dict(fraction=0.085)),
    ("oracle, fraction=0.085", dict(fraction=0.085, exact=True)),
]


class Recorder:
    """Runs the model's stages on one sequence and keeps what the speculation needs."""

    def __init__(self, lm):
        self.lm, self.cfg, self.engine = lm, lm.cfg, lm.engine
        self.fam = self.engine.family
        self.weights = [self.engine.reads.load(j) for j in range(len(self.engine.stages))]

    @torch.no_grad()
    def __call__(self, ids: list[int]):
        cfg, fam = self.cfg, self.fam
        x_ids = torch.tensor([ids])
        n = x_ids.shape[1]
        pos = torch.arange(n)[None]
        rope = fam.encode_positions(cfg, pos)
        bias = mask_bias(torch.ones(1, n, dtype=torch.bool), n, torch.float32)
        rec, h = {}, None
        for stage, w in zip(self.engine.stages, self.weights):
            if stage.kind == "embed":
                h = fam.embed(cfg, w, x_ids, pos)
            if stage.kind in ("attn", "layer"):  # "layer": attention and MLP, one stage
                x = fam.attn_input(cfg, w, h)
                q, k, v = fam.attn_qkv(cfg, w, x, rope)
                rec[stage.layer] = dict(x=x[0], q=q[0], k=k[0], v=v[0], w=w, h_in=h[0])
                h = fam.attn_out(cfg, w, h, attend(q, k, v, bias))
                rec[stage.layer]["h_mid"] = h[0]
            if stage.kind in ("mlp", "layer"):
                h = fam.mlp(cfg, w, h)
        return rec, rope


def grams(records, cfg):
    return (torch.stack([query_gram(records[i]["q"].double(), cfg.num_kv_heads)
                         for i in range(cfg.num_layers)]),
            torch.stack([key_gram(records[i]["k"].double()) for i in range(cfg.num_layers)]))


class _Tiers:
    device = torch.device("cpu")
    is_cuda = False

    @staticmethod
    def track(t, tier):
        return t


def _select_pages(kind: str, rows: torch.Tensor, pq: torch.Tensor, cached: torch.Tensor,
                  budget: Budget):
    """The runtime's page selection (``SpeculationPages.select_mass``) for every decode
    position at once: each position is a row of its own, over the same page summaries."""
    n, kv, w = rows.shape
    pages = SpeculationPages(kind, n, kv, w, torch.float32, _Tiers())
    pages.write(rows, 0)
    npos = pq.shape[0]
    pages.lo, pages.hi = (x.repeat(npos, 1, 1).contiguous() for x in (pages.lo, pages.hi))
    seen = cached.sum(-1)
    return pages.select_mass(pq, cached, torch.minimum(budget.caps(seen), seen), budget.most(n))


@torch.no_grad()
def evaluate(rec_windows, cfg, fam, calib: dict, prefill: int, exact=False, **over) -> dict:
    o = {**DEFAULT, **over}
    kv, heads, d = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    group = heads // kv
    budget = Budget(o["fraction"], None, 4, o["sink"], o["recent"])
    recall, err, chosen_share = [], [], []
    for rec, rope in rec_windows:
        for layer in range(2, cfg.num_layers):
            r = rec[layer]
            q, k, v = r["q"], r["k"], r["v"]
            n = q.shape[0]
            pos = torch.arange(prefill, n)
            gq, gk = calib[o["calibration"]]
            gq, gk = gq[layer], gk[layer]
            if o["prompt_skew"]:
                gq = (query_gram(q[:prefill].double(), kv) * prefill * group + 64 * gq) / (
                    prefill * group + 64)
            proj = projection(gq, gk, o["ratio"] if not exact else 1.0,
                              o["column_score"]).float()
            if exact or o["query"] == "exact":  # the layer's own query
                qs = q[pos]
            else:  # layer i's attention input through layer i+1's query weights (guess), or
                # layer i's residual before (renorm) or after (post-attn) its attention
                # through layer i+1's own input norm, then its query weights
                step_rope = tuple(t[0, pos][:, None] for t in rope) if rope else None
                before = rec[layer - 1]
                x_in = (before["x"][pos][:, None] if o["query"] == "guess" else
                        fam.attn_input(cfg, r["w"], before["h_in" if o["query"] == "renorm"
                                                          else "h_mid"][pos][:, None]))
                qs = fam.query(cfg, r["w"], x_in, step_rope)[:, 0]
            pq = torch.einsum("nkgd,kdr->nkgr", qs.reshape(-1, kv, group, d), proj)
            t = torch.arange(n)
            cached = t[None, :] < pos[:, None]
            if o["keys"] in PAGE_KINDS and not exact:
                order, counts = _select_pages(o["keys"], torch.einsum("skd,kdr->skr", k, proj),
                                              pq / math.sqrt(d), cached, budget)
            else:
                keys = SpeculationKeys("partial" if exact else o["keys"], n, kv, proj.shape[-1],
                                       torch.float32, _Tiers())
                keys.write(torch.einsum("skd,kdr->skr", k, proj), 0)
                approx = torch.einsum("nkgr,skr->nkgs", pq, keys.keys(n)) / math.sqrt(d)
                order, counts = select(approx, cached, o["rule"], o["alpha"], budget)
            # entries past a head's count may repeat chosen rows: they go to a spare column
            live = torch.arange(order.shape[-1]) < counts[..., None]
            pick = torch.zeros(len(pos), kv, n + 1, dtype=torch.bool)
            pick.scatter_(2, order.masked_fill(~live, n), True)
            pick = pick[..., :n]
            keep = (pick & cached[:, None]) | (t[None, :] == pos[:, None])[:, None]
            scores = torch.einsum("nkgd,skd->nkgs", q[pos].view(-1, kv, group, d), k) / math.sqrt(d)
            scores = scores.masked_fill(~(t[None, :] <= pos[:, None])[:, None, None], -math.inf)
            probs = torch.softmax(scores, -1)
            recall.append((probs * keep[:, :, None]).sum(-1).mean().item())
            full = torch.einsum("nkgs,skd->nkgd", probs, v)
            part = torch.einsum("nkgs,skd->nkgd", torch.softmax(
                scores.masked_fill(~keep[:, :, None], -math.inf), -1), v)
            err.append(((part - full).norm(dim=-1) / full.norm(dim=-1)).mean().item())
            chosen_share.append((counts.sum() / (cached.sum() * kv)).item())
    share = sum(chosen_share) / len(chosen_share)
    layers = cfg.num_layers
    return {"recall": sum(recall) / len(recall), "output_error": sum(err) / len(err),
            "relative_kv_size_speculative": share,
            "relative_kv_size": (2 + (layers - 2) * share) / layers,
            "speculation_key_bytes_fp16": None if exact or o["keys"] in PAGE_KINDS else
            bytes_per_key(o["keys"], max(1, round(o["ratio"] * d)), 2),
            "settings": {**o, "exact": exact}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="registry name or .gguf / folder")
    p.add_argument("--text", default=str(TEXT))
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--fraction", type=float, default=DEFAULT["fraction"],
                   help="the budget of the variants that set none (a share of each head's "
                        "cached tokens per selecting layer)")
    p.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                   help="run the variants whose name contains one of these")
    p.add_argument("--fresh", action="store_true", help="start the runs list anew")
    p.add_argument("--report-only", action="store_true",
                   help="only rewrite the .md and .png from the runs in the JSON")
    a = p.parse_args(argv)
    if a.report_only:
        write_outputs(Path(a.out).with_suffix(""))
        return 0
    if not Path(a.text).is_file():
        print(f"error: {a.text} is absent; pass --text (wikitext-2 test split)", file=sys.stderr)
        return 2
    lm = OffloadedLM.load(model=a.model, progress=False)
    with lm:
        record = Recorder(lm)
        ids = lm.tokenizer.encode(Path(a.text).read_text(encoding="utf-8"))
        stride = (len(ids) - 2048) // 4  # the accuracy sweep's windows; its tail calibrates
        windows = [record(ids[i * stride:i * stride + a.seq_len]) for i in range(a.windows)]
        calib = {"built-in": grams(record(lm.tokenizer.encode(DEFAULT_CALIBRATION))[0], lm.cfg),
                 "paragraph": grams(record(lm.tokenizer.encode(PARAGRAPH.read_text()))[0],
                                    lm.cfg),
                 "corpus": grams(record(ids[-1024:])[0], lm.cfg)}
        rows = {}
        for name, over in VARIANTS:
            if a.only and not any(x in name for x in a.only):
                continue
            start = time.perf_counter()
            over = {"fraction": a.fraction, **over}
            rows[name] = evaluate(windows, lm.cfg, record.fam, calib, a.prefill_len, **over)
            r = rows[name]
            print(f"{name:52s} recall {r['recall']:.4f}  error {r['output_error']:.4f}  "
                  f"kv {r['relative_kv_size']:.3f}  {time.perf_counter() - start:.0f}s",
                  flush=True)
    stem = Path(a.out).with_suffix("")
    settings = {k: v for k, v in vars(a).items()
                if k not in ("out", "only", "fresh", "report_only")}
    settings["model_name"] = lm.cfg.name
    settings["layers"] = lm.cfg.num_layers
    command = ["benchmarks/selection_recall.py", *(sys.argv[1:] if argv is None else argv)]
    run = {"meta": artifacts.run_meta(command), "settings": settings,
           "rows": [{"variant": name, **r} for name, r in rows.items()]}
    artifacts.append_run(stem, run, fresh=a.fresh)
    write_outputs(stem)
    return 0


def write_outputs(stem: Path) -> None:
    """``STEM.md`` and ``STEM.png`` from the runs of ``STEM.json`` with the newest run's model,
    windows and budget: one line a variant, each cell median (min-max, N runs)."""
    doc = artifacts.load(stem)
    keys = ("model", "windows", "seq_len", "prefill_len", "fraction")
    runs = [r for r in doc["runs"] if doc["runs"] and all(
        r["settings"].get(k) == doc["runs"][-1]["settings"].get(k) for k in keys)]
    if not runs:
        return
    st = runs[-1]["settings"]
    columns = [("attention mass recall", "recall", "{:.4f}"),
               ("output error", "output_error", "{:.4f}"),
               ("relative KV size", "relative_kv_size", "{:.3f}"),
               ("speculation key bytes (fp16)", "speculation_key_bytes_fp16", "{:.0f}")]
    lines = [f"# Selection recall: {st.get('model_name', st['model'])}, {st['windows']} "
             f"wikitext-2 windows of {st['seq_len']} tokens, decode positions "
             f"{st['prefill_len']}+, budget {st['fraction']}", "", artifacts.meta_line(runs), "",
             "| variant | " + " | ".join(h for h, _, _ in columns) + " |",
             "|" + "---|" * (1 + len(columns))]
    groups = artifacts.grouped(runs, ["variant"])
    order = [name for name, _ in VARIANTS]
    for (name,), got in sorted(groups.items(), key=lambda kv: order.index(kv[0][0])
                               if kv[0][0] in order else len(order)):
        lines.append("| " + " | ".join([name] + [artifacts.spread(
            (r.get(f) for r in got), fmt) for _, f, fmt in columns]) + " |")
    lines += ["", "Each cell: median (min-max, N runs)."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in order if (n,) in groups] + [k[0] for k in groups if k[0] not in order]
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(names) + 1.5))
    for i, name in enumerate(names):
        got = [r["recall"] for r in groups[(name,)]]
        ax.barh(i, sorted(got)[len(got) // 2], color="tab:blue", alpha=0.6)
        ax.plot(got, [i] * len(got), "ko", markersize=3)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="attention mass recall", xlim=(0, 1),
           title=f"{st.get('model_name', st['model'])}, budget {st['fraction']}")
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
