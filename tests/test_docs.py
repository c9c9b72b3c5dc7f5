"""The documentation holds together: the README stays short, every relative link resolves, and
every ``python -m flexgen_infinigen.<command> ...`` line in a code block parses its flags
through that command's own parser (nothing runs: parsing stops the command)."""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 250

FENCE = re.compile(r"^[ \t]*```([\w-]*)\n(.*?)^[ \t]*```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
SHELL_OPERATORS = {"&&", "||", "|", ";", ">", ">>", "<", "&"}


def prose(text: str) -> str:
    """The page without its code blocks and inline code, where a link is not a link."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text(encoding="utf-8")))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def commands(page: Path) -> list[tuple[str, str, list[str]]]:
    """(the line as written, command name, its argument tokens) for each line of a shell code
    block that runs ``-m flexgen_infinigen.<command>``, backslash continuations joined."""
    found = []
    for m in FENCE.finditer(page.read_text(encoding="utf-8")):
        if m.group(1) not in SHELL_LANGUAGES:
            continue
        for line in m.group(2).replace("\\\n", " ").splitlines():
            if "-m flexgen_infinigen." not in line:
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            lexer.commenters = "#"
            try:
                tokens = list(lexer)
            except ValueError as e:  # unbalanced quotes: reported by the test, not at collection
                found.append((line.strip(), "", [str(e)]))
                continue
            for i, token in enumerate(tokens[:-1]):
                if token == "-m" and tokens[i + 1].startswith("flexgen_infinigen."):
                    args = []
                    for t in tokens[i + 2:]:
                        if t in SHELL_OPERATORS:
                            break
                        args.append(t)
                    found.append((line.strip(), tokens[i + 1].split(".", 1)[1], args))
    return found


def test_readme_is_at_most_250_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail to a page under docs/ and link it")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading gives #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


class _Parsed(Exception):
    """Raised instead of running the command once its flags have parsed."""


def _parse(monkeypatch, command: str, args: list[str]) -> argparse.Namespace:
    """``args`` through the command's own parser: its ``build_parser()`` when it has one, else
    its ``_main`` stopped at the first ``parse_args`` (which every command calls first).
    Abbreviated flags are refused: the docs spell every flag in full."""
    module = importlib.import_module(f"flexgen_infinigen.{command}")
    if hasattr(module, "build_parser"):
        parser = module.build_parser()
        parser.allow_abbrev = False
        return parser.parse_args(args)
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **k):
        self.allow_abbrev = False
        raise _Parsed(original(self, *a, **k))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(_Parsed) as parsed:
        module._main(args)
    return parsed.value.args[0]


DOC_COMMANDS = [(page, *c) for page in PAGES for c in commands(page)]


def test_the_readme_has_commands_to_check():
    names = {name for _, name, _ in commands(README)}
    assert "run" in names and len(commands(README)) >= 3, names


@pytest.mark.parametrize("page, line, command, args", DOC_COMMANDS,
                         ids=[f"{p.relative_to(ROOT)}:{c}:{i}"
                              for i, (p, _, c, _) in enumerate(DOC_COMMANDS)])
def test_every_documented_command_parses(monkeypatch, capsys, page, line, command, args):
    assert command, f"{page.relative_to(ROOT)}: `{line}` is not valid shell: {args[0]}"
    try:
        _parse(monkeypatch, command, args)
    except SystemExit as e:
        if e.code not in (0, None):  # --help exits 0
            pytest.fail(f"{page.relative_to(ROOT)}: `{line}` does not parse: "
                        f"{capsys.readouterr().err.strip().splitlines()[-1]}")


RESULTS_PAGE = ROOT / "docs" / "results.md"
RESULTS_DIR = ROOT / "benchmarks" / "results"
# the pages a reader follows: every page the guards below read
ALL_PAGES = [*PAGES, ROOT / "benchmarks" / "README.md"]
MONTH = ("(january|february|march|april|may|june|july|august|september|october|november|"
         "december)")
DATE = re.compile(rf"\b20\d\d-\d\d\b|\b{MONTH} \d|\b\d{{1,2}} {MONTH}\b", re.I)
# a folder of one machine, or the checkout's neighbour: a reader's machine has neither
LOCAL_PATH = re.compile(r"(?<![\w.~/-])(/(work|root|home|check|mnt|tmp)/[^\s)`'\"]*"
                        r"|\.\./shared\b[^\s)`'\"]*)")


def result_files() -> list[Path]:
    """The files under benchmarks/results/ that the repository holds: git's list in a
    checkout (a benchmark's output not yet committed is no part of the page), else all."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "benchmarks/results"], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return [p for p in RESULTS_DIR.rglob("*") if p.is_file()]
    return [ROOT / name for name in out.split("\0") if name and (ROOT / name).is_file()]


# about 21 lines a benchmark's section (the meta line and commands wrap at 100 columns), for
# the 24 benchmarks there are
RESULTS_MAX_LINES = 504


def test_the_results_page_stays_one_page():
    """Current numbers only: a section per benchmark, one table each; history lives in git."""
    lines = RESULTS_PAGE.read_text(encoding="utf-8").count("\n")
    assert lines <= RESULTS_MAX_LINES, (
        f"docs/results.md has {lines} lines (at most {RESULTS_MAX_LINES}): replace a rerun's "
        "table instead of adding one, and move investigations to a design page")


def test_no_results_heading_carries_a_date():
    """Links to a section must survive a rerun, which changes its date line, not its heading."""
    text = FENCE.sub("", RESULTS_PAGE.read_text(encoding="utf-8"))
    dated = [h for h in re.findall(r"^#+\s+(.*)$", text, re.M) if DATE.search(h)]
    assert not dated, f"docs/results.md headings with a date: {dated}"


def test_every_result_artifact_is_linked_from_the_results_page():
    """benchmarks/results/ holds one artifact set per section of the results page, no more."""
    linked = {(RESULTS_PAGE.parent / t.partition("#")[0]).resolve()
              for t in relative_links(RESULTS_PAGE)}
    unlinked = sorted(str(p.relative_to(ROOT)) for p in result_files()
                      if p.resolve() not in linked)
    assert not unlinked, ("files under benchmarks/results/ that docs/results.md does not link "
                          f"(link each from its section, or remove it; git keeps it): {unlinked}")


@pytest.mark.parametrize("page", ALL_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_names_a_path_outside_the_repository(page):
    """A page names files in the repository, or placeholders (DIR, path/to/...): a folder of
    the machine it was written on means nothing to a reader of a fresh clone."""
    text = page.read_text(encoding="utf-8")
    outside = [m.group(1) for m in LOCAL_PATH.finditer(text)]
    for target in relative_links(page):
        path = target.partition("#")[0]
        if path and not (page.parent / path).resolve().is_relative_to(ROOT):
            outside.append(target)
    assert not outside, f"{page.relative_to(ROOT)} names paths outside the repository: {outside}"
