"""benchmarks/gguf_sizes.py's llama.cpp side against stand-ins that print what llama-bench
and llama-batched-bench print (each setting's speed encoded in it, so that what was asked for
and what was kept are both checked), its bound, and its docs/results.md section (replaced in
place, every other section kept)."""
import json
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gguf_sizes  # noqa: E402
import gguf_sizes_llama as llama  # noqa: E402
import gguf_sizes_report as report  # noqa: E402

# llama-bench -o json: one record per (prompt, gen, depth, flash attention) and -r samples;
# decode is faster with flash attention on, prefill with it off
BENCH = r'''#!{python}
import json, sys
a = sys.argv[1:]
args = dict(zip(a[::2], a[1::2]))
if "{fail}" == "1":
    sys.stderr.write("error: failed to load model\n"); sys.exit(1)
out = []
for fa in map(int, args["-fa"].split(",")):
    for d in map(int, args["-d"].split(",")):
        p, n = int(args["-p"]), int(args["-n"])
        ts = (1000.0 if p else 100.0) / (1 + d / 1024) * ((1 + fa) if n else (2 - fa))
        out.append({{"n_prompt": p, "n_gen": n, "n_depth": d, "flash_attn": fa,
                    "avg_ts": ts, "samples_ts": [ts] * int(args["-r"]), "n_threads":
                    int(args["-t"]), "type_k": "f16", "type_v": "f16"}})
print(json.dumps(out))
'''
# llama-batched-bench --output-format jsonl: flash attention on is the faster
BATCHED = r'''#!{python}
import json, sys
a = sys.argv[1:]
args = dict(zip(a[::2], a[1::2]))
print("some log line")
print(json.dumps({{"pl": int(args["-npl"]), "pp": int(args["-npp"]), "tg": int(args["-ntg"]),
                  "speed_tg": 40.0 if args["-fa"] == "on" else 30.0}}))
'''


def _script(tmp_path: Path, name: str, text: str, fail: bool = False) -> str:
    path = tmp_path / name
    path.write_text(text.format(python=sys.executable, fail="1" if fail else "0"))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_llama_bench_keeps_the_faster_flash_attention_setting_per_test(tmp_path):
    bench = _script(tmp_path, "llama-bench", BENCH)
    got = llama.decode_and_prefill(bench, str(tmp_path / "m.gguf"), threads=2, reps=3,
                                   depths=[0, 4096], gen=32, prefill=512, timeout=60)
    assert got["decode"][0]["samples"] == [200.0] * 3 and got["decode"][0]["fa"] == 1
    assert got["decode"][4096]["samples"] == [40.0] * 3
    assert got["decode"][4096]["other_fa_median"] == [20.0]
    assert got["prefill"]["samples"] == [2000.0] * 3 and got["prefill"]["fa"] == 0
    cmd = got["decode"][0]["command"]
    assert "-n 32" in cmd and "-d 0,4096" in cmd and "-fa 0,1" in cmd and "-r 3" in cmd
    assert cmd.startswith("llama-bench -m m.gguf")  # no local folders


def test_batched_bench_is_run_reps_times_and_the_faster_setting_kept(tmp_path):
    binary = _script(tmp_path, "llama-batched-bench", BATCHED)
    got = llama.batched(binary, "m.gguf", threads=2, reps=2, prompt=128, gen=32, batch=8,
                        timeout=60)
    assert got["samples"] == [40.0, 40.0] and got["fa"] == 1
    assert "-npl 8" in got["command"] and "-npp 128" in got["command"]


def test_a_failing_llama_bench_gives_errors_not_an_exception(tmp_path):
    bench = _script(tmp_path, "llama-bench", BENCH, fail=True)
    got = llama.decode_and_prefill(bench, "m.gguf", 2, 1, [0], 8, 64, timeout=60)
    assert "failed to load model" in got["decode"][0]["error"]
    assert "failed to load model" in got["prefill"]["error"]


def test_a_bad_binary_path_is_one_error_naming_the_flag(tmp_path):
    with pytest.raises(SystemExit, match="--llama-batched-bench .*build/bin/llama-batched"):
        llama.check_binary("--llama-batched-bench", str(tmp_path / "nothing"))
    assert llama.check_binary("--llama-bench", None) is None


def test_the_bound_is_the_must_read_bytes_over_the_bandwidth():
    s = {"gen": 32, "depth": 4096, "batch": 8, "batch_prompt": 128}
    row = gguf_sizes.bound_row("qwen2.5-7b", 28, s, bandwidth=20e9)
    weights = 4_677_120_000 - 152064 * 3584 // 256 * 144  # the file's tensors, no token_embd
    assert row["must_read_weight_bytes"] == weights
    kv_token = 2 * 28 * 4 * 128 * 2  # K and V, f16, every layer
    assert row["decode_depth_tokens_s"] == pytest.approx(20e9 / (weights + kv_token * 4112))
    assert row["batch_tokens_s"] == pytest.approx(8 * 20e9 / (weights + 8 * kv_token * 144))


def _doc(depth: int) -> dict:
    rows = [{"model": "M", "program": p, "decode_0_tokens_s": v, "depth": depth, "gen": 8,
             "prefill": 64, "batch": 8, "batch_prompt": 16, "threads": 2,
             "bandwidth_gb_s": 20.0} for p, v in (("flexgen_infinigen", 5.0),
                                                  ("llama.cpp", 4.0))]
    meta = {"date": "2026-12-02", "commit": "abc1234", "cpu": "CPU", "cores": 2,
            "command": "python benchmarks/gguf_sizes.py --out-dir /data/g --llama-bench "
                       "/opt/llama.cpp/build/bin/llama-bench"}
    return {"runs": [{"meta": meta, "rows": rows}]}


def test_the_docs_section_is_replaced_in_place(tmp_path):
    page = tmp_path / "results.md"
    page.write_text(f"# Results\n\n## Before\nkept\n\n## {report.TITLE}\nan old table\n\n"
                    "## After\nalso kept\n")
    stem = tmp_path / "gguf_sizes"
    report.write_docs(_doc(512), stem, page)
    report.write_docs(_doc(4096), stem, page)
    text = page.read_text()
    assert text.count(f"## {report.TITLE}") == 1
    assert "depth 4096" in text and "depth 512" not in text and "an old table" not in text
    assert "## Before\nkept\n" in text and text.endswith("## After\nalso kept\n")
    assert "--out-dir G" in text and "--llama-bench path/to/llama-bench" in text
    assert "/data/g" not in text and "/opt/" not in text
    assert "| M | flexgen_infinigen | 5 (1 run) |" in text
    assert "[json](gguf_sizes.json)" in text
    assert json.dumps(_doc(4096))  # the doc is plain JSON


def test_an_absent_docs_section_is_added_at_the_end(tmp_path):
    page = tmp_path / "results.md"
    page.write_text("# Results\n\n## Before\nkept\n")
    report.write_docs(_doc(512), tmp_path / "gguf_sizes", page)
    text = page.read_text()
    assert text.startswith("# Results\n\n## Before\nkept\n\n## " + report.TITLE)


def test_an_unknown_kv_policy_or_batch_of_one_stops_before_any_work(tmp_path, capsys):
    for bad, says in ((["--kv-policies", "full", "nope"], "no policy nope"),
                      (["--batch", "1"], "--batch at least 2")):
        with pytest.raises(SystemExit):
            gguf_sizes.main(["--out-dir", str(tmp_path / "g"), "--out", str(tmp_path / "o"),
                             *bad])
        assert says in capsys.readouterr().err
    assert not (tmp_path / "g").exists() and not (tmp_path / "o.json").exists()


def test_without_a_batch_row_the_bound_has_none_and_rows_name_their_policy():
    s = {"gen": 32, "depth": 32768, "batch": 0, "batch_prompt": 128}
    row = gguf_sizes.bound_row("llama-3.1-8b", 2, s, bandwidth=20e9)
    files = gguf_sizes.files_of("llama-3.1-8b")
    step = (files.decode_read_bytes("llama-3.1-8b", 2, 1)
            + files.kv_read_bytes("llama-3.1-8b", 2, 32768 + 16))
    assert "batch_tokens_s" not in row
    assert row["decode_depth_tokens_s"] == pytest.approx(20e9 / step)
    assert gguf_sizes.program_of("full") == "flexgen_infinigen"
    assert gguf_sizes.program_of("infinigen") == "flexgen_infinigen, infinigen"
