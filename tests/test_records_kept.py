"""A job that does not finish keeps what its stages streamed: cancelled midway, its
``records/`` stay in its directory and its ``stages.json`` and trace are written from them
(real daemons); a stream being appended is read up to its last whole chunk (unit)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from conftest import UNIFORM, job

from hetpipe.jobstore import RECORDS, STAGES, TRACE, append_records, read_chunks, records_path
from hetpipe.localcluster import LocalCluster, cluster_toml


def test_a_chunk_still_being_appended_is_left_out(tmp_path: Path) -> None:
    append_records(tmp_path, 0, 1, [[1, 2]], [["f", 0, 1]])
    path = records_path(tmp_path, 0, 1)
    with path.open("a") as f:
        f.write('{"records": [[3')  # a torn last line
    assert list(read_chunks(path)) == [{"records": [[1, 2]], "spans": [["f", 0, 1]]}]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_cancelled_job_keeps_its_records_stages_and_trace(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    text = cluster_toml(UNIFORM[:2], shards=1)
    path.write_text(text.replace("[runtime]\n", "[runtime]\nrecords_every = 8\n"))
    spec = job("kept", split=[(["gpu0", "gpu1"], [3, 3])], nm=1, minibatches=200_000)

    async def go(c: LocalCluster) -> dict:
        async with c.client() as client:
            job_id = await client.submit(spec)
            d = c.run_dir / "jobs" / job_id / RECORDS
            for _ in range(600):  # until both stages have streamed a few chunks
                files = list(d.glob("*.jsonl")) if d.exists() else []
                if len(files) == 2 and all(len(f.read_text().splitlines()) >= 3 for f in files):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"no records streamed into {d}")
            await client.cancel(job_id)
            for _ in range(300):
                info = await client.job(job_id)
                if info["state"] in ("cancelled", "failed", "done"):
                    return info
                await asyncio.sleep(0.1)
            raise AssertionError(f"job {job_id} did not end after cancel: {info['state']}")

    with LocalCluster(path, tmp_path / "run", timeout=60) as c:
        info = LocalCluster.run(go(c))
    assert info["state"] == "cancelled", info
    d = Path(info["stages_path"]).parent
    streams = sorted(p.name for p in (d / RECORDS).glob("*.jsonl"))
    assert streams == ["vw0-stage0.jsonl", "vw0-stage1.jsonl"]
    stages = json.loads((d / STAGES).read_text())
    assert set(stages) == {"vw0/stage0", "vw0/stage1"}
    for where, stage in stages.items():
        v, s = (int(x[-1]) for x in where.split("/"))
        streamed = [r for c in read_chunks(records_path(d, v, s)) for r in c["records"]]
        assert len(stage["records"]) >= 8 and len(stage["records"]) <= len(streamed), where
        assert stage["records"] == streamed[: len(stage["records"])]
    trace = json.loads((d / TRACE).read_text())
    assert trace["traceEvents"]
    result = json.loads((d / "result.json").read_text())
    assert result["state"] == "cancelled" and result["records_path"] == str(d / RECORDS)
