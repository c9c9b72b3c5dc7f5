"""The kernels' interface table (``flexgen_infinigen/kernels/table.py``) against the C sources
(``flexgen_infinigen/kernels/c``), read as text: no compiler needed. Every table entry is a
function the sources define, with the same parameters (names, order, types) and return type;
every function Python reaches through the library is in the table; no two C files call each
other. A prototype changed without the table fails here."""
from __future__ import annotations

import ast
import ctypes
import re
from pathlib import Path

import pytest

import flexgen_infinigen
from flexgen_infinigen.kernels import cpu_kernels
from flexgen_infinigen.kernels.table import KERNELS

PACKAGE = Path(flexgen_infinigen.__file__).parent
SOURCES = PACKAGE / "kernels" / "c"
_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "do", "else", "case",
             "__attribute__", "defined"}
_QUALIFIERS = {"static", "inline", "const", "extern", "volatile", "restrict", "__restrict__",
               "unsigned", "signed", "struct"}
_CTYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float,
           "double": ctypes.c_double, "void": None, "uint8_t": ctypes.c_uint8,
           "int8_t": ctypes.c_int8, "uint16_t": ctypes.c_uint16, "int32_t": ctypes.c_int32,
           "size_t": ctypes.c_size_t}


def _plain(text: str) -> str:
    """C text without comments, line continuations and preprocessor lines (both branches of
    an #if are kept: each is whole)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = text.replace("\\\n", " ")
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    return re.sub(r"__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)", " ", text)


def _ctype(decl: str):
    """The ctypes type of a declaration's type part (any pointer: c_void_p); a type this test
    does not map (a vector type of a static helper) stays its C text, equal to no entry's."""
    if "*" in decl or "[" in decl:
        return ctypes.c_void_p
    words = " ".join(w for w in re.findall(r"\w+", decl) if w not in _QUALIFIERS)
    return _CTYPES.get(words, words)


def _param(text: str) -> tuple[str, object]:
    text = text.strip()
    fn = re.search(r"\(\s*\*\s*(\w+)\s*\)", text)  # a function pointer: int (*f)(...)
    if fn:
        return fn.group(1), ctypes.c_void_p
    name = re.search(r"(\w+)\s*(\[[^\]]*\])?$", text)
    return name.group(1), _ctype(text[:name.start(1)] + (name.group(2) or ""))


def _split_params(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [] if [p.strip() for p in parts] in ([""], ["void"]) else parts


def definitions(text: str) -> list[dict]:
    """The function definitions of C text: name, static or not, return type, parameters
    ``[(name, ctypes type)]`` and the names the body calls."""
    text = _plain(text)
    found, depth, head, i = [], 0, "", 0
    while i < len(text):
        ch = text[i]
        if ch == "{" and depth == 0:
            end, depth = i + 1, 1
            while depth:
                depth += (text[end] == "{") - (text[end] == "}")
                end += 1
            head = head.strip()
            if head.endswith(")"):
                found.append(_function(head, text[i:end]))
            head, i = "", end
            continue
        head = "" if ch in ";}" else head + ch
        i += 1
    return found


def _function(head: str, body: str) -> dict:
    depth, j = 0, len(head) - 1
    while True:  # the parameter list's opening parenthesis
        depth += (head[j] == ")") - (head[j] == "(")
        if depth == 0:
            break
        j -= 1
    name = re.search(r"(\w+)\s*$", head[:j])
    prefix = head[:name.start(1)]
    calls = {m for m in re.findall(r"(?<![\w.>])([A-Za-z_]\w*)\s*\(", body)
             if m not in _KEYWORDS}
    return {"name": name.group(1), "static": "static" in prefix.split(),
            "returns": _ctype(prefix), "params": [_param(p) for p in _split_params(
                head[j + 1:-1])], "calls": calls}


def _headers(text: str, seen: set[str]) -> list[Path]:
    """The local headers a file includes, recursively."""
    out = []
    for h in re.findall(r'#include\s+"([^"]+)"', text):
        if h not in seen:
            seen.add(h)
            out += [SOURCES / h] + _headers((SOURCES / h).read_text(), seen)
    return out


def c_files() -> dict[str, dict]:
    """Each .c file: its exported (non-static) definitions, every name it defines (its own
    and its headers' static ones) and every name it calls (its headers' bodies included)."""
    files = {}
    for path in sorted(SOURCES.glob("*.c")):
        text = path.read_text()
        own = definitions(text)
        inlined = [d for h in _headers(text, set()) for d in definitions(h.read_text())]
        files[path.name] = {
            "exported": {d["name"]: d for d in own if not d["static"]},
            "defines": {d["name"] for d in own + inlined},
            "calls": set().union(*(d["calls"] for d in own + inlined)),
        }
    return files


FILES = c_files()
EXPORTED = {name: (f, d) for f, info in FILES.items() for name, d in info["exported"].items()}


def test_every_exported_function_is_defined_once():
    owners: dict[str, list[str]] = {}
    for f, info in FILES.items():
        for name in info["exported"]:
            owners.setdefault(name, []).append(f)
    assert {n: fs for n, fs in owners.items() if len(fs) > 1} == {}
    assert "decode_layer" in owners and "dl_select_step" in owners  # the parser sees them


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_table_matches_the_prototype(name):
    """Same parameter names, in the same order, with the same types; same return type."""
    assert name in EXPORTED, f"{name}: no exported definition in kernels/c/*.c"
    where, d = EXPORTED[name]
    kernel = KERNELS[name]
    assert list(kernel.params) == d["params"], f"{name} ({where}): table and prototype differ"
    assert kernel.returns is d["returns"], f"{name} ({where}): return types differ"


def _reached_names() -> set[str]:
    """Every C function name the package reaches through the library: ``lib.<name>``
    (``lib`` a name or an attribute, ``<name>`` a C function), ``invoke("<name>", ...)``,
    ``function_address("<name>")``, and any string that is exactly an exported function's
    name (a kernel chosen by name, as ``layers.linear_q4`` does)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "kernels" / "table.py":  # names every kernel: not a call
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                v = node.value
                if node.attr in EXPORTED and (
                        (isinstance(v, ast.Name) and v.id in ("lib", "_lib"))
                        or (isinstance(v, ast.Attribute) and v.attr in ("lib", "_lib"))):
                    found.add(node.attr)
            elif isinstance(node, ast.Call):
                f = node.func
                fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if fname in ("invoke", "function_address") and node.args:
                    a = node.args[0]
                    assert isinstance(a, ast.Constant) or fname == "invoke", path
                    if isinstance(a, ast.Constant):
                        found.add(a.value)
            elif isinstance(node, ast.Constant) and node.value in EXPORTED:
                found.add(node.value)
    return found


def test_everything_python_reaches_is_in_the_table():
    reached = _reached_names()
    assert {"linear_q4", "select_mass", "decode_layer"} <= reached  # the search finds calls
    assert sorted(reached - set(KERNELS)) == []


def test_no_two_c_files_call_each_other():
    """File A calls file B when A calls a function that only B defines (exported); the
    graph of files has no cycle (decode_layer.c reaches decode_select.c through a slot)."""
    graph = {}
    for f, info in FILES.items():
        targets = set()
        for name in info["calls"] - info["defines"]:
            owners = [g for g, other in FILES.items() if name in other["exported"]]
            if len(owners) == 1 and owners[0] != f:
                targets.add(owners[0])
        graph[f] = targets
    assert "decode_layer.c" in graph["decode_select.c"]  # one direction, seen by the parser
    assert "decode_select.c" not in graph["decode_layer.c"]
    state: dict[str, int] = {}

    def visit(f, path):
        state[f] = 1
        for g in sorted(graph[f]):
            assert state.get(g) != 1, f"C files call each other: {' -> '.join(path + [g])}"
            if g not in state:
                visit(g, path + [g])
        state[f] = 2

    for f in sorted(graph):
        if f not in state:
            visit(f, [f])


def _struct_fields(header: str, name: str) -> list[str]:
    """The field names of ``typedef struct ... { ... } name;`` in a header, in order."""
    body = re.search(r"typedef\s+struct\s*\w*\s*\{([^{}]*)\}\s*" + name + r"\s*;",
                     _plain((SOURCES / header).read_text())).group(1)
    names = []
    for decl in filter(str.strip, body.split(";")):
        fn = re.search(r"\(\s*\*\s*(\w+)\s*\)", decl)  # a function pointer
        names += [fn.group(1)] if fn else [re.findall(r"\w+", part)[-1]
                                           for part in _split_params(decl)]
    return names


def test_argument_blocks_match_their_ctypes_mirrors():
    """``dl_linear``, ``dl_args`` (the ``select_step`` slot included) and ``dl_select``
    field for field as their ctypes structures list them (every field 8 bytes wide)."""
    from flexgen_infinigen.kernels.layer_args import LayerArgs, LinearSpec
    from flexgen_infinigen.kv.infinigen.fused_select import SelectArgs
    for c_name, mirror in (("dl_linear", LinearSpec), ("dl_args", LayerArgs),
                           ("dl_select", SelectArgs)):
        fields = [f for f, _ in mirror._fields_]
        assert _struct_fields("decode_layer.h", c_name) == fields, c_name
        assert ctypes.sizeof(mirror) == 8 * sum(
            ctypes.sizeof(t) // 8 for _, t in mirror._fields_), c_name
    assert "select_step" in [f for f, _ in LayerArgs._fields_]


def test_invoke_refuses_wrong_arguments():
    """A missing or unknown argument, or a kernel not in the table, is a TypeError naming
    it, before anything is called (no library needed)."""
    with pytest.raises(TypeError, match="missing argument.*nthreads"):
        cpu_kernels.invoke("rotary_rows", x=0, cos=0, sin=0, y=0, tokens=0, heads=0, d=0)
    with pytest.raises(TypeError, match="unknown argument.*bogus"):
        cpu_kernels.invoke("h16_widen_rows", src=0, dst=0, n=0, bogus=1)
    with pytest.raises(TypeError, match="no_such_kernel"):
        cpu_kernels.invoke("no_such_kernel", x=0)
    with pytest.raises(TypeError, match="no_such_kernel"):
        cpu_kernels.function_address("no_such_kernel")


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler for the kernels")
def test_loaded_library_is_declared_from_the_table():
    """The library's argtypes and restype are the table's, and a keyword call runs."""
    lib = cpu_kernels.library()
    for name, kernel in KERNELS.items():
        fn = getattr(lib, name)
        assert list(fn.argtypes) == kernel.argtypes and fn.restype is kernel.returns, name
    assert cpu_kernels.function_address("dl_select_step") == ctypes.cast(
        lib.dl_select_step, ctypes.c_void_p).value != 0
    import numpy as np
    bits = np.array([0x3C00, 0xC000], dtype=np.uint16)  # float16 1.0 and -2.0
    out = np.zeros(2, np.float32)
    assert cpu_kernels.invoke("h16_widen_rows", src=bits.ctypes.data, dst=out.ctypes.data,
                              n=2) is None
    assert out.tolist() == [1.0, -2.0]
