"""The long-context benchmark's llama.cpp rows (benchmarks/llama_cpp.py), against a stand-in
llama-bench that prints what the real one prints (its JSON test records) for the arguments
it was given, so that what is parsed and what was asked for are both checked."""
import os
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from llama_cpp import LlamaBenchError, check, llama_bench_rows  # noqa: E402

# a stand-in: one record per depth and test (pp: n_prompt tokens, tg: n_gen tokens), with
# speeds that encode the depth and test, as llama-bench's "-o json" lays them out
FAKE = r'''#!{python}
import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
if "{fail}" == "1":
    sys.stderr.write("error: failed to load model\n")
    sys.exit(1)
out = []
for d in map(int, args["-d"].split(",")):
    for p, n in ((int(args["-p"]), 0), (0, int(args["-n"]))):
        if p == 0 and n == 0:
            continue
        out.append({{"model_type": "llama 256M Q4_1", "n_threads": int(args["-t"]),
                    "type_k": "f16", "type_v": "f16", "n_prompt": p, "n_gen": n,
                    "n_depth": d, "avg_ts": (1000.0 if p else 100.0) / (1 + d / 1024)}})
print(json.dumps(out, indent=2))
'''


def _fake(tmp_path: Path, fail: bool = False) -> str:
    path = tmp_path / "llama-bench"
    path.write_text(FAKE.format(python=sys.executable, fail="1" if fail else "0"))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _gguf(tmp_path: Path) -> str:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


def test_rows_are_the_decode_and_prefill_tests_at_each_depth(tmp_path):
    rows = llama_bench_rows(_fake(tmp_path), _gguf(tmp_path), [0, 4096], threads=2,
                            prefill_tokens=512, model_label="smollm2-135m")
    assert [r["context"] for r in rows] == [0, 4096]
    for r in rows:
        scale = 1 + r["context"] / 1024
        assert r["decode_tokens_s"] == pytest.approx(100.0 / scale)
        assert r["decode_step_s"] == pytest.approx(scale / 100.0)
        assert r["prefill_tokens_s"] == pytest.approx(1000.0 / scale)
        assert r["prefill_tokens"] == 512 and r["threads"] == 2
        assert r["policy"] == "llama.cpp" and r["batch"] == 1 and r["measured_in_run"]
        assert r["model"] == "smollm2-135m" and r["kv_cache"] == "f16/f16"
        assert "-d 0,4096" in r["command"] and "model.gguf" in r["command"]
        assert str(tmp_path) not in r["command"]  # no local folders in committed results


def test_decode_only_when_no_prefill_is_asked(tmp_path):
    rows = llama_bench_rows(_fake(tmp_path), _gguf(tmp_path), [8192], threads=1,
                            prefill_tokens=0)
    assert "prefill_tokens_s" not in rows[0]
    assert rows[0]["decode_tokens_s"] == pytest.approx(100.0 / 9)


def test_a_failing_llama_bench_gives_error_rows(tmp_path):
    rows = llama_bench_rows(_fake(tmp_path, fail=True), _gguf(tmp_path), [256, 512], threads=2)
    assert [r["context"] for r in rows] == [256, 512]
    assert all("failed to load model" in r["error"] for r in rows)


def test_bad_paths_are_one_clear_error(tmp_path):
    with pytest.raises(LlamaBenchError, match="llama-bench"):
        check(str(tmp_path / "nothing"), _gguf(tmp_path))
    with pytest.raises(LlamaBenchError, match="--llama-gguf"):
        check(_fake(tmp_path), None)
    with pytest.raises(LlamaBenchError, match="no such file"):
        check(_fake(tmp_path), str(tmp_path / "absent.gguf"))
    assert os.access(_fake(tmp_path), os.X_OK)
