"""The seams between the floors stay where they were drawn: the searches that must find
nothing, as tests (docs/design/architecture.md). Each failure names its fix."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flexgen_infinigen"
SWITCHES_PAGE = ROOT / "docs" / "usage" / "switches.md"


def _search(folder: Path, pattern: str, suffix: str = ".py", skip=()) -> list[str]:
    """``path:line: text`` of each line under ``folder`` that ``pattern`` matches."""
    found = []
    for path in sorted(folder.rglob(f"*{suffix}")):
        if path.resolve() in skip:
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(pattern, line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    return found


def test_the_engine_names_no_cache_class():
    found = _search(PACKAGE / "engine", r"InfiniGen|FullCache")
    assert not found, ("the engine asks every cache the same questions (KVCache.load, attend, "
                       "fused_attention, speculates) and never names a policy or its cache, "
                       "not even in a comment: say what the cache does instead\n"
                       + "\n".join(found))


def test_no_loaded_tuple_is_read_by_position():
    found = _search(PACKAGE, r"loaded\[") + _search(ROOT / "tests", r"loaded\[",
                                                      skip={Path(__file__).resolve()})
    assert not found, ("KVCache.load returns a Loaded (kv/base.py): read its fields "
                       "(loaded.read, .k, .v, .counts, .order), not positions\n"
                       + "\n".join(found))


def test_the_model_families_hold_math_only():
    found = _search(PACKAGE / "models", r"OnDemand|OnHost")
    assert not found, ("where an expert's matrices come from is the engine's (engine/experts.py,"
                       " an ExpertRunner); models/ routes and multiplies only\n"
                       + "\n".join(found))


def test_only_the_switches_module_reads_the_environment():
    found = _search(PACKAGE, r"\b(environ|getenv|putenv|unsetenv)\b",
                    skip={(PACKAGE / "switches.py").resolve()})
    assert not found, ("read or set an environment variable through a Switch in "
                       "flexgen_infinigen/switches.py (add one there, with its docs, and a row "
                       "in docs/usage/switches.md)\n" + "\n".join(found))


def _documented_switch_names() -> set[str]:
    """The package's own variables that its code, docstrings and pages mention."""
    names = set()
    for folder, suffix in ((PACKAGE, ".py"), (ROOT / "docs", ".md")):
        for path in folder.rglob(f"*{suffix}"):
            names |= set(re.findall(r"\bFLEXGEN_[A-Z0-9_]*[A-Z0-9]\b",
                                    path.read_text(encoding="utf-8")))
    names |= set(re.findall(r"\bFLEXGEN_[A-Z0-9_]*[A-Z0-9]\b",
                            (ROOT / "README.md").read_text(encoding="utf-8")))
    return names


def test_every_documented_variable_is_a_switch():
    from flexgen_infinigen import switches

    known = {s.name for s in switches.ALL}
    missing = sorted(_documented_switch_names() - known)
    assert not missing, (f"variables mentioned by the package or its docs but not in "
                         f"switches.ALL: {missing} (declare each in flexgen_infinigen/switches.py"
                         ", or stop mentioning it)")
    assert len(known) == len(switches.ALL), "a switch is listed twice in switches.ALL"


def test_the_switches_page_lists_every_switch():
    from flexgen_infinigen import switches

    text = SWITCHES_PAGE.read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", text, re.M))
    known = {s.name for s in switches.ALL}
    assert listed == known, (
        f"docs/usage/switches.md lacks {sorted(known - listed)} and lists unknown "
        f"{sorted(listed - known)}: paste flexgen_infinigen.switches.table() into it")
    assert switches.table() in text, ("docs/usage/switches.md's table is not "
                                      "switches.table(): paste the function's output into it")
