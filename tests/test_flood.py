"""Garbage floods at the head and at a worker's data port while a job starts and trains.

Each flood is a separate process sending as fast as its socket takes messages. The head
must start the job within 5 s; the worker must keep its heartbeats going (the cluster
declares a worker lost after 3 s of silence) so that the job ends ``done``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import job
from helpers import rss_mb

from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml

pytestmark = pytest.mark.timeout(240)

FLOODER = """
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.PUSH if sys.argv[2] == "push" else zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.setsockopt(zmq.SNDTIMEO, 100)
s.connect(sys.argv[1])
print("flooding", flush=True)
while True:
    try:
        s.send(b"\\x93not a hetpipe message")
    except zmq.Again:
        pass
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("flood")
    path = root / "cluster.toml"
    # security off: the flooders are plain sockets that must get through (with Curve on,
    # a keyless peer is refused in the handshake: tests/test_security.py)
    path.write_text(cluster_toml((DeviceDef("gpu0"), DeviceDef("gpu1")), shards=1, curve=False))
    with LocalCluster(path, root / "run", timeout=60) as c:
        yield c


def flood(address: str, kind: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOODER, address, kind], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "flooding"
    return proc


def test_flooded_head_starts_and_flooded_worker_finishes_a_job(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    floods = [flood(cluster.head, "dealer"), flood(cluster.ready["worker-gpu1"]["address"], "push")]
    try:
        time.sleep(1.0)  # the flood is on before the job comes

        async def go() -> tuple[float, dict]:
            async with cluster.client(timeout=30) as client:
                t0 = time.monotonic()
                job_id = await client.submit(
                    job("flooded", split=[(["gpu0", "gpu1"], [3, 3])], minibatches=150, nm=2)
                )
                started = None
                while True:
                    info = await client.job(job_id)
                    if (
                        started is None
                        and info["state"] != "queued"
                        and info["state"] != "planning"
                    ):
                        started = time.monotonic() - t0
                    if info["state"] in ("done", "failed", "cancelled"):
                        return started or 0.0, info
                    assert time.monotonic() - t0 < 180, info["state"]
                    await asyncio.sleep(0.1)

        started, info = asyncio.run(go())
    finally:
        for f in floods:
            f.kill()
            f.wait(timeout=10)
    assert info["state"] == "done", info.get("error")
    assert started < 5.0, started
    assert all(cluster.alive(n) for n in cluster.procs)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_a_client_that_never_reads_its_replies_costs_the_head_little(cluster: LocalCluster) -> None:
    import zmq

    from hetpipe.wire import Kind, encode

    head_pid = cluster.procs["ps0"].pid
    before = rss_mb(head_pid)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 100)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.connect(cluster.head)
    try:
        for rid in range(20_000):
            try:
                sock.send_multipart(encode(Kind.CLUSTER_STATUS, {"rid": rid}))
            except zmq.Again:
                break
        time.sleep(1.0)
        growth = rss_mb(head_pid) - before
        assert growth < 50, growth
        assert cluster.status()["workers"]  # the head still answers everyone else
    finally:
        sock.close(linger=0)
        ctx.term()
