"""The MAC data path between two "hosts" (network namespaces joined by veth links).

A data channel from host ``a`` to a data port on host ``b`` delivers its 4 MiB tensors as its
keyed sender; then a peer on ``a`` that writes to ``b``'s plain data port (a replayed copy of
a delivered message, an altered one, one under another key, an untagged one) gets nothing
through, each of its messages is counted, and the port keeps serving. Needs root and
iproute2; skipped with the reason where namespaces cannot be made.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from hetpipe import security
from hetpipe.netns import Network, unavailable

WHY = unavailable(shaping=False)
pytestmark = [
    pytest.mark.skipif(WHY is not None, reason=f"no network namespaces: {WHY}"),
    pytest.mark.timeout(180),
]
VALID = 3  # messages of the keyed channel, then the one the attacker replays
ATTACKS = 4
WAIT_S = 60.0


def receive(keys: str, host: str) -> None:
    """Host ``b``: a worker's data port (ZAP on, ``data_path = "mac"``). Prints JSON lines:
    its address, what arrived once the channel's messages are in, and what was refused."""
    import torch  # noqa: F401  (imported before timing starts: the first decode needs it)
    import zmq

    from hetpipe.daemon import Owner
    from hetpipe.security import SecuritySpec
    from hetpipe.transport import Channel, bound_address, make_socket

    async def until(cond: Any) -> None:
        for _ in range(int(WAIT_S / 0.02)):
            if cond():
                return
            await asyncio.sleep(0.02)

    async def go() -> None:
        owner = Owner()
        try:
            owner.secure(SecuritySpec(keys=keys, data_path="mac"), "worker-b", serve=True)
            got: list[tuple[int, str | None, float]] = []

            async def on(_peer: bytes | None, msg: Any) -> None:
                got.append((msg["p"], msg.user, float(msg.tensors["x"].sum())))

            sock = make_socket(
                owner.ctx,
                zmq.PULL,
                bind=f"tcp://{host}:0",
                max_frame_bytes=1 << 26,
                curve=owner.curve,
            )
            ch = owner.channel(Channel(sock, on, name="data", max_frame_bytes=1 << 26))
            print(json.dumps({"address": bound_address(sock)}), flush=True)
            await until(lambda: len(got) >= VALID + 1)
            print(json.dumps({"valid": got}), flush=True)
            await until(lambda: sum(ch.mac_refused.values()) >= ATTACKS)
            await asyncio.sleep(0.5)  # anything more would show here
            print(json.dumps({"got": got, "refused": dict(ch.mac_refused)}), flush=True)
        finally:
            await owner.close()

    asyncio.run(go())


def send(keys: str, address: str, capture: str) -> None:
    """Host ``a``: a keyed data channel sends 4 MiB tensors; the last one's bytes, as they
    went on the wire, are written to ``capture`` (what an eavesdropper sees)."""
    import torch
    import zmq

    from hetpipe.daemon import Owner
    from hetpipe.security import SecuritySpec, load_curve
    from hetpipe.transport import Channel, make_socket
    from hetpipe.wire import Kind, encode

    async def go() -> None:
        owner = Owner()
        try:
            curve = load_curve(SecuritySpec(keys=keys, data_path="mac"), "worker-a", serve=False)
            sock = make_socket(
                owner.ctx, zmq.PUSH, connect=address, curve=curve, mac_link=True, linger_ms=5000
            )
            ch = Channel(sock, None, name="to-b", max_frame_bytes=1 << 26)
            owner.channels.append(ch)
            x = torch.ones(1 << 20)
            for p in range(VALID):
                await ch.send(Kind.ACT, {"job": "j", "vw": 0, "p": p}, {"x": x})
            link = ch._link
            assert link is not None and ch._data_io is not None
            frames = encode(Kind.ACT, {"job": "j", "vw": 0, "p": 99}, {"x": x})
            wire = [link.sealer.seal(frames), *(bytes(memoryview(f).cast("B")) for f in frames)]
            await ch._data_io.send(wire)  # on the channel's own connection, as sent
            Path(capture).write_bytes(json.dumps([w.hex() for w in wire]).encode())
            await asyncio.sleep(1.0)
        finally:
            await owner.close()

    asyncio.run(go())


def attack(address: str, capture: str) -> None:
    """Host ``a``, no key: replay, alter, forge, and send untagged, on the plain data port."""
    import zmq

    from hetpipe import framemac
    from hetpipe.framemac import Sealer, parse_tag
    from hetpipe.security import data_address

    wire = [bytes.fromhex(w) for w in json.loads(Path(capture).read_text())]
    sid, direction, seq, _head, _mac = parse_tag(wire[0])
    altered = bytearray(wire[-1])
    altered[12345] ^= 1
    # the captured tag, numbered as the next message (a replayed number would be refused
    # before its MAC is even checked)
    at = framemac.SEQ_AT
    next_tag = wire[0][:at] + (seq + 1).to_bytes(8, "big") + wire[0][at + 8 :]
    forger = Sealer(sid, os.urandom(32), direction, seq)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.linger = 5000
    raw.connect(data_address(address))
    for message in (
        wire,  # replayed as seen
        [next_tag, wire[1], bytes(altered)],  # altered tensor, a fresh number
        [forger.seal(wire[1:]), *wire[1:]],  # another key, a later number
        wire[1:],  # untagged
    ):
        raw.send_multipart(message)
    raw.close()
    ctx.term()


def _line(stream: Iterable[str], key: str) -> dict:
    """The next JSON line of the receiver's output that holds ``key`` (logs go there too)."""
    for line in stream:
        if line.startswith("{") and key in (d := json.loads(line)):
            return d
    raise AssertionError(f"the receiver ended without printing {key!r}")


def test_data_between_two_hosts_is_authenticated_and_forgeries_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    security.ensure_keys(keys, security.key_names(1, ["a", "b"]))
    capture = tmp_path / "captured.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}

    def call(fn: str, *args: str) -> list[str]:
        return [sys.executable, "-c", f"import sys, {__name__} as t; t.{fn}(*sys.argv[1:])", *args]

    with Network(["a", "b"]) as net:
        rx = net.popen(
            "b", call("receive", str(keys), net.address("b")), stdout=subprocess.PIPE, text=True,
            env=env,
        )  # fmt: skip
        try:
            assert rx.stdout is not None
            address = _line(rx.stdout, "address")["address"]
            assert address.startswith(f"tcp://{net.address('b')}:")
            net.run("a", call("send", str(keys), address, str(capture)), check=True, env=env,
                    timeout=90)  # fmt: skip
            valid = _line(rx.stdout, "valid")["valid"]
            net.run("a", call("attack", address, str(capture)), check=True, env=env, timeout=60)
            out = _line(rx.stdout, "got")
        finally:
            rx.kill()
            rx.wait()
    assert [p for p, _u, _s in valid] == [*range(VALID), 99]
    assert {u for _p, u, _s in valid} == {"worker-a"}
    assert {s for _p, _u, s in valid} == {float(1 << 20)}
    assert out["got"] == valid  # nothing of the attacker's got through
    assert out["refused"] == {"replayed": 1, "forged": 2, "untagged": 1}
