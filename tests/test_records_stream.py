"""A stage's per-minibatch records and spans stream to the head while it trains, in chunks of
``[runtime] records_every``: several chunks per stage reach the job's directory before the
end, no chunk grows with the job, and the finished job's stages.json and trace hold what a
run with one large chunk holds (real daemons); the streaming writers equal the in-memory
ones (unit)."""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import UNIFORM, job
from helpers import stage_records, stages_json

from hetpipe.jobstore import RECORDS, append_records, records_path, write_stages
from hetpipe.localcluster import LocalCluster, cluster_toml
from hetpipe.trace import chrome_trace, write_chrome_trace

SPLIT = [(["gpu0", "gpu1"], [3, 3])]
MINIBATCHES = 48
SMALL = 4  # records a chunk
# deterministic fields of a record (one virtual worker, Nm = 1: the same run every time)
SAME = ("p", "wave", "clock", "vw_clock", "fwd_version", "bwd_version", "fwd_fingerprint")


def _run(root: Path, records_every: int, watch: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the job on a fresh two-device cluster; return its result and, with ``watch``,
    what the stages' streams held while it ran: the most chunks seen and the longest."""
    root.mkdir(parents=True)
    path = root / "cluster.toml"
    text = cluster_toml(UNIFORM[:2], shards=1)
    path.write_text(text.replace("[runtime]\n", f"[runtime]\nrecords_every = {records_every}\n"))
    seen: dict[str, int] = {}
    longest = [0]
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.02):
            for f in root.rglob(f"{RECORDS}/*.jsonl"):
                try:
                    lines = f.read_text().splitlines()
                except OSError:
                    continue
                seen[f.name] = max(seen.get(f.name, 0), len(lines))
                longest[0] = max([longest[0], *(len(x.encode()) for x in lines)])

    poller = threading.Thread(target=poll, daemon=True)
    c = LocalCluster(path, root / "run", timeout=60).__enter__()
    try:
        if watch:
            poller.start()
        info = c.submit(
            job("streamed", split=SPLIT, nm=1, minibatches=MINIBATCHES, train={"verify": True})
        )
    finally:
        stop.set()
        c.stop()
    if watch:
        poller.join()
    return info, {"chunks": seen, "longest": longest[0]}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_records_stream_in_small_chunks(tmp_path) -> None:
    whole, _ = _run(tmp_path / "whole", 16384, watch=False)
    assert whole["state"] == "done", whole.get("error")
    info, seen = _run(tmp_path / "small", SMALL, watch=True)
    assert info["state"] == "done", info.get("error")

    # several chunks of each stage reached the job's directory before the end
    assert set(seen["chunks"]) == {"vw0-stage0.jsonl", "vw0-stage1.jsonl"}, seen
    assert all(n >= 2 for n in seen["chunks"].values()), seen
    # no chunk holds more than a few records' worth (4 records and their spans)
    assert 0 < seen["longest"] < 16 << 10, seen
    # the streams were folded into stages.json and the trace, then dropped
    d = Path(info["stages_path"]).parent
    assert not (d / RECORDS).exists()

    got, want = stage_records(info), stage_records(whole)
    assert set(got) == set(want) == {"vw0/stage0", "vw0/stage1"}
    for where in got:
        assert [r["p"] for r in got[where]] == list(range(MINIBATCHES)), where
        assert [[r[k] for k in SAME] for r in got[where]] == [
            [r[k] for k in SAME] for r in want[where]
        ], where
        assert all(r["t_bwd"] >= r["t_fwd"] > 0 for r in got[where]), where
    assert all(r["loss"] is not None for r in got["vw0/stage1"])
    # spans: one forward and one backward of every minibatch on every stage, in both runs
    for result in (info, whole):
        for where, report in stages_json(result).items():
            spans = report["stats"]["spans"]
            for kind in ("forward", "backward"):
                ps = sorted(s[3] for s in spans if s[0] == kind and s[3] is not None)
                assert ps == list(range(MINIBATCHES)), (where, kind)
            assert report["stats"]["record_fields"][0] == "p"
            assert "replicas" in report
    trace = json.loads(Path(info["trace_path"]).read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {f"forward {p}" for p in range(MINIBATCHES)} <= names


def test_streamed_stages_json_and_trace_equal_in_memory(tmp_path) -> None:
    """write_stages and write_chrome_trace, fed chunk by chunk from the streams, write the
    documents the in-memory report and chrome_trace make."""
    fields = ["p", "t_fwd"]
    reports = {}
    for v, s in ((0, 0), (0, 1), (1, 0)):
        rows = [[p, 10.0 + p + s] for p in range(7)]
        spans = [["forward", 10.0 + p + s, 10.5 + p + s, p, p // 2] for p in range(7)]
        spans.append(["push", 20.0, 20.5, None, 3])
        for i in range(0, 7, 3):  # chunks of 3 records, spans in the first of each pair
            append_records(tmp_path, v, s, rows[i : i + 3], spans[2 * i : 2 * i + 6])
        where = f"vw{v}/stage{s}"
        reports[where] = {
            "stats": {"done": 7, "record_fields": fields, "spans": spans},
            "records": rows,
            "replicas": [1],
        }
    streams = {w: records_path(tmp_path, int(w[2]), int(w[-1])) for w in reports}
    write_stages(
        tmp_path,
        {
            w: ({"stats": {"done": 7, "record_fields": fields}, "replicas": [1]}, streams[w])
            for w in reports
        },
    )
    assert json.loads((tmp_path / "stages.json").read_text()) == reports
    devices = {w: f"gpu{i}" for i, w in enumerate(reports)}
    want = chrome_trace({w: r["stats"] for w, r in reports.items()}, devices, "j-1")

    def spans_of(p: Path) -> Any:
        return lambda: (s for line in p.read_text().splitlines() for s in json.loads(line)["spans"])

    write_chrome_trace(
        tmp_path / "trace.json", {w: spans_of(p) for w, p in streams.items()}, devices, "j-1"
    )
    assert json.loads((tmp_path / "trace.json").read_text()) == want


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_records_and_metrics_stay_under_their_budgets(tmp_path) -> None:
    """A job whose records would pass ``records_max_bytes`` thins its streams (halved, then
    every 2nd chunk kept, ...) and still ends with its stages.json: records from the first
    minibatch to near the last."""
    minibatches = 600
    path = tmp_path / "cluster.toml"
    budget = 64 << 10
    text = cluster_toml(UNIFORM[:2], shards=1).replace(
        "[runtime]\n",
        '[runtime]\nrecords_every = 2\nrecords_max_bytes = "64KiB"\nmetrics_max_bytes = "64KiB"\n',
    )
    path.write_text(text)
    sizes: list[int] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.02):
            try:
                files = list((tmp_path / "run").rglob(f"{RECORDS}/*.jsonl"))
            except OSError:  # a directory vanished under the walk (a checkpoint's temporary)
                continue  # sample again at the next tick
            for f in files:
                try:
                    sizes.append(f.stat().st_size)
                except OSError:
                    continue

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    with LocalCluster(path, tmp_path / "run", timeout=60) as c:
        info = c.submit(job("budget", split=SPLIT, nm=1, minibatches=minibatches))
    stop.set()
    poller.join()
    assert info["state"] == "done", info.get("error")
    assert sizes and max(sizes) <= budget + (16 << 10), max(sizes)  # + at most one chunk
    reports = stages_json(info)
    for where, records in stage_records(info).items():
        ps = [r["p"] for r in records]
        # thinned: fewer records than minibatches, in order, from the start to near the end
        assert 0 < len(ps) < minibatches, where
        assert ps == sorted(ps) and ps[0] < 16 and ps[-1] >= minibatches - 16, (where, str(ps))
        assert max(b - a for a, b in itertools.pairwise(ps)) <= minibatches // 8, str(ps)
        assert reports[where]["records_every"] >= 2, where
    assert Path(info["metrics_path"]).stat().st_size <= budget
