"""``scripts/bench_staleness.py``: how repeated turns of an arm are summarised."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from helpers import load_script

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_staleness")


def record(accuracy: float, samples_per_s: float) -> dict[str, object]:
    return {
        "accuracy": accuracy,
        "samples_per_s": samples_per_s,
        "host_cpu": 0.2,
        "own_cores": 1.0,
        "curve": [[10, accuracy]],
    }


def test_repeated_turns_report_the_median_accuracy_and_speed(bench: ModuleType) -> None:
    """An asynchronous arm's accuracy depends on timing: one turn far from the others (a
    diverged run) must not stand for the arm because it came first."""
    kept = record(0.018, 1408.0)
    bench.repeat(kept, record(0.211, 1413.0))
    bench.repeat(kept, record(0.205, 1358.0))
    assert kept["accuracy"] == 0.205
    assert kept["accuracy_runs"] == [0.018, 0.211, 0.205]
    assert kept["samples_per_s"] == 1408.0
    assert kept["samples_per_s_runs"] == [1408.0, 1413.0, 1358.0]
    assert kept["curve"] == [[10, 0.018]]  # the first turn's, as plotted
