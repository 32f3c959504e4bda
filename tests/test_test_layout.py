"""The tests' own layout: shared helpers live in ``conftest.py`` (fixtures, clusters, job
dicts) and ``helpers.py`` (references and checkers), and no test module imports another.

A helper one test module takes from another drifts with that module and is found in neither
home; importing a test module also runs its module-level code and fixtures a second time.
Read from the source (every import statement, inside functions too).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def imported(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every module the file imports; ``from x import y`` gives both
    ``x`` and ``x.y`` (``y`` may be a module)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            mod = "." * node.level + (node.module or "")
            yield node.lineno, mod
            for alias in node.names:
                yield node.lineno, f"{mod.rstrip('.')}.{alias.name}".lstrip(".")


def names_a_test_module(mod: str) -> bool:
    """Whether ``mod`` names a test module of this directory (``test_x``, ``tests.test_x``)."""
    return mod.split(".")[-1].startswith("test_") and (
        "." not in mod.lstrip(".") or mod.lstrip(".").startswith("tests.")
    )


def test_the_test_files_are_found() -> None:
    names = {p.name for p in TESTS.glob("*.py")}
    assert {"conftest.py", "helpers.py", "test_test_layout.py"} <= names
    assert names_a_test_module("test_wsp_e2e") and names_a_test_module("tests.test_wsp_e2e")
    assert not names_a_test_module("hetpipe.core.test_x") and not names_a_test_module("conftest")


@pytest.mark.parametrize("path", sorted(TESTS.glob("*.py")), ids=lambda p: p.name)
def test_no_test_module_imports_another(path: Path) -> None:
    bad = [(line, mod) for line, mod in imported(path) if names_a_test_module(mod)]
    assert bad == [], f"{path.name} imports test modules (move the helper to helpers.py): {bad}"


@pytest.mark.parametrize("path", sorted(TESTS.glob("*.py")), ids=lambda p: p.name)
def test_shared_helpers_are_imported_by_their_own_name(path: Path) -> None:
    """``conftest`` and ``helpers`` as pytest puts this directory on the path: through
    ``tests.`` they would be loaded a second time, as other modules."""
    bad = [
        (line, mod) for line, mod in imported(path) if mod == "tests" or mod.startswith("tests.")
    ]
    assert bad == [], f"{path.name} imports through the tests package: {bad}"
