"""The layers import downwards only: the pure core under both the planner and the runtime.

- ``hetpipe.core`` imports nothing of hetpipe but itself (type hints aside);
- the planner (``hetpipe.planner``) imports the core, itself and the cluster config, never a
  runtime module: what it shares with the runtime lives in the core;
- the runtime never imports the planner. The modules that turn a job into a plan are the
  planner's callers by design: the head, ``profiling`` and ``jobplan``.

Read from the source (every import statement, inside functions too), so an import that only
runs on some path counts as much as one at the top.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "hetpipe"
PLANNER_CALLERS = ("hetpipe.head", "hetpipe.profiling", "hetpipe.jobplan")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> list[tuple[str, Path]]:
    return sorted((module_name(p), p) for p in ROOT.rglob("*.py"))


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every hetpipe import in the file, outside ``if TYPE_CHECKING``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> Iterator[tuple[int, str]]:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                yield from visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            yield node.lineno, mod
            for alias in node.names:  # ``from hetpipe import planner``
                yield node.lineno, f"{mod}.{alias.name}"
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    for line, mod in visit(ast.parse(path.read_text(), str(path))):
        if mod == "hetpipe" or mod.startswith("hetpipe."):
            yield line, mod


def under(mod: str, *packages: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in packages)


def is_module(mod: str) -> bool:
    """Whether ``mod`` names a module of the package (``from x import name`` yields both)."""
    parts = mod.split(".")
    base = ROOT.parent.joinpath(*parts)
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def test_the_layers_are_found() -> None:
    names = [n for n, _ in modules()]
    assert "hetpipe.core.memory" in names and "hetpipe.planner.partition" in names


@pytest.mark.parametrize(("name", "path"), [m for m in modules() if under(m[0], "hetpipe.core")])
def test_the_core_imports_only_the_core(name: str, path: Path) -> None:
    bad = [
        (line, mod)
        for line, mod in imports(name, path)
        if is_module(mod) and not under(mod, "hetpipe.core") and mod != "hetpipe"
    ]
    assert bad == [], f"{name} imports outside the core: {bad}"


@pytest.mark.parametrize(("name", "path"), [m for m in modules() if under(m[0], "hetpipe.planner")])
def test_the_planner_imports_no_runtime_module(name: str, path: Path) -> None:
    allowed = ("hetpipe.core", "hetpipe.planner", "hetpipe.config")
    bad = [
        (line, mod)
        for line, mod in imports(name, path)
        if is_module(mod) and not under(mod, *allowed) and mod != "hetpipe"
    ]
    assert bad == [], f"{name} imports runtime modules: {bad}"


@pytest.mark.parametrize(
    ("name", "path"),
    [m for m in modules() if not under(m[0], "hetpipe.planner", *PLANNER_CALLERS)],
)
def test_the_runtime_does_not_import_the_planner(name: str, path: Path) -> None:
    bad = [(line, mod) for line, mod in imports(name, path) if under(mod, "hetpipe.planner")]
    assert bad == [], f"{name} imports the planner: {bad}"


def closure(start: str) -> set[str]:
    """Every hetpipe module ``start`` imports, directly or through others."""
    paths = dict(modules())
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in paths:
            continue
        seen.add(name)
        todo.extend(mod for _, mod in imports(name, paths[name]) if mod in paths)
    return seen


@pytest.mark.parametrize("daemon", ["hetpipe.worker", "hetpipe.stage", "hetpipe.pipeline"])
def test_a_worker_never_loads_the_planner(daemon: str) -> None:
    """A worker measures (hetpipe.measure) and runs stages; planning is the head's."""
    reached = sorted(m for m in closure(daemon) if under(m, "hetpipe.planner", *PLANNER_CALLERS))
    assert reached == [], f"{daemon} reaches {reached}"
