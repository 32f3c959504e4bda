"""``scripts/bench_soak.py`` at a small size: a one-stage job of minibatch 1 runs to ``done``
under a lowered frame limit (``[runtime] max_frame_bytes = "1MiB"``, the least allowed), so
no message may grow with the job's length (records stream in chunks); every daemon's memory
stays flat once the job is under way; the figures the benchmark reports are all there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_soak.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_soak_small_job_stays_bounded() -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--minibatches", "3000", "--max-frame", "1MiB", "--json"],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    figures = json.loads(r.stdout.strip().splitlines()[-1])
    assert figures["state"] == "done", figures
    assert figures["minibatches"] == 3000
    # the largest message stays well under the lowered limit (a stage's whole report in one
    # message would be about 250 bytes a minibatch)
    assert 0 < figures["largest_message_mib"] < 1.0, figures
    assert figures["largest_message_mib"] <= figures["targets"]["largest_message_mib"]
    assert set(figures["rss_growth_mb_by_daemon"]) == {"ps0", "worker-gpu0"}, figures
    assert figures["rss_growth_mb"] <= figures["targets"]["rss_growth_mb"], figures
    assert figures["job_dir_mib"] > 0
