"""A job whose records would pass ``[runtime] job_dir_max_bytes`` keeps its directory under it
(real daemons): its streams fold their older records into summary windows while it trains, and
when it ends its stages.json, trace, result and ``hetpipe status``/``trace`` still read,
saying which range is summarised, with every minibatch counted once."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from conftest import UNIFORM, job
from helpers import cli_status, hetpipe_cli, stages_json

from hetpipe.gantt import pick_window
from hetpipe.jobdir import bounded_bytes
from hetpipe.localcluster import LocalCluster, cluster_toml

SPLIT = [(["gpu0", "gpu1"], [3, 3])]
MINIBATCHES = 1500
LIMIT = 256 << 10  # job_dir_max_bytes, lowered
# past the limit at most: one chunk per stream (records_every = 8) and the job's status files
SLACK = 32 << 10


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_job_directory_stays_under_its_limit_and_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    text = cluster_toml(UNIFORM[:2], shards=1)
    path.write_text(
        text.replace("[runtime]\n", '[runtime]\nrecords_every = 8\njob_dir_max_bytes = "256KiB"\n')
    )
    sizes: list[int] = []
    stop = threading.Event()
    jobs = tmp_path / "run" / "jobs"

    def poll() -> None:
        while not stop.wait(0.05):
            for d in jobs.glob("*") if jobs.exists() else ():
                sizes.append(bounded_bytes(d))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        with LocalCluster(path, tmp_path / "run", timeout=60) as c:
            info = c.submit(job("bounded", split=SPLIT, nm=1, minibatches=MINIBATCHES))
    finally:
        stop.set()
        poller.join(timeout=10)
    assert info["state"] == "done", info.get("error")
    d = Path(info["stages_path"]).parent
    sizes.append(bounded_bytes(d))
    assert max(sizes) <= LIMIT + SLACK, max(sizes)

    # stages.json: the newest records whole, every earlier minibatch in a summary window
    stages = stages_json(info)
    assert set(stages) == {"vw0/stage0", "vw0/stage1"}
    for where, stage in stages.items():
        records = stage["records"]
        summarised = stage["records_summarised"]
        assert summarised["from"] == 0 and summarised["to"] == records[0][0] - 1, where
        assert summarised["count"] + len(records) == MINIBATCHES, where
        assert [r[0] for r in records] == list(range(records[0][0], MINIBATCHES)), where
        windows = stage["records_summary"]
        assert sum(w["count"] for w in windows) == summarised["count"], where
        assert "wave" in windows[0]["columns"], where  # named by record_fields
    loss = stages["vw0/stage1"]["records_summary"][0]["columns"]["loss"]
    assert loss["n"] > 0 and loss["min"] <= loss["p50"] <= loss["max"]
    assert info["records_summarised"] == {w: s["records_summarised"] for w, s in stages.items()}

    # the trace: a summary event per window, the newest spans whole; the Gantt still picks
    trace = json.loads(Path(info["trace_path"]).read_text())
    events = trace["traceEvents"]
    summary = [e for e in events if e.get("cat") == "summary"]
    assert summary and all(e["args"]["count"] > 0 for e in summary)
    assert any(e.get("cat") == "forward" for e in events)
    assert pick_window(trace).end > pick_window(trace).start

    # the CLI's readers: status (the result, with what is summarised) and trace
    cluster, run_dir = path, tmp_path / "run"
    status = cli_status(cluster, run_dir, info["id"])
    assert status["state"] == "done"
    assert status["records_summarised"] == info["records_summarised"]
    got = hetpipe_cli(cluster, run_dir, "status", info["id"])
    assert got.returncode == 0 and "records summarised" in got.stdout, got.stdout + got.stderr
    got = hetpipe_cli(cluster, run_dir, "trace", info["id"], "-o", str(tmp_path / "t.json"))
    assert got.returncode == 0, got.stdout + got.stderr
    assert json.loads((tmp_path / "t.json").read_text()) == trace
