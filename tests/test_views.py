"""What the CLI prints: the pure renderers of :mod:`hetpipe.views`, fed status dicts as the
head answers them (no head, no process)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hetpipe import views


def worker(
    device: str, type_: str, speed: float, memory: int, state: str, **extra: Any
) -> dict[str, Any]:
    return {
        "device": device,
        "type": type_,
        "speed": speed,
        "memory": memory,
        "state": state,
        "job": None,
        "vw": None,
        "stage": None,
        **extra,
    }


def test_render_status_is_an_aligned_table() -> None:
    info = {
        "workers": [
            worker("gpu0", "fast", 1.0, 64 << 20, "idle"),
            worker("gpu3", "whimpy", 0.25, 3 << 20, "running", job="digits-1", vw=1, stage=2),
            worker("gpu10", "medium", 0.5, 2 << 30, "lost"),
        ],
        "jobs": [],
    }
    assert views.render_status(info).splitlines() == [
        "DEVICE  TYPE    SPEED  MEMORY   STATE    JOB       STAGE",
        "gpu0    fast    1      64.0MiB  idle     -         -",
        "gpu3    whimpy  0.25   3.0MiB   running  digits-1  vw1/stage2",
        "gpu10   medium  0.5    2.0GiB   lost     -         -",
    ]


def test_render_status_lists_the_last_ten_jobs() -> None:
    running = {
        "id": "digits-11",
        "state": "running",
        "total": 100,
        "minibatches": 40,
        "loss": 0.5,
        "samples_per_s": 1234.4,
        "vws": [{"vw": 0, "clock": 3}, {"vw": 1, "clock": 2}],
        "global_clock": 2,
    }
    failed = {"id": "digits-10", "state": "failed", "error": "worker gpu1 lost"}
    done = {"id": "old", "state": "done", "test_accuracy": 0.96125}
    info = {
        "workers": [worker("gpu0", "fast", 1.0, 64 << 20, "idle")],
        "jobs": [{"id": f"early-{i}", "state": "done"} for i in range(5)]
        + [done] * 4
        + [failed, running],
    }
    lines = [line.rstrip() for line in views.render_status(info).splitlines()]
    assert lines[2:4] == ["", "JOBS"]
    jobs = lines[4:]
    assert len(jobs) == 10
    assert jobs[0] == "  early-1              done"
    assert jobs[-4] == "  old                  done       test accuracy 0.9613"
    assert jobs[-2] == "  digits-10            failed     error: worker gpu1 lost"
    assert jobs[-1] == (
        "  digits-11            running    40/100 minibatches  loss 0.500  1234 samples/s  "
        "clocks vw0:3 vw1:2 global 2"
    )


def test_render_log_line() -> None:
    rec = {
        "timestamp": "2025-06-07T08:09:10.123456",
        "level": "warning",
        "event": "worker lost",
        "process": "ps0",
        "device": "gpu2",
        "silent_s": 5.1,
    }
    assert views.render_log_line(json.dumps(rec)) == (
        "08:09:10.123 WARNING worker lost device=gpu2 silent_s=5.1"
    )
    assert views.render_log_line(json.dumps({"event": "ready", "level": "info"})) == (
        " INFO    ready"
    )
    for raw in ("not json at all", "[1, 2]", "42", ""):
        assert views.render_log_line(raw) == raw


def test_the_profile_table_shows_the_stage_call_term() -> None:
    from hetpipe.planner import synthetic_profile

    prof = synthetic_profile(3, {"a": 1.0, "b": 0.5}, 0, call=(1e-4, 2e-4, 5e-5)).to_dict()
    last = views.render_profile(prof).splitlines()[-1].split()
    assert last == ["per", "stage", "0.300", "0.600"]  # forward + backward call, ms, per type
    old = {k: v for k, v in prof.items() if k != "calls"}  # measured before the term
    assert "per stage" not in views.render_profile(old)


def running_job(**extra: Any) -> dict[str, Any]:
    """A running job's status with two VWs and one stage's shares, as the head reports it."""
    return {
        "id": "digits-4",
        "state": "running",
        "total": 100,
        "minibatches": 50,
        "loss": 0.25,
        "samples_per_s": 2000.0,
        "global_clock": 3,
        "vws": [
            {"vw": 0, "clock": 4, "samples_per_s": 1200.0},
            {"vw": 1, "clock": 3, "samples_per_s": 800.0},
        ],
        "stages": [
            {
                "vw": 0,
                "stage": 0,
                "device": "gpu0",
                "shares": {"busy": 0.5, "bubble": 0.25, "gate": 0.125, "comm": 0.125},
            },
            {"vw": 1, "stage": 0, "device": "gpu1", "shares": {}},
        ],
        **extra,
    }


def test_live_view_has_the_bar_the_vws_the_shares_and_the_hangs() -> None:
    lines = views.live_view(running_job(diagnosis=["vw1/stage0 waits for wave 2"]))
    assert lines == [
        "[###############...............] 50/100 minibatches  loss 0.250  2000 samples/s  "
        "global clock 3  (vw0 1200/s clock 4 vw1 800/s clock 3)",
        "  vw0/stage0 gpu0     busy  50%  bubble  25%  gate  12%  comm  12%",
        "hang: vw1/stage0 waits for wave 2",
    ]


def test_live_view_of_a_job_not_started_has_an_empty_bar() -> None:
    assert views.live_view({"id": "j-1", "state": "running"}) == [
        f"[{'.' * 30}] 0/0 minibatches  loss -  0 samples/s  global clock 0"
    ]


def test_render_running_shows_each_running_job_under_its_id() -> None:
    info = {"jobs": [{"id": "old-1", "state": "done"}, running_job(), running_job(id="x-5")]}
    text = views.render_running(info)
    blocks = text.split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == ["digits-4:", "x-5:"]
    assert blocks[0].splitlines()[1:] == views.live_view(running_job())
    assert views.render_running({"jobs": [{"id": "old-1", "state": "done"}]}) == ""


def test_job_line_says_only_what_the_status_has() -> None:
    assert (
        views.job_line({"id": "a-1", "state": "queued"}).rstrip() == "a-1                  queued"
    )
    assert views.job_line(running_job(test_accuracy=0.5, error="slow")) == (
        f"{'digits-4':<20} {'running':<9}  50/100 minibatches  loss 0.250  2000 samples/s  "
        "clocks vw0:4 vw1:3 global 3  test accuracy 0.5000  error: slow"
    )


def test_brief_keeps_the_set_fields_of_a_listing() -> None:
    info = {**running_job(), "name": "digits", "error": None, "placement": [1]}
    assert views.brief(info) == {
        "id": "digits-4",
        "name": "digits",
        "state": "running",
        "total": 100,
        "minibatches": 50,
        "loss": 0.25,
        "samples_per_s": 2000.0,
    }


DONE = {
    "id": "digits-2",
    "state": "done",
    "seconds": 12.34,
    "minibatches": 100,
    "samples_per_s": 2500.4,
    "test_accuracy": 0.95,
    "model_path": "run/jobs/digits-2/model.pt",
    "metrics_path": "run/jobs/digits-2/metrics.jsonl",
    "trace_path": "run/jobs/digits-2/trace.json",
    "placement": [
        {"vw": 0, "stage": 0, "shards": [0]},
        {"vw": 0, "stage": 1, "shards": [0, 1]},
        {"vw": 0, "stage": 2, "shards": []},
    ],
    "stages": [
        {"vw": 0, "stage": 0, "device": "gpu0", "time_s": 0.002},
        {"vw": 0, "stage": 1, "device": "gpu1", "time_s": None},
        {"vw": 0, "stage": 9, "device": "gpu2", "time_s": 0.001},  # not in the prediction
    ],
    "predicted": {
        "samples_per_s": 3000.0,
        "vws": [{"stages": [{"time_s": 0.0015}, {"time_s": 0.003}]}],
    },
}


def test_render_result_of_a_finished_job() -> None:
    assert views.render_result(DONE).splitlines() == [
        "digits-2: done in 12.3 s, 100 minibatches, 2500 samples/s, test accuracy 0.9500",
        "placement: vw0/stage0->shard0, vw0/stage1->shard0+1",
        "measured vs predicted:",
        "  vw0/stage0 gpu0     compute 2.00 ms per minibatch, predicted 1.50 ms",
        "  vw0/stage1 gpu1     compute - per minibatch, predicted 3.00 ms",
        "  throughput 2500 samples/s, predicted 3000 samples/s",
        "model:   run/jobs/digits-2/model.pt",
        "metrics: run/jobs/digits-2/metrics.jsonl",
        "trace:   run/jobs/digits-2/trace.json  (open in https://ui.perfetto.dev)",
    ]


def test_render_result_of_a_failed_job_and_without_a_prediction() -> None:
    failed = {"id": "j-3", "state": "failed", "error": "worker gpu1 lost"}
    assert views.render_result(failed) == "j-3: failed: worker gpu1 lost"
    assert views.render_comparison({**DONE, "predicted": None}) == ""
    assert "measured vs predicted" not in views.render_result({**DONE, "predicted": None})


def test_final_line_is_one_json_object() -> None:
    line = views.final_line(DONE)
    assert json.loads(json.dumps(line)) == {
        "job": "digits-2",
        "status": "done",
        "test_accuracy": 0.95,
        "samples_per_s": 2500.4,
        "minibatches": 100,
        "seconds": 12.34,
        "model_path": "run/jobs/digits-2/model.pt",
        "error": None,
    }


def test_render_status_warns_of_security_off_and_lost_shards() -> None:
    info = {
        "workers": [worker("gpu0", "fast", 1.0, 64 << 20, "idle")],
        "security": {"curve": False},
        "shards_lost": [1, 2],
    }
    lines = views.render_status(info).splitlines()
    assert lines[:2] == [views.SECURITY_OFF, "LOST SHARDS: ps1, ps2"]
    assert lines[2].startswith("DEVICE")


def test_progress_off_a_tty_prints_one_line_and_the_hangs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bar = views.Progress()
    bar.tty = False
    bar.update(running_job(diagnosis=["stuck"]))
    bar.update(running_job())  # within the two seconds between lines: nothing
    bar.update({"id": "j", "state": "done", "total": 1})  # not running: nothing
    err = capsys.readouterr().err.splitlines()
    assert err == [views.live_view(running_job())[0], "hang: stuck"]
    quiet = views.Progress(enabled=False)
    quiet.update(running_job())
    assert capsys.readouterr().err == ""
