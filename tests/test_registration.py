"""Registration takes only the cluster file's devices and shards; bogus ones are refused.

A ``shard_hello`` with index -1 once replaced a real shard's address and broke every later
job that placed state there; a ``hello`` from a device the file does not name was welcomed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio
from conftest import job

from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml
from hetpipe.wire import Kind, decode, encode

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("reg")
    path = root / "cluster.toml"
    # security off: the checks of what a peer says (with Curve on, an unkeyed peer never
    # gets this far and a keyed one speaks only for itself: tests/test_security.py)
    path.write_text(cluster_toml((DeviceDef("gpu0"), DeviceDef("gpu1")), shards=2, curve=False))
    with LocalCluster(path, root / "run", timeout=60) as c:
        yield c


async def _ask(address: str, kind: Kind, fields: dict) -> str:
    """Send one message from a fresh DEALER; the kind (and text) of the answer."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        await sock.send_multipart(encode(kind, fields))
        reply = decode(await asyncio.wait_for(sock.recv_multipart(), 10))
        return f"{reply.kind}: {reply.get('message', '')}"
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("index", [-1, 0, 2, 99])
def test_shard_hello_outside_the_file_is_refused(cluster: LocalCluster, index: int) -> None:
    before = cluster.status()["shards"]
    answer = asyncio.run(
        _ask(
            cluster.head,
            Kind.SHARD_HELLO,
            {"shard": index, "address": "tcp://127.0.0.1:9", "pid": 1},
        )
    )
    assert answer.startswith(f"error: shard_hello refused: shard {index} is not a shard of")
    assert cluster.status()["shards"] == before


def test_shard_hello_with_a_malformed_address_is_refused(cluster: LocalCluster) -> None:
    answer = asyncio.run(
        _ask(cluster.head, Kind.SHARD_HELLO, {"shard": 1, "address": "not-an-address", "pid": 1})
    )
    assert answer.startswith("error: shard_hello refused: shard 1: ")


def test_hello_from_an_unknown_device_is_refused(cluster: LocalCluster) -> None:
    hello = {
        "device": "gpu99",
        "address": "tcp://127.0.0.1:9",
        "pid": 1,
        "host": "h",
        "type": "fast",
    }
    answer = asyncio.run(_ask(cluster.head, Kind.HELLO, hello))
    assert answer.startswith("error: hello refused: 'gpu99' is not a device of")
    wrong_type = {**hello, "device": "gpu1", "type": "whimpy"}
    answer = asyncio.run(_ask(cluster.head, Kind.HELLO, wrong_type))
    assert "gpu1 is of type 'fast'" in answer
    devices = {w["device"]: w["state"] for w in cluster.status()["workers"]}
    assert devices == {"gpu0": "idle", "gpu1": "idle"}  # the real gpu1 is still registered


def test_later_jobs_run_on_both_shards(cluster: LocalCluster) -> None:
    asyncio.run(
        _ask(
            cluster.head, Kind.SHARD_HELLO, {"shard": -1, "address": "tcp://127.0.0.1:9", "pid": 1}
        )
    )
    info = cluster.submit(
        job("after-bogus", split=[(["gpu0", "gpu1"], [3, 3])], minibatches=12, nm=2), timeout=120
    )
    assert info["state"] == "done", info.get("error")
    used = {s for row in info["placement"] for s in row["shards"]}
    assert used == {0, 1}
