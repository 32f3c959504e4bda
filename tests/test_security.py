"""Trust: CurveZMQ keys, strangers refused in the handshake, keyed peers kept to their role,
the code-loading policy, job names, bounded error replies, and a lost shard ending its job.

The attacks are the ones found on an unprotected cluster (issue 11): each is tried by a
stranger (no keys, a key of its own, another cluster's keys) and by a keyed peer outside its
role, against real daemons on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from conftest import UNIFORM, job, running_until
from helpers import worker_errors

from hetpipe import hostshm, launch, security
from hetpipe.cli import render_status
from hetpipe.client import HeadError
from hetpipe.config import ConfigError, load_cluster
from hetpipe.core.layout import StageLayout
from hetpipe.daemon import Owner
from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml
from hetpipe.ratelog import excerpt
from hetpipe.security import CodeError, Curve, check_code, ensure_keys, load_curve
from hetpipe.transport import Channel, RemoteError, make_socket
from hetpipe.wire import Kind, Message

# -- keys, policy and config (no daemons) ---------------------------------------------------


def test_keys_are_private_files_and_created_once(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    names = security.key_names(2, ["gpu0"])
    assert names == ["server", "client", "ps0", "ps1", "worker-gpu0"]
    assert ensure_keys(keys, names) == names
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    for name in names:
        for path in (keys / f"{name}.key", keys / f"{name}.key_secret"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert sorted(p.name for p in keys.iterdir()) == sorted(
        f"{n}{ext}" for n in names for ext in (".key", ".key_secret")
    )  # no temporary left
    before = (keys / "client.key").read_bytes()
    assert ensure_keys(keys, names) == []
    assert (keys / "client.key").read_bytes() == before
    assert ensure_keys(keys, ["client"], force=True) == ["client"]
    assert (keys / "client.key").read_bytes() != before


def test_missing_keys_say_how_to_make_them(tmp_path: Path) -> None:
    spec = security.SecuritySpec(keys=str(tmp_path / "none"))
    with pytest.raises(security.KeysError, match="hetpipe keys"):
        load_curve(spec, "client", serve=False)
    assert load_curve(security.SecuritySpec(curve=False), "client", serve=False) is None


@pytest.mark.parametrize(
    "model", ["subprocess:getoutput", "os:system", "evil.pkg:run", "hetpipe.modelsx:mlp"]
)
def test_code_outside_the_allow_list_is_refused(model: str) -> None:
    spec = job("j", model=model, model_args={"cmd": "true"})
    with pytest.raises(CodeError) as info:
        check_code(spec, ["hetpipe.models", "mypkg"])
    text = str(info.value)
    assert "\n" not in text
    assert f"module '{model.split(':')[0]}' is not allowed" in text
    assert "[security] allowed_modules" in text and "hetpipe.models' entry point" in text


def test_builtins_listed_modules_and_entry_points_are_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_code(job("j", model="mlp"), [])
    check_code(job("j", model="hetpipe.models:mlp"), ["hetpipe.models"])
    check_code(job("j", model="mypkg.sub.models:build"), ["mypkg"])  # a listed package

    class EP:
        value = "plugin.models:build"

    monkeypatch.setattr(
        security.metadata, "entry_points", lambda group: [EP()] if group == "hetpipe.models" else []
    )
    check_code(job("j", model="plugin.models:build"), [])
    with pytest.raises(CodeError):
        check_code(job("j", model="plugin.other:build"), [])


@pytest.mark.parametrize(
    "name",
    [
        "/tmp/x/evil",
        "../../../../tmp/y",
        "a/b",
        "a\\b",
        "..",
        "a..b",
        "x\ny",
        "x\x00y",
        ".hidden",
        "",
        "n" * 65,
    ],
)
def test_job_names_that_could_leave_the_run_dir_are_refused(name: str) -> None:
    with pytest.raises(CodeError, match="job: name: "):
        check_code(job(name), [])


def test_excerpt_bounds_echoed_input() -> None:
    assert excerpt("short") == "short"
    assert excerpt(ValueError("boom")) == "boom"  # any object, as error texts are
    long = excerpt("x" * (16 << 20))
    assert len(long) < 300 and long.endswith(f"({(16 << 20) - 200} more characters)")


def test_security_table_is_validated(tmp_path: Path) -> None:
    base = cluster_toml([DeviceDef("gpu0")], shards=1)
    path = tmp_path / "c.toml"
    path.write_text(base)
    spec = load_cluster(path).security
    assert spec.curve and Path(spec.keys) == tmp_path / ".hetpipe" / "keys"
    assert spec.allowed_modules == ()
    path.write_text(base.replace("curve = true", 'curve = "no"'))
    with pytest.raises(ConfigError, match=r"security\.curve: expected true or false"):
        load_cluster(path)
    path.write_text(base.replace("allowed_modules = []", 'allowed_modules = ["a b"]'))
    with pytest.raises(ConfigError, match=r"allowed_modules\[0\]: not a module name"):
        load_cluster(path)
    path.write_text(base.replace("[security]", '[security]\nkeys = "/k"'))
    assert load_cluster(path).security.keys == "/k"


# -- authority: who may send what (no daemons) ----------------------------------------------


def test_every_message_kind_has_one_rule() -> None:
    """The table declares every kind; the shard-0 process routes to its shard by it."""
    from hetpipe.ps import ShardServer

    assert set(security.AUTHORITY) == set(Kind)
    assert {
        Kind.PUSH,
        Kind.PULL,
        Kind.REDUCE,
        Kind.SHARD_INIT,
        Kind.SHARD_FETCH,
        Kind.SHARD_DROP,
        Kind.SHARD_CUT,
    } == ShardServer.KINDS
    to_head = security.kinds_to(security.Daemon.HEAD)
    assert {Kind.SUBMIT, Kind.HELLO, Kind.STAGE_STATE} <= to_head
    assert not to_head & ShardServer.KINDS
    # only the head assigns stages, starts, aborts and asks for profiles
    for kind in (Kind.ASSIGN, Kind.START, Kind.ABORT, Kind.MEASURE):
        assert security.AUTHORITY[kind].sender == security.Role.HEAD


STAGE = {"job": "j", "vw": 0, "stage": 1}
HOLDERS = {
    security.Role.STAGE_LEADER: {"worker-gpu1"},
    security.Role.STAGE_GROUP: {"worker-gpu1", "worker-gpu2"},
    security.Role.PREVIOUS_STAGE: {"worker-gpu0"},
}


@pytest.mark.parametrize(
    ("kind", "user", "fields", "allowed"),
    [
        (Kind.SUBMIT, "client", {}, True),
        (Kind.CANCEL, "worker-gpu0", {}, False),
        (Kind.JOB_STATUS, "ps1", {}, False),
        (Kind.HELLO, "worker-gpu0", {"device": "gpu0"}, True),
        (Kind.HELLO, "worker-gpu0", {"device": "gpu1"}, False),  # another device's name
        (Kind.HEARTBEAT, "client", {"device": "gpu0"}, False),
        (Kind.SHARD_HELLO, "ps1", {"shard": 1}, True),
        (Kind.SHARD_HELLO, "ps1", {"shard": 2}, False),
        (Kind.SHARD_HELLO, "ps1", {"shard": "1"}, False),
        (Kind.ASSIGN, "ps0", {}, True),  # the head
        (Kind.ASSIGN, "ps1", {}, False),
        (Kind.SHARD_INIT, "ps0", {}, True),
        (Kind.SHARD_DROP, "client", {}, False),
        (Kind.PUSH, "worker-gpu1", STAGE, True),
        (Kind.PUSH, "worker-gpu2", STAGE, False),  # a replica pulls, never pushes
        (Kind.REDUCE, "worker-gpu2", STAGE, False),
        (Kind.PULL, "worker-gpu2", STAGE, True),
        (Kind.PULL, "worker-gpu3", STAGE, False),
        (Kind.REPORT, "worker-gpu2", STAGE, True),
        (Kind.STAGE_FAILED, "worker-gpu3", STAGE, False),
        (Kind.ACT, "worker-gpu0", {}, True),
        (Kind.GRAD, "worker-gpu0", {}, False),  # nobody holds "next stage" here
        (Kind.REPLICA_GRAD, "worker-gpu1", {}, False),
        (Kind.OK, "worker-gpu3", {}, True),  # a reply: matched to its request by rid
        (Kind.TENSORS, "ps0", {}, False),  # a file format, never a message
        ("no such kind", "ps0", {}, False),
    ],
)
def test_who_may_send_what(kind: str, user: str, fields: dict[str, Any], allowed: bool) -> None:
    assert security.may_send(kind, user, fields, lambda role: HOLDERS.get(role, ())) is allowed
    assert security.may_send(kind, None, fields) is True  # Curve off: every peer trusted


def test_stage_roles_need_the_receivers_record() -> None:
    """Without ``holders`` nobody holds a stage role; ``ANYONE`` lets a message about a job
    the receiver does not hold reach its own lookup (which names the job)."""
    assert not security.may_send(Kind.PUSH, "worker-gpu1", STAGE)
    assert security.may_send(Kind.PUSH, "worker-gpu9", STAGE, lambda _role: security.ANYONE)
    assert not security.may_send(Kind.SUBMIT, "worker-gpu9", {}, lambda _role: security.ANYONE)


def test_a_shard_takes_pushes_from_the_stage_the_head_assigned() -> None:
    from hetpipe.ps import ShardServer

    server = ShardServer(1)
    server.owners["j"] = {"0/1": "worker-gpu1", "0/1/1": "worker-gpu2"}

    def msg(kind: Kind, user: str, **fields: Any) -> Message:
        return Message(kind, {**STAGE, **fields}, {}, user=user)

    assert server._allowed(msg(Kind.PUSH, "worker-gpu1"))
    assert not server._allowed(msg(Kind.PUSH, "worker-gpu2"))
    assert server._allowed(msg(Kind.PULL, "worker-gpu2"))
    assert not server._allowed(msg(Kind.PULL, "worker-gpu1", stage=0))
    assert server._allowed(msg(Kind.PUSH, "worker-gpu9", job="unknown"))  # the store refuses
    assert not server._allowed(msg(Kind.SHARD_FETCH, "worker-gpu1"))
    assert server._allowed(msg(Kind.SHARD_FETCH, "ps0"))


def test_the_head_takes_a_stages_reports_from_its_workers_only(tmp_path: Path) -> None:
    from hetpipe.head import Head, JobState
    from hetpipe.head.registry import WorkerInfo
    from hetpipe.job import JobSpec

    path = tmp_path / "c.toml"
    path.write_text(cluster_toml(UNIFORM[:2], shards=1))

    async def go() -> list[bool]:
        owner = Owner()
        try:
            head = Head(load_cluster(path), owner, "tcp://127.0.0.1:1", run_dir=str(tmp_path))
            spec = JobSpec.from_dict(job("j"), source="test")
            head.jobs["j-1"] = JobState(id="j-1", spec=spec, submitted=0.0)
            for d, stage in (("gpu0", 0), ("gpu1", 1)):
                w = WorkerInfo(d, d.encode(), "tcp://127.0.0.1:9", 1, "h", "fast", 0.0)
                w.job, w.vw, w.stage = "j-1", 0, stage
                head.registry.workers[d] = w
            report = {"job": "j-1", "vw": 0, "stage": 1, "stats": {}}
            return [
                head._allowed(Message(Kind.REPORT, report, {}, user="worker-gpu1")),
                head._allowed(Message(Kind.REPORT, report, {}, user="worker-gpu0")),
                head._allowed(Message(Kind.REPORT, {**report, "job": "x-1"}, {}, user="client")),
                head._allowed(Message(Kind.CANCEL, {"job": "j-1"}, {}, user="client")),
                head._allowed(Message(Kind.CANCEL, {"job": "j-1"}, {}, user="worker-gpu1")),
            ]
        finally:
            await owner.close()

    assert asyncio.run(go()) == [True, False, False, True, False]


# -- real daemons ---------------------------------------------------------------------------

SPLIT3 = [(["gpu0", "gpu1", "gpu2"], [2, 2, 2])]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four devices, two shards, Curve on; ``hetpipe.models`` is on its allow-list."""
    root = tmp_path_factory.mktemp("guarded")
    path = root / "cluster.toml"
    path.write_text(cluster_toml(UNIFORM, shards=2, allowed_modules=["hetpipe.models"]))
    c = LocalCluster(path, root / "run", timeout=60).__enter__()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def running(guarded: LocalCluster) -> Iterator[dict[str, Any]]:
    """A long job on gpu0..gpu2 (gpu3 stays idle: its key is the insider's), then cancelled."""
    c = guarded

    async def start() -> dict[str, Any]:
        async with c.client() as head:
            # far longer than every test that needs it running, on any machine
            job_id = await head.submit(job("victim", model="mlp", split=SPLIT3, nm=2, epochs=5000))
            # generous: planning and start-up on a busy host
            return await running_until(
                head, job_id, lambda i: i.get("minibatches", 0) >= 5, 180, every=0.2
            )

    info = c.run(start())
    yield info

    async def stop() -> None:
        async with c.client() as head:
            try:
                await head.cancel(info["id"])
            except HeadError as exc:  # a test may have ended it: cancel then says so
                if "has already ended" not in str(exc):
                    raise
            await head.follow(info["id"], timeout=60, every_s=0.2)

    c.run(stop())


def other_cluster_keys(root: Path) -> Path:
    keys = root / "other-keys"
    ensure_keys(keys, security.key_names(2, [d.name for d in UNIFORM]))
    return keys


def curve_of(keys: Path, name: str, *, server_from: Path | None = None) -> Curve:
    """Key ``name`` of ``keys``; the server key from ``server_from`` (the target's) if given."""
    own = load_curve(security.SecuritySpec(keys=str(keys)), name, serve=False)
    assert own is not None
    if server_from is None:
        return own
    real = load_curve(security.SecuritySpec(keys=str(server_from)), "client", serve=False)
    assert real is not None
    return Curve(name, own.public, own.secret, real.server_public)


async def ask(
    address: str,
    curve: Curve | None,
    kind: Kind,
    fields: dict[str, Any],
    tensors: dict[str, torch.Tensor] | None = None,
    *,
    timeout: float = 5.0,
) -> Message:
    """One request from a raw peer with the given keys (None: plain TCP, no keys).

    The whole exchange is bounded: a peer whose handshake is refused may never get its
    request out of the socket (no pipe to send on), which is also "no reply"."""
    return await asyncio.wait_for(
        _ask(address, curve, kind, fields, tensors, timeout), timeout + 2.0
    )


async def _ask(
    address: str,
    curve: Curve | None,
    kind: Kind,
    fields: dict[str, Any],
    tensors: dict[str, torch.Tensor] | None,
    timeout: float,
) -> Message:
    owner = Owner()
    got: asyncio.Queue[Message] = asyncio.Queue()

    async def unsolicited(_peer: bytes | None, msg: Message) -> None:
        await got.put(msg)

    try:
        sock = make_socket(owner.ctx, zmq.DEALER, connect=address, curve=curve)
        ch = owner.channel(Channel(sock, unsolicited, name="peer", max_frame_bytes=1 << 30))
        if kind not in (Kind.HELLO, Kind.SHARD_HELLO):
            return await ch.request(kind, fields, tensors, timeout=timeout, what=address)
        await ch.send(kind, fields, tensors)  # kinds without a request id
        msg = await asyncio.wait_for(got.get(), timeout)
        if msg.kind == Kind.ERROR:
            raise RemoteError(msg["message"])
        return msg
    finally:
        await owner.close()


async def push_data(
    address: str,
    curve: Curve | None,
    kind: Kind,
    fields: dict[str, Any],
    tensors: dict[str, torch.Tensor],
) -> None:
    """Send one activation or gradient to a worker's data port (PUSH: no reply)."""
    owner = Owner()
    try:
        sock = make_socket(owner.ctx, zmq.PUSH, connect=address, curve=curve, linger_ms=1000)
        ch = owner.channel(Channel(sock, None, name="peer", max_frame_bytes=1 << 30))
        # a refused handshake may leave no pipe to send on: then nothing is delivered at all
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ch.send(kind, fields, tensors), 2.0)
        await asyncio.sleep(0.5)
    finally:
        for channel in owner.channels:
            await channel.close(linger_ms=1000)
        owner.channels.clear()
        owner.ctx.term()


def z85_key(curve: Curve) -> str:
    """A key as the logs print it."""
    return zmq.utils.z85.encode(zmq.utils.z85.decode(curve.public)).decode()


def wait_log(path: Path, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        log = path.read_text(errors="replace") if path.exists() else ""
        if text in log:
            return log
        assert time.monotonic() < deadline, f"{text!r} never logged in {path}"
        time.sleep(0.1)


def shard_of(info: dict[str, Any], vw: int, stage: int) -> int:
    row = next(r for r in info["placement"] if (r["vw"], r["stage"]) == (vw, stage))
    return row["shards"][0]


def attacks(c: LocalCluster, info: dict[str, Any]) -> list[tuple[str, str, Kind, dict, dict]]:
    """(name, address, kind, fields, tensors) of every request an attacker tried."""
    status = c.status()
    shard = shard_of(info, 0, 0)
    at = status["shards"][str(shard)]
    jid = info["id"]
    big = {"0.weight": torch.full((1,), 1e6)}
    return [
        ("submit", c.head, Kind.SUBMIT, {"job": job("stranger")}, {}),
        ("cancel", c.head, Kind.CANCEL, {"job": jid}, {}),
        ("read a job", c.head, Kind.JOB_STATUS, {"job": jid}, {}),
        (
            "plan with a command",
            c.head,
            Kind.PLAN,
            {"job": job("p", model="subprocess:getoutput", model_args={"cmd": "true"})},
            {},
        ),
        (
            "hello as gpu1",
            c.head,
            Kind.HELLO,
            {"device": "gpu1", "address": "tcp://1.2.3.4:9", "pid": 1, "host": "x", "type": "fast"},
            {},
        ),
        (
            "shard_hello as shard 1",
            c.head,
            Kind.SHARD_HELLO,
            {"shard": 1, "address": "tcp://1.2.3.4:9", "pid": 1},
            {},
        ),
        ("fetch weights", at, Kind.SHARD_FETCH, {"job": jid}, {}),
        ("drop a job", at, Kind.SHARD_DROP, {"job": jid}, {}),
        ("forged push", at, Kind.PUSH, {"job": jid, "vw": 0, "stage": 0, "wave": 10**6}, big),
        ("empty push", at, Kind.PUSH, {"job": jid, "vw": 0, "stage": 0, "wave": 3}, {}),
        ("pull", at, Kind.PULL, {"job": jid, "vw": 0, "stage": 0, "need": 0, "wave": 1}, {}),
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_strangers_are_refused_before_any_message_is_read(
    guarded: LocalCluster, running: dict[str, Any], tmp_path: Path
) -> None:
    """No keys, a key of its own, another cluster's keys: no reply, no effect, one log line."""
    c = guarded
    other = other_cluster_keys(tmp_path)
    real = Path(c.cluster.security.keys)
    own = tmp_path / "own"
    ensure_keys(own, ["server", "client"])
    strangers = {
        "no keys": None,
        "its own key": curve_of(own, "client", server_from=real),
        "another cluster's keys": curve_of(other, "client"),
    }
    before = c.status()
    gpu1 = c.ready["worker-gpu1"]["address"]

    tried = attacks(c, running)

    async def unanswered(
        who: str,
        curve: Curve | None,
        what: str,
        address: str,
        kind: Kind,
        fields: dict[str, Any],
        tensors: dict[str, torch.Tensor],
    ) -> None:
        with pytest.raises(TimeoutError):
            await ask(address, curve, kind, fields, tensors, timeout=0.6)
            pytest.fail(f"{who}: {what} was answered")

    async def go() -> None:
        for who, curve in strangers.items():
            # one stranger's attacks at once, each on its own socket, as they were one after
            # another: each must wait out its 0.6 s, and 33 of them in turn took 20 s
            await asyncio.gather(*(unanswered(who, curve, *attack) for attack in tried))
            await push_data(
                gpu1,
                curve,
                Kind.ACT,
                {"job": running["id"], "vw": 0, "p": 10**6},
                {"x": torch.zeros(1), "y": torch.zeros(1)},
            )

    c.run(go())
    after = c.status()
    assert not any(j["name"] == "stranger" for j in after["jobs"])
    assert after["shards"] == before["shards"]
    workers = {w["device"]: (w["address"], w["pid"]) for w in after["workers"]}
    assert workers == {w["device"]: (w["address"], w["pid"]) for w in before["workers"]}
    state = next(j for j in after["jobs"] if j["id"] == running["id"])
    assert state["state"] == "running", state.get("error")
    # a refused key is logged once per peer, not once per reconnect (ZeroMQ retries often);
    # another cluster's keys fail earlier, in libzmq, as the server cannot open their hello
    logs = c.run_dir / "logs"
    own_key = strangers["its own key"]
    assert own_key is not None
    key = z85_key(own_key)
    for daemon in {"ps0", f"ps{shard_of(running, 0, 0)}"}:
        text = wait_log(logs / f"{daemon}.log", key)
        assert text.count(key) == 1, (daemon, text.count(key))
    assert wait_log(logs / "worker-gpu1.log", key).count(key) == 1
    for daemon in ("ps0", "worker-gpu1"):  # no keys, or another cluster's: refused in libzmq
        assert (
            wait_log(logs / f"{daemon}.log", "handshakes refused").count("handshakes refused") == 1
        )
    # nothing a stranger sent reached a handler: no "bad message", no refusal by role
    for name in ("ps0", "ps1", "worker-gpu1"):
        text = (logs / f"{name}.log").read_text()
        assert "not this peer's role" not in text and "stale data" not in text


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_keyed_peers_outside_their_role_are_refused(
    guarded: LocalCluster, running: dict[str, Any]
) -> None:
    """gpu3's worker key (an insider) and the users' key try every attack: each is refused."""
    c = guarded
    keys = Path(c.cluster.security.keys)
    insider = curve_of(keys, "worker-gpu3")
    before = c.status()
    gpu1 = c.ready["worker-gpu1"]["address"]
    jid = running["id"]

    tried = attacks(c, running)

    async def go() -> None:
        for what, address, kind, fields, tensors in tried:
            if what in ("submit", "read a job", "plan with a command"):
                continue  # a worker's key may not; the users' key may (tested below)
            with pytest.raises(RemoteError, match="worker-gpu3 may not send"):
                await ask(address, insider, kind, fields, tensors)
        for _what, address, kind, fields, tensors in tried:
            if kind in (
                Kind.PUSH,
                Kind.PULL,
                Kind.SHARD_FETCH,
                Kind.SHARD_DROP,
                Kind.HELLO,
                Kind.SHARD_HELLO,
            ):
                with pytest.raises(RemoteError, match="client may not send"):
                    await ask(address, c.curve, kind, fields, tensors)
        # a worker's key may not read, submit, or report in another stage's name
        for kind, fields in ((Kind.JOB_STATUS, {"job": jid}), (Kind.SUBMIT, {"job": job("x")})):
            with pytest.raises(RemoteError, match="may not send"):
                await ask(c.head, insider, kind, fields)
        owner = Owner()
        try:
            sock = make_socket(owner.ctx, zmq.DEALER, connect=c.head, curve=insider)
            ch = owner.channel(Channel(sock, None, name="peer", max_frame_bytes=1 << 20))
            await ch.send(Kind.STAGE_FAILED, {"job": jid, "vw": 0, "stage": 1, "error": "injected"})
            await ch.send(
                Kind.STAGE_DONE, {"job": jid, "vw": 0, "stage": 2, "stats": {}, "records": []}
            )
            await asyncio.sleep(0.5)
        finally:
            await owner.close()
        # an activation from a device that is not gpu1's predecessor: dropped, not run
        await push_data(
            gpu1,
            insider,
            Kind.ACT,
            {"job": jid, "vw": 0, "p": 10**6},
            {"x": torch.zeros(1), "y": torch.zeros(1, dtype=torch.int64)},
        )

    c.run(go())
    logs = c.run_dir / "logs"
    wait_log(logs / "worker-gpu1.log", "data refused: not from this stage's neighbour")
    time.sleep(1.0)
    after = c.status()
    state = next(j for j in after["jobs"] if j["id"] == jid)
    assert state["state"] == "running", state.get("error")
    assert not any(j["name"] == "x" for j in after["jobs"])
    assert after["shards"] == before["shards"]
    assert {w["device"]: w["address"] for w in after["workers"]} == {
        w["device"]: w["address"] for w in before["workers"]
    }
    assert "request refused: not this peer's role" in (logs / "ps0.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpu_handles_from_a_peer_that_is_no_gpu_of_this_host_are_refused(
    guarded: LocalCluster, running: dict[str, Any]
) -> None:
    """gpu1's own predecessor (gpu0's key, the one peer allowed to send it activations) sends
    an activation as a CUDA IPC handle: these devices are CPUs, so nothing is opened; the
    worker logs the refusal and the job runs on."""
    c = guarded
    gpu0 = curve_of(Path(c.cluster.security.keys), "worker-gpu0")
    shared = {
        "size": [1],
        "stride": [1],
        "offset": 0,
        "dtype": "float32",
        "device": 0,
        "handle": b"h" * 64,
        "nbytes": 4,
        "at": 0,
        "counter": b"/c",
        "counter_at": 0,
        "event": None,
        "sync": False,
    }
    c.run(
        push_data(
            c.ready["worker-gpu1"]["address"],
            gpu0,
            Kind.ACT,
            {"job": running["id"], "vw": 0, "p": 10**6, "ipc": {"x": shared}},
            {"y": torch.zeros(1, dtype=torch.int64)},
        )
    )
    wait_log(
        c.run_dir / "logs" / "worker-gpu1.log",
        "data refused: a shared GPU tensor from a peer that is not a GPU of this host",
    )
    state = next(j for j in c.status()["jobs"] if j["id"] == running["id"])
    assert state["state"] in ("running", "done"), state.get("error")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_shared_memory_name_that_reaches_outside_is_refused(
    guarded: LocalCluster, running: dict[str, Any], tmp_path: Path
) -> None:
    """gpu1's own predecessor (gpu0's key) names, as the file of an activation in shared
    memory, a path out of it, then a file of this user that is readable by others: neither
    is read, the second is left where it is, the worker logs both and the job runs on."""
    c = guarded
    gpu0 = curve_of(Path(c.cluster.security.keys), "worker-gpu0")
    public = hostshm.DIRECTORY / f"hetpipe-{os.getpid()}-0-0000abcd"
    public.write_bytes(b"\0" * 4)
    public.chmod(0o644)
    try:
        for name in ("../../etc/passwd", public.name):
            c.run(
                push_data(
                    c.ready["worker-gpu1"]["address"],
                    gpu0,
                    Kind.ACT,
                    {
                        "job": running["id"],
                        "vw": 0,
                        "p": 10**6,
                        "shm": {"x": {"file": name, "dtype": "float32", "shape": [1], "nbytes": 4}},
                    },
                    {"y": torch.zeros(1, dtype=torch.int64)},
                )
            )
        log = c.run_dir / "logs" / "worker-gpu1.log"
        wait_log(log, "is not a file name this runtime makes")
        wait_log(log, "not a private file of this user")
        assert "data refused: malformed" in log.read_text()
        assert public.exists()
    finally:
        public.unlink()
    state = next(j for j in c.status()["jobs"] if j["id"] == running["id"])
    assert state["state"] in ("running", "done"), state.get("error")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_weight_gradients_from_a_device_that_is_no_replica_of_the_stage_are_refused(
    guarded: LocalCluster, running: dict[str, Any]
) -> None:
    """gpu2 (gpu1's successor, keyed, the one peer allowed to send it gradients) sends
    weight gradients as if it were a replica of gpu1's stage: the worker refuses them (a
    stage's replicas are the only senders of ``replica_grad``), logs it, and the job runs on."""
    c = guarded
    gpu2 = curve_of(Path(c.cluster.security.keys), "worker-gpu2")
    c.run(
        push_data(
            c.ready["worker-gpu1"]["address"],
            gpu2,
            Kind.REPLICA_GRAD,
            {"job": running["id"], "vw": 0, "stage": 1, "p": 10**6, "replica": 1},
            {"2.weight": torch.full((4, 4), 1e6)},
        )
    )
    log = wait_log(c.run_dir / "logs" / "worker-gpu1.log", "worker-gpu2 sent replica_grad")
    line = next(ln for ln in log.splitlines() if "worker-gpu2 sent replica_grad" in ln)
    assert "data refused: not from this stage's neighbour" in line
    state = next(j for j in c.status()["jobs"] if j["id"] == running["id"])
    assert state["state"] in ("running", "done"), state.get("error")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_disallowed_code_and_bad_names_are_refused_at_submit(
    guarded: LocalCluster, running: dict[str, Any], tmp_path: Path
) -> None:
    c = guarded
    marker = tmp_path / "ran"
    cmd = {"cmd": f"touch {marker}"}

    async def go() -> None:
        for kind in (Kind.SUBMIT, Kind.PLAN, Kind.PROFILE):
            bad = job("rce", model="subprocess:getoutput", model_args=cmd)
            with pytest.raises(RemoteError) as info:
                await ask(c.head, c.curve, kind, {"job": bad})
            assert "module 'subprocess' is not allowed" in str(info.value)
            assert "[security] allowed_modules" in str(info.value)
        for name in ("/tmp/x/evil", "../../../../tmp/y"):
            with pytest.raises(RemoteError, match="job: name: "):
                await ask(c.head, c.curve, Kind.SUBMIT, {"job": job(name)})
        # an error reply never echoes unbounded input
        with pytest.raises(RemoteError) as info:
            await ask(c.head, c.curve, Kind.JOB_STATUS, {"job": "x" * (8 << 20)})
        assert len(str(info.value)) < 1200

    c.run(go())
    time.sleep(0.5)
    assert not marker.exists()
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_allowed_module_runs(guarded: LocalCluster, running: dict[str, Any]) -> None:
    """``hetpipe.models`` is on the test cluster's allow-list: its builder is usable by name."""

    async def cancel() -> None:
        async with guarded.client() as head:
            await head.cancel(running["id"])
            await head.follow(running["id"], timeout=60, every_s=0.2)

    guarded.run(cancel())
    info = guarded.submit(
        job("allowed", model="hetpipe.models:mlp", split=[(["gpu3"], [6])], minibatches=10),
        timeout=240,
    )
    assert info["state"] == "done", info.get("error")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_daemons_without_the_clusters_keys_cannot_join(
    guarded: LocalCluster, tmp_path: Path
) -> None:
    """An impostor worker (no keys; another cluster's keys) and shard cannot register."""
    c = guarded
    other = other_cluster_keys(tmp_path)
    base = cluster_toml(UNIFORM, shards=2)
    # "wrongkey": the cluster's server pair (stolen), but an own key the cluster never made
    wrong = tmp_path / "wrong-keys"
    ensure_keys(wrong, ["worker-gpu1"])
    real = Path(c.cluster.security.keys)
    for name in ("server.key", "server.key_secret"):
        (wrong / name).write_bytes((real / name).read_bytes())
    files = {
        "nokeys": base.replace("curve = true", "curve = false"),
        "otherkeys": base.replace("[security]", f'[security]\nkeys = "{other}"'),
        "wrongkey": base.replace("[security]", f'[security]\nkeys = "{wrong}"'),
    }
    before = c.status()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for tag, text in files.items():
            path = tmp_path / f"{tag}.toml"
            path.write_text(text)
            argv = (
                sys.executable,
                "-m",
                "hetpipe.worker",
                "--cluster",
                str(path),
                "--device",
                "gpu1",
                "--head",
                c.head,
            )
            procs.append(launch.spawn(launch.Daemon(f"imp-worker-{tag}", argv), tmp_path))
        argv = (
            sys.executable,
            "-m",
            "hetpipe.ps",
            "--cluster",
            str(tmp_path / "otherkeys.toml"),
            "--shard",
            "1",
            "--head",
            c.head,
        )
        procs.append(launch.spawn(launch.Daemon("imp-ps1", argv), tmp_path))
        names = ("imp-worker-nokeys", "imp-worker-otherkeys", "imp-worker-wrongkey", "imp-ps1")
        launch.wait_ready(dict(zip(names, procs, strict=True)), tmp_path, 60)
        time.sleep(4.5)  # workers say hello every 2 s, shards every second
        after = c.status()
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)
    assert after["shards"] == before["shards"]
    gpu1 = next(w for w in after["workers"] if w["device"] == "gpu1")
    old = next(w for w in before["workers"] if w["device"] == "gpu1")
    assert (gpu1["pid"], gpu1["address"]) == (old["pid"], old["address"])
    assert "SECURITY OFF" in (tmp_path / "logs" / "imp-worker-nokeys.log").read_text()
    for name in ("imp-worker-nokeys", "imp-worker-otherkeys", "imp-worker-wrongkey"):
        assert '"registered"' not in (tmp_path / "logs" / f"{name}.log").read_text()
    wrong_key = z85_key(curve_of(wrong, "worker-gpu1"))
    assert wait_log(c.run_dir / "logs" / "ps0.log", wrong_key).count(wrong_key) == 1


# -- liveness and the explicit off switch ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_lost_shard_ends_its_job(tmp_path: Path) -> None:
    """SIGKILL shard 1 mid-job: the job fails within lost_after_s + a few seconds."""
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml(UNIFORM[:2], shards=2))
    with LocalCluster(path, tmp_path / "run", timeout=60) as c:
        lost_after = c.cluster.runtime.lost_after_s

        async def go() -> tuple[dict[str, Any], float]:
            async with c.client() as head:
                # it stalls on its first pull from the killed shard, so it cannot end first
                job_id = await head.submit(
                    job(
                        "shardy",
                        model="mlp",
                        split=[(["gpu0", "gpu1"], [3, 3])],
                        nm=2,
                        minibatches=20_000,
                        train={"shard_wait_s": 0},  # fail at once: no wait for it
                    )
                )
                deadline = time.monotonic() + 60
                while True:
                    info = await head.job(job_id)
                    if info.get("minibatches", 0) >= 5:
                        break
                    assert time.monotonic() < deadline, info
                    await asyncio.sleep(0.2)
                assert any(1 in r["shards"] for r in info["placement"]), info["placement"]
                c.kill("ps1")
                killed = time.monotonic()
                final = await head.follow(job_id, every_s=0.2, timeout=60)
                return final, time.monotonic() - killed

        info, seconds = c.run(go())
        assert info["state"] == "failed"
        assert "shard 1" in info["error"] and "lost" in info["error"], info["error"]
        assert seconds <= lost_after + 5.0, seconds
        status = c.status()
        assert status["shards_lost"] == [1]
        assert "LOST SHARDS: ps1" in render_status(status)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_security_off_is_explicit_and_flagged(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml(UNIFORM[:1], shards=1, curve=False))
    with LocalCluster(path, tmp_path / "run", timeout=60) as c:
        assert c.curve is None
        status = c.status()
        assert status["security"] == {"curve": False}
        assert render_status(status).startswith("SECURITY OFF")
        for name in ("ps0", "worker-gpu0"):
            wait_log(c.run_dir / "logs" / f"{name}.log", "SECURITY OFF")
    assert not (tmp_path / ".hetpipe" / "keys").exists()


def test_keys_command_writes_the_clusters_keys(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hetpipe import cli

    path = tmp_path / "c.toml"
    path.write_text(cluster_toml(UNIFORM[:2], shards=2))
    result = CliRunner().invoke(cli.main, ["--cluster", str(path), "keys"])
    assert result.exit_code == 0, result.output
    assert "keys: 6 created, 0 kept" in result.output
    keys = tmp_path / ".hetpipe" / "keys"
    assert {p.stem for p in keys.glob("*.key")} == {
        "server",
        "client",
        "ps0",
        "ps1",
        "worker-gpu0",
        "worker-gpu1",
    }
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in keys.iterdir())
    again = CliRunner().invoke(cli.main, ["--cluster", str(path), "keys"])
    assert "0 created, 6 kept" in again.output


def test_cli_refuses_disallowed_code_before_contacting_the_head(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hetpipe import cli

    path = tmp_path / "c.toml"
    path.write_text(cluster_toml(UNIFORM[:1], shards=1))
    job_file = tmp_path / "job.toml"
    job_file.write_text(
        'name = "rce"\n[model]\nname = "subprocess:getoutput"\n'
        '[model.args]\ncmd = "true"\n[train]\nminibatch = 8\nminibatches = 1\n'
    )
    result = CliRunner().invoke(
        cli.main, ["--cluster", str(path), "--head", "tcp://127.0.0.1:9", "submit", str(job_file)]
    )
    assert result.exit_code == 1, result.output
    lines = [x for x in result.output.splitlines() if x]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"Error: {job_file}: model.name: module 'subprocess' is not allowed"
    ), lines[0]
    assert "[security] allowed_modules" in lines[0]
    assert os.path.exists(path)


def test_a_worker_refuses_disallowed_code_even_from_the_head(tmp_path: Path) -> None:
    """The head checks at submit; a worker checks again before it imports anything."""
    path = tmp_path / "c.toml"
    path.write_text(cluster_toml(UNIFORM[:1], shards=1))
    marker = tmp_path / "ran"
    bad = job("rce", model="subprocess:getoutput", model_args={"cmd": f"touch {marker}"})
    errors = worker_errors(path, bad, "rce-1", StageLayout(("gpu0",), 0, 1))
    assert len(errors) == 2
    assert all("module 'subprocess' is not allowed" in e for e in errors), errors
    assert not marker.exists()


def test_the_authenticator_learns_keys_added_later(tmp_path: Path) -> None:
    """A device added to the cluster gets its key with `hetpipe keys`; daemons need no restart."""
    keys = tmp_path / "keys"
    ensure_keys(keys, ["server", "client"])

    async def go() -> tuple[tuple[bool, bytes], tuple[bool, bytes], str]:
        ctx = zmq.asyncio.Context()
        auth = security.ZapAuthenticator(ctx, str(keys), "test")
        try:
            ensure_keys(keys, ["worker-gpu9"])
            new = zmq.utils.z85.decode(curve_of(keys, "worker-gpu9").public)
            before = await auth._authenticate_curve("", new)  # read a moment ago: not yet
            auth._loaded -= auth.RELOAD_EVERY_S + 1
            after = await auth._authenticate_curve("", new)
            return before, after, auth.curve_user_id(new)
        finally:
            ctx.term()

    before, after, user = asyncio.run(go())
    assert before == (False, b"Unknown key")
    assert after == (True, b"OK") and user == "worker-gpu9"
