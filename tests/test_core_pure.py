"""hetpipe/core is pure: importing any of its modules loads no torch, asyncio, zmq or numpy.

The core holds the rules the planner, the simulator and the runtime share; a rule that
needs a framework to be read belongs elsewhere. numpy is refused too: the core's vectorised
forms (:mod:`hetpipe.core.memory`) are plain arithmetic that numpy arrays passed by a
caller evaluate elementwise, so the core never imports numpy itself.

Each module is imported in a fresh interpreter, since this one has loaded everything.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import hetpipe.core

FORBIDDEN = ("torch", "asyncio", "zmq", "numpy")
MODULES = sorted(
    ["hetpipe.core"]
    + [f"hetpipe.core.{m.name}" for m in pkgutil.iter_modules(hetpipe.core.__path__)]
)


def test_the_core_has_modules() -> None:
    assert "hetpipe.core.schedule" in MODULES


@pytest.mark.parametrize("module", MODULES)
def test_core_module_imports_nothing_impure(module: str) -> None:
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps([m for m in {FORBIDDEN!r} if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"{module} loads {loaded}"
