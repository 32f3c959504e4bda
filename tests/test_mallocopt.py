"""Daemons keep freed memory (hetpipe.mallocopt), unless the user set glibc's own knobs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

APPLY = "from hetpipe.mallocopt import keep_freed_memory; print(keep_freed_memory())"


def _applied(**env: str) -> str:
    out = subprocess.run([sys.executable, "-c", APPLY], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_daemon_keeps_freed_memory_unless_the_user_tuned_malloc() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    clean = subprocess.run([sys.executable, "-c", APPLY], env=env, capture_output=True,
                           text=True, timeout=60, check=True).stdout.strip()
    assert clean == "True"
    assert _applied(MALLOC_TRIM_THRESHOLD_="131072") == "False"
    assert _applied(MALLOC_MMAP_THRESHOLD_="131072") == "False"
