"""Daemons keep freed memory (hetpipe.mallocopt), unless the user set glibc's own knobs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

APPLY = "from hetpipe.mallocopt import keep_freed_memory; print(keep_freed_memory())"


def _applied(**extra: str) -> str:
    """What keep_freed_memory() returns in a fresh process with ``extra`` in a clean
    environment (no MALLOC_* of the caller's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", APPLY],
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_daemon_keeps_freed_memory_unless_the_user_tuned_malloc() -> None:
    assert _applied() == "True"
    assert _applied(MALLOC_TRIM_THRESHOLD_="131072") == "False"
    assert _applied(MALLOC_MMAP_THRESHOLD_="131072") == "False"
