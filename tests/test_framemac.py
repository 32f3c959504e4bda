"""The MAC data path: framing (hetpipe.framemac) and tagged channels on real sockets.

A message on the plain data port is decoded only when its MAC, under the key its sender
handed over Curve, checks out and its sequence number is new: a forged MAC, an altered byte,
a replayed or reordered message, a truncated frame and a message without a tag are all
dropped and counted, and the channel keeps serving.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from helpers import collector

from hetpipe import framemac, gmac, security
from hetpipe.config import ConfigError, load_cluster
from hetpipe.daemon import Owner
from hetpipe.framemac import TO_BINDER, Inbox, MacError, Sealer
from hetpipe.localcluster import DeviceDef, cluster_toml
from hetpipe.security import SecuritySpec, data_address, load_curve
from hetpipe.transport import Channel, bound_address, make_socket
from hetpipe.wire import Kind, Message, encode

MAX_FRAME = 1 << 26
ANY_PORT = "tcp://127.0.0.1:0"
PULL_FIELDS = {"job": "j", "vw": 0, "stage": 0, "need": 0, "wave": 0}

pytestmark = pytest.mark.timeout(60)


def message(n: int = 1000) -> list[Any]:
    return encode(Kind.ACT, {"job": "j", "vw": 0, "p": 1}, {"x": torch.arange(n).float()})


def sealed(sealer: Sealer, frames: list[Any]) -> list[bytes]:
    return [sealer.seal(frames), *(bytes(memoryview(f).cast("B")) for f in frames)]


def keyed(user: str = "worker-a", alg: int | None = None) -> tuple[Inbox, Sealer]:
    inbox = Inbox()
    sid, key = framemac.new_session()
    inbox.register([sid, key], user)
    return inbox, Sealer(sid, key, TO_BINDER, alg=alg or framemac.default_alg())


ALGS = pytest.mark.parametrize("alg", [framemac.GMAC, framemac.HMAC_SHA256], ids=["gmac", "hmac"])


# -- the framing -----------------------------------------------------------------------------


@ALGS
def test_a_sealed_message_opens_as_its_sender(alg: int) -> None:
    inbox, sealer = keyed(alg=alg)
    frames = sealed(sealer, message())
    session, body = inbox.open(frames)
    assert session.user == "worker-a" and body == frames[1:]
    assert framemac.parse_tag(frames[0])[3][framemac.SEQ_AT - framemac.SALT_BYTES - 1] == alg


def test_gmac_is_the_default_where_openssl_has_it() -> None:
    assert gmac.available() and framemac.default_alg() == framemac.GMAC


def test_two_senders_of_one_session_never_share_an_iv() -> None:
    sid, key = framemac.new_session()
    a, b = Sealer(sid, key, TO_BINDER), Sealer(sid, key, framemac.TO_CONNECTOR)
    restarted = Sealer(sid, key, framemac.TO_CONNECTOR)
    assert len({a.salt, b.salt, restarted.salt}) == 3
    inbox, sealer = keyed()
    frames = sealed(sealer, message())
    salted = bytearray(frames[0])
    salted[framemac.SEQ_AT - 1] ^= 0x01  # the salt is covered by the MAC
    _refused(inbox, [bytes(salted), *frames[1:]], "forged")


def test_a_gmac_message_without_openssl_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inbox, sealer = keyed(alg=framemac.GMAC)
    frames = sealed(sealer, message())

    def missing() -> None:
        raise gmac.GmacUnavailable("no OpenSSL AES-GCM in this Python (test)")

    monkeypatch.setattr(gmac, "_lib", missing)
    assert framemac.default_alg() == framemac.HMAC_SHA256
    with pytest.raises(MacError, match=r"^unsupported: a GMAC-tagged message, and no OpenSSL"):
        inbox.open(frames)


def _refused(inbox: Inbox, frames: list[Any], reason: str) -> None:
    with pytest.raises(MacError) as info:
        inbox.open(frames)
    assert info.value.reason == reason


@ALGS
def test_an_altered_byte_anywhere_is_refused(alg: int) -> None:
    inbox, sealer = keyed(alg=alg)
    frames = sealed(sealer, message())
    for i in range(1, len(frames)):  # header and tensor frames
        bad = [*frames]
        b = bytearray(bad[i])
        b[len(b) // 2] ^= 0x01
        bad[i] = bytes(b)
        _refused(inbox, bad, "forged")
    bad_tag = bytearray(frames[0])
    bad_tag[-1] ^= 0x80  # the MAC itself
    _refused(inbox, [bytes(bad_tag), *frames[1:]], "forged")
    inbox.open(frames)  # the intact message still opens: nothing was accepted before


def test_a_mac_under_another_key_is_refused() -> None:
    inbox, sealer = keyed()
    forger = Sealer(sealer.sid, b"k" * framemac.KEY_BYTES, TO_BINDER)
    _refused(inbox, sealed(forger, message()), "forged")


def test_replayed_and_reordered_messages_are_refused() -> None:
    inbox, sealer = keyed()
    first, second = sealed(sealer, message()), sealed(sealer, message())
    inbox.open(second)
    _refused(inbox, first, "replayed")  # older than one accepted: reordered
    _refused(inbox, second, "replayed")  # the same again
    inbox.open(sealed(sealer, message()))  # the next one passes; a gap (a loss) is allowed


def test_truncated_dropped_or_moved_bytes_are_refused() -> None:
    inbox, sealer = keyed()
    frames = sealed(sealer, message())
    _refused(inbox, [*frames[:-1]], "forged")  # a frame dropped
    _refused(inbox, [*frames[:-1], frames[-1][:-4]], "forged")  # a frame cut short
    _refused(inbox, [frames[0], frames[1] + frames[2][:4], frames[2][4:]], "forged")  # moved
    _refused(inbox, [frames[0][:-1], *frames[1:]], "untagged")  # the tag cut short
    _refused(inbox, frames[1:], "untagged")  # no tag at all


def test_a_session_waits_for_its_key_and_cannot_be_taken_over() -> None:
    inbox = Inbox(max_held=2, hold_s=60)
    sid, key = framemac.new_session()
    sealer = Sealer(sid, key, TO_BINDER)
    early = sealed(sealer, message())
    _refused(inbox, early, "unknown")
    assert inbox.hold(sid, early) and inbox.hold(sid, early)
    assert not inbox.hold(sid, early) and inbox.refused["unknown"] == 1  # full: dropped
    big = Inbox(max_held_bytes=100)
    assert big.hold(sid, ["m"], 60) and not big.hold(sid, ["m"], 60)  # bounded in bytes too
    session, held = inbox.register([sid, key], "worker-a")
    assert held == [early, early]
    with pytest.raises(MacError, match="already keyed by worker-a"):
        inbox.register([sid, framemac.new_session()[1]], "worker-b")
    assert inbox.register([sid, key], "worker-a")[0] is session  # reconnect: same numbering
    with pytest.raises(MacError):
        inbox.register([sid[:3], key], "worker-a")


def test_replies_of_a_restarted_binder_are_numbered_above_its_earlier_ones() -> None:
    sid, key = framemac.new_session()
    before = Sealer(sid, key, framemac.TO_CONNECTOR, clock=True)
    first = framemac.parse_tag(before.seal([b"x"]))[2]
    for _ in range(1000):
        before.seal([b"x"])
    restarted = Sealer(sid, key, framemac.TO_CONNECTOR, clock=True)
    time.sleep(0.002)
    assert framemac.parse_tag(restarted.seal([b"x"]))[2] > before.seq > first


def test_held_messages_expire() -> None:
    inbox = Inbox(hold_s=0.0)
    sid, _key = framemac.new_session()
    inbox.hold(sid, ["m"])
    time.sleep(0.01)
    assert inbox.expire() == 1 and inbox.refused["unknown"] == 1


def test_data_path_is_read_and_checked(tmp_path: Path) -> None:
    base = cluster_toml([DeviceDef("gpu0")], shards=1)
    path = tmp_path / "c.toml"
    path.write_text(base)
    assert load_cluster(path).security.data_path == "curve"  # the default
    path.write_text(base.replace("[security]", '[security]\ndata_path = "mac"'))
    spec = load_cluster(path).security
    assert spec.data_path == "mac"
    path.write_text(base.replace("[security]", '[security]\ndata_path = "plain"'))
    with pytest.raises(ConfigError, match=r"security\.data_path.*plain"):
        load_cluster(path)


def test_data_port_is_the_curve_port_plus_the_offset() -> None:
    assert data_address("tcp://10.0.0.2:5601") == "tcp://10.0.0.2:6601"
    assert data_address("tcp://[::1]:5601") == "tcp://[::1]:6601"


# -- tagged channels on real sockets, ZAP on -------------------------------------------------


def run(keys: Path, body: Callable[[Owner, SecuritySpec], Awaitable[Any]]) -> Any:
    spec = SecuritySpec(keys=str(keys), data_path="mac")

    async def go() -> Any:
        owner = Owner()
        try:
            owner.secure(spec, "ps1", serve=True)  # the ZAP handler: user ids from keys
            return await body(owner, spec)
        finally:
            await owner.close()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mac") / "keys"
    security.ensure_keys(root, security.key_names(2, ["a", "b"]))
    return root


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_tagged_data_arrives_as_its_keyed_sender_and_forgeries_are_dropped(keys: Path) -> None:
    async def body(owner: Owner, spec: SecuritySpec) -> None:
        got, _arrived, on = collector()
        pull = make_socket(
            owner.ctx, zmq.PULL, bind=ANY_PORT, max_frame_bytes=MAX_FRAME, curve=owner.curve
        )
        rx = owner.channel(Channel(pull, on, name="data", max_frame_bytes=MAX_FRAME))
        address = bound_address(pull)
        sender = load_curve(spec, "worker-a", serve=False)
        push = make_socket(
            owner.ctx, zmq.PUSH, connect=address, curve=sender, mac_link=True, linger_ms=1000
        )
        tx = owner.channel(Channel(push, None, name="to", max_frame_bytes=MAX_FRAME))
        big = torch.randn(1 << 20)  # 4 MiB: MAC'd on a thread
        for i in range(3):
            await tx.send(Kind.ACT, {"job": "j", "vw": 0, "p": i}, {"x": big})
        await until(lambda: len(got) == 3)
        assert [m["p"] for m in got] == [0, 1, 2]
        assert {m.user for m in got} == {"worker-a"}
        assert torch.equal(got[0].tensors["x"], big)

        # a peer on the plain port: it can read the traffic but not forge, alter or replay it
        raw = owner.ctx.socket(zmq.PUSH)
        raw.linger = 0
        raw.connect(data_address(address))
        try:
            link = tx._link
            assert link is not None
            frames = message()
            tag = link.sealer.seal(frames)  # a valid message, kept to replay it
            await tx.send_frames(frames)  # ... sent for real first
            await until(lambda: len(got) == 4)
            bad = bytearray(memoryview(frames[-1]).cast("B"))
            bad[7] ^= 0xFF
            attempts = [
                [tag, *frames],  # replayed
                [link.sealer.seal(frames), *frames[:-1], bytes(bad)],  # altered
                [
                    Sealer(link.sealer.sid, b"x" * 32, 0, seq=1 << 40).seal(frames),
                    *frames,
                ],  # forged
                [link.sealer.seal(frames), *frames[:-1], bytes(bad[:-9])],  # truncated
                list(frames),  # untagged
                [*framemac.key_frames(*framemac.new_session())],  # a key, but not over Curve
            ]
            for a in attempts:
                await raw.send_multipart(a)
            await until(lambda: sum(rx.mac_refused.values()) >= len(attempts))
            assert rx.mac_refused["replayed"] == 1 and rx.mac_refused["forged"] == 3
            assert rx.mac_refused["untagged"] == 2
            await tx.send(Kind.ACT, {"job": "j", "vw": 0, "p": 9}, {"x": big})  # still serving
            await until(lambda: len(got) == 5)
            assert got[-1]["p"] == 9 and len(got) == 5
        finally:
            raw.close()

    run(keys, body)


def test_requests_and_tagged_replies_on_a_router(keys: Path) -> None:
    async def body(owner: Owner, spec: SecuritySpec) -> None:
        sock = make_socket(
            owner.ctx,
            zmq.ROUTER,
            bind=ANY_PORT,
            router_mandatory=True,
            max_frame_bytes=MAX_FRAME,
            curve=owner.curve,
        )
        seen: list[str | None] = []

        async def serve(peer: bytes | None, msg: Message) -> None:
            seen.append(msg.user)
            x = msg.tensors["x"]
            fields = {"rid": msg["rid"], "clock": 1, "vw_clock": 1, "applied": []}
            await server.send(Kind.PULLED, fields, {"x": x * 2}, to=peer)

        server = owner.channel(Channel(sock, serve, name="shard", max_frame_bytes=MAX_FRAME))
        worker = load_curve(spec, "worker-b", serve=False)
        dealer = make_socket(
            owner.ctx, zmq.DEALER, connect=bound_address(sock), curve=worker, mac_link=True
        )
        ch = owner.channel(Channel(dealer, None, name="shard1", max_frame_bytes=MAX_FRAME))
        x = torch.randn(1 << 19)
        for _ in range(3):
            reply = await ch.request(Kind.PULL, PULL_FIELDS, {"x": x}, timeout=10, what="shard 1")
            assert torch.equal(reply.tensors["x"], x * 2)
        assert seen == ["worker-b"] * 3
        assert sum(server.mac_refused.values()) == 0 and sum(ch.mac_refused.values()) == 0

    run(keys, body)


def test_a_fixed_port_whose_data_port_is_taken_fails_naming_it(keys: Path) -> None:
    async def body(owner: Owner, _spec: SecuritySpec) -> None:
        blocker = owner.ctx.socket(zmq.PULL)
        blocker.linger = 0
        blocker.bind(ANY_PORT)
        taken = int(bound_address(blocker).rpartition(":")[2])
        port = taken - security.DATA_PORT_OFFSET
        if port < 1024:
            pytest.skip("ephemeral port too low for this check")
        with pytest.raises(zmq.ZMQError, match=r"data port \(port \+ 1000"):
            make_socket(owner.ctx, zmq.PULL, bind=f"tcp://127.0.0.1:{port}", curve=owner.curve)
        blocker.close()

    run(keys, body)
