"""Imports run one way: every module of caspo belongs to a layer (DESIGN.md) and imports only from
its own layer or below, and no two modules import each other, directly or round a cycle."""

import ast
import subprocess
import sys
from pathlib import Path

import caspo

ROOT = Path(caspo.__file__).parent

# bottom to top; a module belongs to the layer of its longest matching prefix
LAYERS = [
    ("core", ["caspo", "caspo.config", "caspo.algo", "caspo.runlog", "caspo.precision", "caspo.device_memory",
              "caspo.allocator"]),
    ("parts", ["caspo.batch", "caspo.models", "caspo.rollout", "caspo.reward", "caspo.data", "caspo.segment",
               "caspo.eval", "caspo.report"]),
    ("train", ["caspo.methods", "caspo.train"]),
    ("tools", ["caspo.value"]),
    ("cli", ["caspo.cli", "caspo.cli_args", "caspo.cli_looped", "caspo.value.cli"]),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def layer_of(module: str) -> int | None:
    """The rank of the layer whose longest prefix names `module` ("caspo" itself names only the package)."""
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix != "caspo" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), rank)
    return None if best is None else best[1]


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str, source: str | None = None, is_package: bool | None = None) -> list[tuple[str, bool]]:
    """(imported caspo module, only for type checkers) for every import statement of `module`."""
    if source is None:
        source, is_package = MODULES[module].read_text(), MODULES[module].name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child):
                for stmt in child.body:
                    visit_stmt(stmt, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, typing_only)
            else:
                visit_stmt(child, typing_only)

    def visit_stmt(stmt: ast.AST, typing_only: bool) -> None:
        if isinstance(stmt, ast.Import):
            found.extend((a.name, typing_only) for a in stmt.names if a.name.split(".")[0] == "caspo")
        elif isinstance(stmt, ast.ImportFrom):
            base = stmt.module or ""
            if stmt.level:  # relative import
                parent = package.split(".")[:len(package.split(".")) - stmt.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if base.split(".")[0] != "caspo":
                return
            for alias in stmt.names:  # `from caspo.train import loop` imports the module caspo.train.loop
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in MODULES else base, typing_only))
        else:
            visit(stmt, typing_only)

    visit(ast.parse(source), False)
    return found


def test_every_module_has_a_layer():
    unassigned = [m for m in MODULES if layer_of(m) is None]
    assert not unassigned


def upward_imports(module: str, deps: list[tuple[str, bool]]) -> list[str]:
    return [f"{module} ({LAYERS[layer_of(module)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})"
            for dep, _ in deps if layer_of(dep) > layer_of(module)]


def test_no_import_goes_up_a_layer():
    upward = [line for m in MODULES for line in upward_imports(m, imports(m))]
    assert not upward, "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := walk(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def runtime_graph() -> dict[str, set[str]]:
    """Module -> the caspo modules it imports when it runs (a package's __init__ is imported by its modules)."""
    return {m: {dep for dep, typing_only in imports(m) if not typing_only and dep != m} for m in MODULES}


def test_no_import_cycles():
    cycle = find_cycle(runtime_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_upward_and_type_only_imports_are_seen():
    source = ("from typing import TYPE_CHECKING\nfrom caspo import algo\nfrom caspo.train.loop import train\n"
              "if TYPE_CHECKING:\n    from caspo.methods import Method\n"
              "def f():\n    from caspo.value import refresh\n")
    deps = imports("caspo.models.fake", source, is_package=False)
    assert deps == [("caspo.algo", False), ("caspo.train.loop", False), ("caspo.methods", True),
                    ("caspo.value.refresh", False)]
    assert len(upward_imports("caspo.models.fake", deps)) == 3  # type-only imports count for layers too
    assert layer_of("caspo.value.cli") == layer_of("caspo.cli") > layer_of("caspo.value.train")
    assert layer_of("caspo.caspology") is None


def test_looped_upstream_imports_first_in_a_fresh_interpreter():
    """Its docstring's usage, as the first import of a process (a circular import would fail here)."""
    run = subprocess.run([sys.executable, "-c", "from caspo.models.looped_upstream import load_upstream"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
