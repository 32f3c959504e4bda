"""Bounded logs: rotation by size, and a garbage flood that leaves a few counted lines."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from hetpipe import launch
from hetpipe.config import load_cluster
from hetpipe.localcluster import DeviceDef, cluster_toml

pytestmark = pytest.mark.timeout(90)

WRITER = """
import sys
from hetpipe import log
log.rotate_to("t", sys.argv[1], level="info", max_bytes=65536, keep=2)
for i in range(4000):
    log.get("t").warning("line", i=i, pad="x" * 100)
print("a C library or a traceback writes here too", file=sys.stderr)
"""


def test_log_file_rotates_by_size_and_keeps_a_few(tmp_path: Path) -> None:
    path = tmp_path / "d.log"
    subprocess.run([sys.executable, "-c", WRITER, str(path)], check=True, timeout=60)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["d.log", "d.log.1", "d.log.2"], files
    for p in tmp_path.iterdir():
        assert p.stat().st_size <= 65536 + 300, (p, p.stat().st_size)
    last = path.read_text().splitlines()
    assert last[-1] == "a C library or a traceback writes here too"  # fd 2 follows rotation
    assert json.loads(last[-2])["i"] == 3999


async def _flood(address: str, messages: int) -> None:
    ctx = zmq.asyncio.Context()
    socks = []
    try:
        for i in range(messages):
            if i % 500 == 0:  # fresh identities too, as a careless or hostile client makes
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(address)
                socks.append(s)
            await socks[-1].send(b"\x93garbage" + bytes(64))
        await asyncio.sleep(1.0)
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()


def test_a_garbage_flood_leaves_a_few_counted_lines(tmp_path: Path) -> None:
    cpath = tmp_path / "cluster.toml"
    text = cluster_toml((DeviceDef("gpu0"),), shards=1, curve=False)  # a keyless flooder
    cpath.write_text(
        text.replace("[runtime]\n", '[runtime]\nlog_max_bytes = "64KiB"\nlog_keep = 1\n', 1)
    )
    run_dir = tmp_path / "run"
    daemons = launch.local_daemons(load_cluster(cpath), str(cpath), run_dir=run_dir)
    daemon = next(d for d in daemons if d.name == "ps0")
    proc = launch.spawn(daemon, run_dir)
    try:
        ready = launch.wait_ready({"ps0": proc}, run_dir, 60)
        asyncio.run(_flood(ready["ps0"]["address"], 5000))
        log = run_dir / "logs" / "ps0.log"
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
        bad = [x for x in lines if x.get("event") == "bad message dropped"]
        assert 1 <= len(bad) <= 25, len(bad)  # at most one per peer, 20 per interval
        assert all(len(x["error"]) < 400 for x in bad)
        total = sum(p.stat().st_size for p in log.parent.glob("ps0.log*"))
        assert total <= 2 * 65536 + 4096, total
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=20)
