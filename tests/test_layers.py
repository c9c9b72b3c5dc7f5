"""The import graph runs one way: from the commands down to the machinery
(docs/design/architecture.md).

Every module of the package is on a floor; a module may import its own floor and the floors
below, never above, and no chain of imports comes back to where it started. Imports inside
functions count (a lazy import is still a dependency); ``if TYPE_CHECKING:`` ones do not.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flexgen_infinigen"

# bottom to top: (floor, module prefixes on it)
FLOORS = [
    ("foundations", ["config", "flags", "policy", "sampling", "text"]),
    ("kernels and files", ["runtime", "runtime.compression", "runtime.cpu_kernels",
                           "runtime.huge_pages", "runtime.disk_io", "runtime.offload_dir",
                           "runtime.streams",
                           "runtime.guards", "runtime.mapped_rows"]),
    ("tiers", ["runtime.tiers", "runtime.tiered", "runtime.attention",
               "runtime.prefill_cache", "runtime.expert_homes"]),
    ("model families", ["models"]),
    ("weights", ["weights"]),
    ("KV policies", ["kv", "infinigen"]),
    ("engine", ["runtime.stages", "runtime.memory_plan", "runtime.fused_args",
                "runtime.fused_decode", "runtime.fused_select", "runtime.fused_moe",
                "runtime.routing_profile",
                "runtime.stage_compute", "runtime.engine", "runtime.loading"]),
    ("library", ["api"]),
    ("planner", ["planner"]),
    ("pipeline", ["pipeline", "pipeline.engine", "pipeline.link", "pipeline.partition"]),
    ("command-line helpers", ["cli", "evals", "pipeline.args", "pipeline.launch",
                              "pipeline.report", "serving"]),
    ("commands", ["run", "batch", "eval", "optimize", "profile", "convert", "skew",
                  "harness", "serve"]),
]


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


def _type_checking_lines(tree) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in ast.walk(node):
                lines.add(getattr(child, "lineno", -1))
    return lines


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``module`` imports (submodule names resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_lines(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
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
