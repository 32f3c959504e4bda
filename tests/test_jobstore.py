"""Job records on disk: ids never become paths, numbers continue, results round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetpipe.jobstore import job_dir, list_jobs, next_number, read_result, write_result


@pytest.mark.parametrize("bad", ["", "../x-1", "a/b-1", ".hidden-1", "x" * 300, "a..b-1"])
def test_job_ids_that_are_not_names_have_no_directory(tmp_path: Path, bad: str) -> None:
    assert job_dir(tmp_path, bad) is None
    assert read_result(tmp_path, bad) is None


def test_numbers_continue_after_the_jobs_on_disk(tmp_path: Path) -> None:
    assert next_number(tmp_path) == 1
    for name in ("demo-1", "demo-7", "other-3", "stray"):
        (tmp_path / "jobs" / name).mkdir(parents=True)
    assert next_number(tmp_path) == 8


def test_results_round_trip_and_list_in_number_order(tmp_path: Path) -> None:
    write_result(tmp_path, "b-10", {"id": "b-10", "state": "done"})
    write_result(tmp_path, "a-2", {"id": "a-2", "state": "failed", "error": "x"})
    (tmp_path / "jobs" / "c-3").mkdir()  # a job that left no result
    (tmp_path / "jobs" / "d-4").mkdir()
    (tmp_path / "jobs" / "d-4" / "result.json").write_text("{not json")
    assert read_result(tmp_path, "a-2") == {"id": "a-2", "state": "failed", "error": "x"}
    assert [j["id"] for j in list_jobs(tmp_path)] == ["a-2", "b-10"]
    assert not list((tmp_path / "jobs" / "b-10").glob(".*"))  # no temporary file left
