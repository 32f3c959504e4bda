"""An oversize frame is dropped by ZeroMQ before it is buffered: the daemon's RSS stays put."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq
from helpers import rss_mb

from hetpipe import launch
from hetpipe.config import load_cluster
from hetpipe.localcluster import DeviceDef, cluster_toml
from hetpipe.wire import Kind, encode

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_64mib_frames_against_a_4mib_limit_cost_no_memory(tmp_path: Path) -> None:
    cpath = tmp_path / "cluster.toml"
    # security off: the frames must reach the data port (with Curve, a keyless sender is
    # refused in the handshake: tests/test_security.py)
    text = cluster_toml((DeviceDef("gpu0"),), shards=1, curve=False)
    cpath.write_text(text.replace("[runtime]\n", '[runtime]\nmax_frame_bytes = "4MiB"\n', 1))
    run_dir = tmp_path / "run"
    daemons = launch.local_daemons(load_cluster(cpath), str(cpath), run_dir=run_dir)
    worker = next(d for d in daemons if d.name == "worker-gpu0")  # no head needed to listen
    proc = launch.spawn(worker, run_dir)
    ctx = zmq.Context()
    try:
        ready = launch.wait_ready({worker.name: proc}, run_dir, 60)[worker.name]
        address = ready["address"]
        time.sleep(0.5)
        before = rss_mb(proc.pid)
        big = bytes(64 * MiB)
        for p in range(3):
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 2000)
            s.connect(address)
            s.send_multipart([*encode(Kind.ACT, {"job": "j", "vw": 0, "p": p}), big])
            s.close()  # linger: the frames leave before the socket goes
        time.sleep(1.5)
        after = rss_mb(proc.pid)
        assert after - before < 32, (before, after)  # 3 x 64 MiB had they been buffered
        assert proc.poll() is None
    finally:
        ctx.term()
        proc.terminate()
        proc.wait(timeout=20)
