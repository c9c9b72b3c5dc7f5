"""The import graph runs one way: from the commands down to the machinery
(docs/design/architecture.md).

Every module of the package is on a floor; a module may import its own floor and the floors
below, never above, and no chain of imports comes back to where it started. Imports inside
functions count (a lazy import is still a dependency), and so do ``if TYPE_CHECKING:`` ones:
an annotation that names an upper floor's class is the module knowing that floor (a change up
there breaks the type check down here), and it is how an object of an upper floor comes to be
passed down and called into. ``importlib.import_module("flexgen_infinigen....")`` with a
literal name counts too.

What no import shows is checked by the names the code uses: below a floor, no parameter
receives that floor's object (``lm``: the library's ``OffloadedLM``; ``engine``: the
engine's ``Engine``), no annotation names its class, and no attribute chain goes through
``.engine.`` (``lm.engine.generate_block`` was such a call: ``PolicyContext`` carries what a
policy needs instead).
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flexgen_infinigen"

# bottom to top: (floor, module prefixes on it)
FLOORS = [
    ("foundations", ["config", "flags", "switches", "guards", "placement", "sampling", "text"]),
    ("memory", ["memory"]),
    ("kernels", ["kernels"]),
    ("model families", ["models"]),
    ("weights", ["weights"]),
    ("KV policies", ["kv"]),
    ("engine", ["engine"]),
    ("library", ["api", "generation"]),
    ("planner", ["planner"]),
    ("pipeline", ["pipeline", "pipeline.engine", "pipeline.link", "pipeline.partition"]),
    ("command-line helpers", ["cli", "evals", "pipeline.args", "pipeline.launch",
                              "pipeline.report", "serving"]),
    ("commands", ["run", "batch", "eval", "optimize", "profile", "convert", "calibrate", "skew",
                  "harness", "serve"]),
]

# an upper floor's object, by the names code below it would use for it: (the module that
# defines it, its class, the parameter name it travels under)
UPPER_OBJECTS = [("api", "OffloadedLM", "lm"), ("engine.schedule", "Engine", "engine")]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _floor(module: str) -> int | None:
    best = None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                if best is None or len(p) > best[1]:
                    best = (i, len(p))
    return None if best is None else best[0]


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``module`` imports (submodule names resolved), wherever
    the import stands: at the top, in a function, under ``if TYPE_CHECKING:``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("flexgen_infinigen"):
                target = node.module[len("flexgen_infinigen"):].lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                out.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("flexgen_infinigen."):
                    out.add(alias.name[len("flexgen_infinigen."):])
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module")
              and node.args and isinstance(node.args[0], ast.Constant)
              and str(node.args[0].value).startswith("flexgen_infinigen.")):
            out.add(str(node.args[0].value)[len("flexgen_infinigen."):])
    return {m for m in out if m in known and m != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(m, p, known) for m, p in modules.items()}


def test_every_module_is_on_a_floor():
    missing = sorted(m for m in _modules() if m and _floor(m) is None)
    assert not missing, f"add these modules to a floor in FLOORS: {missing}"


def test_no_import_runs_up():
    """The package's ``__init__`` (the public names) is the one module that looks up."""
    wrong = []
    for module, deps in _graph().items():
        if not module:
            continue
        for dep in deps:
            if dep and _floor(dep) > _floor(module):
                wrong.append(f"{module} ({FLOORS[_floor(module)][0]}) imports {dep} "
                             f"({FLOORS[_floor(dep)][0]})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circle():
    graph = {m: {d for d in deps if d} for m, deps in _graph().items() if m}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                circles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "\n".join(circles)


def _annotation_names(node) -> set[str]:
    """The names an annotation mentions, quoted ones included."""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval")
        except SyntaxError:
            return set()
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n is not node:
            names |= _annotation_names(n)
    return names


def _annotations(tree) -> list[tuple[int, ast.AST]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arguments):
            found += [(a.lineno, a.annotation) for a in
                      [*node.posonlyargs, *node.args, *node.kwonlyargs, node.vararg, node.kwarg]
                      if a is not None and a.annotation is not None]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            found.append((node.lineno, node.returns))
        elif isinstance(node, ast.AnnAssign):
            found.append((node.lineno, node.annotation))
    return found


def _parameters(tree) -> list[tuple[int, str]]:
    return [(a.lineno, a.arg) for node in ast.walk(tree) if isinstance(node, ast.arguments)
            for a in [*node.posonlyargs, *node.args, *node.kwonlyargs, node.vararg, node.kwarg]
            if a is not None]


def test_no_module_receives_an_upper_floors_object():
    """Below the library no function takes the model (``lm``), below the engine none takes
    the engine; no annotation names their classes. A policy that needs something of the loaded
    model gets a ``PolicyContext`` (kv/base.py), made by the API; fix a finding by passing the
    values the function reads, or a context object declared on its own floor."""
    wrong = []
    for module, path in _modules().items():
        if not module:
            continue
        tree = _tree(path)
        params, names = _parameters(tree), _annotations(tree)
        for owner, cls, param in UPPER_OBJECTS:
            if _floor(module) >= _floor(owner):
                continue
            where = f"{module} ({FLOORS[_floor(module)][0]})"
            wrong += [f"{where}:{line} takes a parameter `{param}` ({cls}, {owner})"
                      for line, name in params if name == param]
            wrong += [f"{where}:{line} annotates with {cls} ({owner})"
                      for line, note in names if cls in _annotation_names(note)]
    assert not wrong, "\n".join(sorted(wrong))


def test_nothing_below_the_engine_reaches_through_an_engine():
    """``x.engine.y`` (or ``getattr(x, "engine")``) below the engine floor is a call up that no
    import shows: the object came down from above. Hand down the value or the callable
    instead (``PolicyContext.run_prompt`` runs a prompt pass for a KV policy)."""
    wrong = []
    for module, path in _modules().items():
        if not module or _floor(module) >= _floor("engine"):
            continue
        for node in ast.walk(_tree(path)):
            through = (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                       and node.value.attr == "engine")
            through |= (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "getattr" and len(node.args) >= 2
                        and isinstance(node.args[1], ast.Constant)
                        and node.args[1].value == "engine")
            if through:
                wrong.append(f"{module}:{node.lineno} `{ast.unparse(node)}`")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_planner_names_no_kv_policy():
    """A new KV policy is a class and a registry line: the planner and its measurements ask
    the policies (overhead_name, decode_work, device_bytes), never name them."""
    from flexgen_infinigen.kv import POLICIES

    names = [n for n in POLICIES if n != "full"]
    found = []
    for path in (PACKAGE / "planner").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value in names:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}")
    assert not found, found
