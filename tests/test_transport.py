"""hetpipe.transport on real sockets: loopback TCP, port 0, every socket closed.

Each test is a sync function that runs its coroutine with ``asyncio.run`` (no asyncio
plugin needed); an :class:`~hetpipe.daemon.Owner` holds the context and channels so that a
failing assertion still closes everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
import zmq
import zmq.asyncio
from helpers import collector

from hetpipe.daemon import Owner
from hetpipe.localcluster import free_ports
from hetpipe.security import Curve
from hetpipe.transport import Channel, RemoteError, bound_address, make_socket
from hetpipe.wire import Kind, Message, decode, encode

MAX_FRAME = 1 << 20
ANY_PORT = "tcp://127.0.0.1:0"

pytestmark = pytest.mark.timeout(30)


def run(body: Callable[[Owner], Awaitable[Any]]) -> Any:
    """Run ``body(owner)`` in a fresh event loop; the owner is closed whatever happens."""

    async def go() -> Any:
        owner = Owner()
        try:
            return await body(owner)
        finally:
            await owner.close()

    return asyncio.run(go())


class Server:
    """A ROUTER channel whose handler is replaceable per test; it records what arrives."""

    def __init__(self, owner: Owner, *, mandatory: bool = True) -> None:
        sock = make_socket(owner.ctx, zmq.ROUTER, bind=ANY_PORT, router_mandatory=mandatory)
        self.address = bound_address(sock)
        self.received: list[tuple[bytes | None, Message]] = []
        self.arrived = asyncio.Event()
        self.on: Callable[[bytes | None, Message], Awaitable[None]] | None = None
        self.ch = owner.channel(
            Channel(sock, self._handle, name="server", max_frame_bytes=MAX_FRAME)
        )

    async def _handle(self, peer: bytes | None, msg: Message) -> None:
        self.received.append((peer, msg))
        self.arrived.set()
        if self.on is not None:
            await self.on(peer, msg)

    async def wait_for(self, n: int) -> None:
        while len(self.received) < n:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 5)


def client(owner: Owner, address: str, identity: bytes = b"client") -> Channel:
    sock = make_socket(owner.ctx, zmq.DEALER, connect=address, identity=identity)
    return owner.channel(Channel(sock, None, name="client", max_frame_bytes=MAX_FRAME))


async def echo(server: Server, peer: bytes | None, msg: Message) -> None:
    """Answer a job_status request with ok, naming the job it asked about."""
    await server.ch.send(Kind.OK, {"rid": msg["rid"], "info": {"job": msg["job"]}}, to=peer)


# -- make_socket ----------------------------------------------------------------------------


def test_make_socket_sets_linger_and_hwm_before_bind() -> None:
    async def body(owner: Owner) -> None:
        sock = make_socket(owner.ctx, zmq.DEALER, bind=ANY_PORT, identity=b"me", hwm=7)
        try:
            assert sock.getsockopt(zmq.LINGER) == 0
            assert sock.getsockopt(zmq.SNDHWM) == 7
            assert sock.getsockopt(zmq.RCVHWM) == 7
            assert sock.getsockopt(zmq.IDENTITY) == b"me"
            address = bound_address(sock)
            assert address.startswith("tcp://127.0.0.1:")
            assert int(address.rsplit(":", 1)[1]) > 0  # port 0 resolved to the port it got
        finally:
            sock.close(linger=0)
        custom = make_socket(owner.ctx, zmq.PUSH, connect="tcp://127.0.0.1:9", linger_ms=250)
        try:
            assert custom.getsockopt(zmq.LINGER) == 250
            assert custom.getsockopt(zmq.SNDHWM) == 64  # the default bound
        finally:
            custom.close(linger=0)

    run(body)


def test_make_socket_closes_the_socket_when_bind_fails() -> None:
    async def body(owner: Owner) -> None:
        first = make_socket(owner.ctx, zmq.ROUTER, bind=ANY_PORT)
        try:
            with pytest.raises(zmq.ZMQError):
                make_socket(owner.ctx, zmq.ROUTER, bind=bound_address(first))
        finally:
            first.close(linger=0)
        # owner.close() terminates the context: it would hang on a socket left open

    run(body)


# -- request / reply ------------------------------------------------------------------------


def test_concurrent_requests_answered_in_reverse_order_resolve_by_rid() -> None:
    async def body(owner: Owner) -> None:
        server = Server(owner)
        cl = client(owner, server.address)
        fa = await cl.send_request(Kind.JOB_STATUS, {"job": "a"}, what="server")
        fb = await cl.send_request(Kind.JOB_STATUS, {"job": "b"}, what="server")
        await server.wait_for(2)
        (pa, ma), (pb, mb) = server.received
        assert pa == pb == b"client"
        assert [ma["job"], mb["job"]] == ["a", "b"]
        assert ma["rid"] != mb["rid"]
        await echo(server, pb, mb)  # b first
        await echo(server, pa, ma)
        ra, rb = await asyncio.wait_for(asyncio.gather(fa, fb), 5)
        assert ra.kind == rb.kind == Kind.OK
        assert (ra["info"]["job"], ra["rid"]) == ("a", ma["rid"])
        assert (rb["info"]["job"], rb["rid"]) == ("b", mb["rid"])

    run(body)


def test_request_returns_the_reply_and_carries_tensors() -> None:
    torch = pytest.importorskip("torch")

    async def body(owner: Owner) -> None:
        server = Server(owner)

        async def answer(peer: bytes | None, msg: Message) -> None:
            doubled = {k: v * 2 for k, v in msg.tensors.items()}
            await server.ch.send(Kind.OK, {"rid": msg["rid"]}, doubled, to=peer)

        server.on = answer
        cl = client(owner, server.address)
        big = torch.arange(40_000, dtype=torch.float32)  # over the zero-copy threshold
        reply = await cl.request(
            Kind.PUSH,
            {"job": "j", "vw": 0, "stage": 0, "wave": 0},
            {"w": big, "b": torch.ones(3)},
            timeout=5,
            what="server",
        )
        assert torch.equal(reply.tensors["w"], big * 2)
        assert torch.equal(reply.tensors["b"], torch.full((3,), 2.0))

    run(body)


def test_error_reply_raises_remote_error_with_the_peers_text() -> None:
    async def body(owner: Owner) -> None:
        server = Server(owner)

        async def refuse(peer: bytes | None, msg: Message) -> None:
            await server.ch.reply_error(peer, "no job 'x'", msg["rid"])

        server.on = refuse
        cl = client(owner, server.address)
        with pytest.raises(RemoteError) as info:
            await cl.request(Kind.JOB_STATUS, {"job": "x"}, timeout=5, what="the head at test")
        assert str(info.value) == "the head at test: no job 'x'"

    run(body)


def test_unanswered_request_times_out_naming_the_peer() -> None:
    async def body(owner: Owner) -> None:
        server = Server(owner)  # records, never answers
        cl = client(owner, server.address)
        start = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            await cl.request(Kind.CLUSTER_STATUS, timeout=0.3, what="shard 7 at somewhere")
        elapsed = time.monotonic() - start
        assert 0.25 <= elapsed < 2.0, elapsed
        assert "shard 7 at somewhere" in str(info.value)
        assert "0.3 s" in str(info.value)
        await server.wait_for(1)  # it did arrive; nobody answered

    run(body)


def test_request_to_nobody_times_out() -> None:
    """A DEALER connected to a port where nothing listens queues the request and times out."""

    async def body(owner: Owner) -> None:
        # a port nobody listens on: a plain socket's (a ZeroMQ listener's close finishes on
        # its I/O thread later, and a busy host's connect could still reach it)
        cl = client(owner, f"tcp://127.0.0.1:{free_ports(1)[0]}")
        with pytest.raises(TimeoutError, match="nobody"):
            await cl.request(Kind.CLUSTER_STATUS, timeout=0.3, what="nobody")

    run(body)


# -- robustness of the reader ---------------------------------------------------------------


def test_router_answers_garbage_with_bad_message_and_keeps_serving() -> None:
    async def body(owner: Owner) -> None:
        server = Server(owner)
        server.on = lambda peer, msg: echo(server, peer, msg)
        raw = make_socket(owner.ctx, zmq.DEALER, connect=server.address, identity=b"raw")
        try:
            await raw.send_multipart([b"\x00\x01garbage"])
            frames = await asyncio.wait_for(raw.recv_multipart(), 5)
            reply = decode(frames)
            assert reply.kind == Kind.ERROR
            assert reply["message"].startswith("bad message: ")
            assert reply.get("rid") is None
            await raw.send_multipart(encode(Kind.JOB_STATUS, {"rid": 5, "job": "next"}))
            reply = decode(await asyncio.wait_for(raw.recv_multipart(), 5))
            assert reply.kind == Kind.OK
            assert (reply["rid"], reply["info"]) == (5, {"job": "next"})
            assert [m["job"] for _, m in server.received] == ["next"]  # garbage never reached it
        finally:
            raw.close(linger=0)

    run(body)


def test_handler_that_raises_gets_an_error_reply_and_the_reader_survives() -> None:
    async def body(owner: Owner) -> None:
        server = Server(owner)

        async def flaky(peer: bytes | None, msg: Message) -> None:
            if msg["job"] == "bad":
                raise ValueError("boom")
            await echo(server, peer, msg)

        server.on = flaky
        cl = client(owner, server.address)
        with pytest.raises(RemoteError) as info:
            await cl.request(Kind.JOB_STATUS, {"job": "bad"}, timeout=5, what="server")
        assert "boom" in str(info.value)
        assert str(info.value).startswith("server: job_status failed")
        reply = await cl.request(Kind.JOB_STATUS, {"job": "good"}, timeout=5, what="server")
        assert reply["info"] == {"job": "good"}

    run(body)


def test_reply_with_an_unknown_rid_goes_to_the_handler() -> None:
    """Only a reply kind whose rid is pending resolves a future; anything else is a message."""

    async def body(owner: Owner) -> None:
        server = Server(owner)
        got, arrived, on_client = collector()

        sock = make_socket(owner.ctx, zmq.DEALER, connect=server.address, identity=b"c2")
        cl = owner.channel(Channel(sock, on_client, name="c2", max_frame_bytes=MAX_FRAME))
        await cl.send(Kind.HEARTBEAT, {"device": "gpu0", "state": "idle"})
        await server.wait_for(1)
        await server.ch.send(Kind.OK, {"rid": 999}, to=b"c2")
        await asyncio.wait_for(arrived.wait(), 5)
        assert got[0].kind == Kind.OK and got[0]["rid"] == 999

    run(body)


# -- delivery failures and closing ----------------------------------------------------------


def test_send_to_an_unknown_router_identity_raises_connection_error() -> None:
    async def body(owner: Owner) -> None:
        server = Server(owner, mandatory=True)
        with pytest.raises(ConnectionError, match="nobody"):
            await server.ch.send(Kind.OK, {"rid": 1}, to=b"nobody")
        with pytest.raises(ValueError, match="peer identity"):
            await server.ch.send(Kind.OK, {"rid": 1})
        # the channel still works for a peer that is there
        cl = client(owner, server.address)
        server.on = lambda peer, msg: echo(server, peer, msg)
        reply = await cl.request(Kind.JOB_STATUS, {"job": "j"}, timeout=5, what="server")
        assert reply["info"] == {"job": "j"}

    run(body)


def test_closing_a_channel_fails_its_pending_requests() -> None:
    async def body(owner: Owner) -> None:
        server = Server(owner)  # never answers
        cl = client(owner, server.address)
        fut = await cl.send_request(Kind.CLUSTER_STATUS, what="server")
        await server.wait_for(1)
        await cl.close()
        assert fut.done()
        with pytest.raises(ConnectionError, match="channel closed"):
            fut.result()
        assert cl.closed and cl.sock.closed

    run(body)


def test_make_socket_sets_maxmsgsize_from_max_frame_bytes() -> None:
    async def body(owner: Owner) -> None:
        sock = make_socket(owner.ctx, zmq.PULL, bind=ANY_PORT, max_frame_bytes=MAX_FRAME)
        assert sock.getsockopt(zmq.MAXMSGSIZE) == MAX_FRAME
        sock.close(linger=0)
        plain = make_socket(owner.ctx, zmq.PULL, bind=ANY_PORT)
        assert plain.getsockopt(zmq.MAXMSGSIZE) == -1  # unlimited unless asked
        plain.close(linger=0)

    run(body)


def test_oversize_frame_is_dropped_by_zeromq_before_the_reader_sees_it() -> None:
    """The sender of a frame over MAXMSGSIZE is cut off; the receiver goes on serving."""

    async def body(owner: Owner) -> None:
        got, arrived, on = collector()

        sock = make_socket(owner.ctx, zmq.PULL, bind=ANY_PORT, max_frame_bytes=MAX_FRAME)
        address = bound_address(sock)
        owner.channel(Channel(sock, on, name="data", max_frame_bytes=MAX_FRAME))
        big = make_socket(owner.ctx, zmq.PUSH, connect=address)
        await big.send_multipart(
            [*encode(Kind.ACT, {"job": "j", "vw": 0, "p": 0}), bytes(8 * MAX_FRAME)]
        )
        small = make_socket(owner.ctx, zmq.PUSH, connect=address)
        await small.send_multipart(encode(Kind.ACT, {"job": "j", "vw": 0, "p": 1}))
        await asyncio.wait_for(arrived.wait(), 10)
        await asyncio.sleep(0.2)  # the big one, had it been let through, would be here too
        assert [m["p"] for m in got] == [1]
        big.close(linger=0)
        small.close(linger=0)

    run(body)


def test_a_frame_of_exactly_max_frame_bytes_passes_under_curve() -> None:
    """MAXMSGSIZE leaves room for Curve's framing: the wire allows a frame of the limit."""
    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    served = Curve("ps1", server_pub, server_sec, server_pub, server_sec)
    sender = Curve("worker-a", client_pub, client_sec, server_pub)

    async def body(owner: Owner) -> None:
        got, arrived, on = collector()

        sock = make_socket(
            owner.ctx, zmq.PULL, bind=ANY_PORT, max_frame_bytes=MAX_FRAME, curve=served
        )
        owner.channel(Channel(sock, on, name="data", max_frame_bytes=MAX_FRAME))
        push = make_socket(
            owner.ctx,
            zmq.PUSH,
            connect=bound_address(sock),
            curve=sender,
            max_frame_bytes=MAX_FRAME,
        )
        frames = encode(
            Kind.ACT, {"job": "j", "vw": 0, "p": 0}, {"x": torch.zeros(MAX_FRAME // 4)}
        )  # one frame of exactly the limit
        assert max(len(memoryview(f)) for f in frames) == MAX_FRAME
        await push.send_multipart(frames)
        await asyncio.wait_for(arrived.wait(), 10)
        assert [m["p"] for m in got] == [0] and got[0].tensors["x"].numel() == MAX_FRAME // 4
        push.close(linger=0)

    run(body)


def test_router_send_to_a_peer_that_never_reads_fails_instead_of_blocking() -> None:
    """Replies to a client that never reads are dropped once its queue is full."""

    async def body(owner: Owner) -> None:
        sock = make_socket(owner.ctx, zmq.ROUTER, bind=ANY_PORT, hwm=2, router_mandatory=True)
        server = owner.channel(Channel(sock, None, name="server", max_frame_bytes=MAX_FRAME))
        lazy = make_socket(
            owner.ctx, zmq.DEALER, connect=bound_address(sock), identity=b"lazy", hwm=2
        )
        await lazy.send_multipart(encode(Kind.CLUSTER_STATUS, {"rid": 1}))
        await asyncio.sleep(0.3)  # the router learns the identity on the first message
        payload = {"rid": 1, "info": {"blob": "x" * 65536}}
        with pytest.raises(ConnectionError, match="does not read"):
            for _ in range(20_000):  # far beyond the HWMs and the loopback TCP buffers
                await asyncio.wait_for(server.send(Kind.OK, payload, to=b"lazy"), 5)
        lazy.close(linger=0)

    run(body)


def test_a_flood_of_garbage_neither_starves_the_loop_nor_well_formed_peers() -> None:
    """While a reader drains 20,000 garbage messages, a ticker (a heartbeat) keeps ticking
    and a well-formed message from another peer gets through quickly."""
    import threading

    async def body(owner: Owner) -> None:
        got: list[float] = []
        sock = make_socket(owner.ctx, zmq.PULL, bind=ANY_PORT, hwm=64)
        address = bound_address(sock)

        async def on(_peer: bytes | None, msg: Message) -> None:
            got.append(time.monotonic())

        owner.channel(Channel(sock, on, name="data", max_frame_bytes=MAX_FRAME))
        stop = threading.Event()

        def flood() -> None:
            ctx = zmq.Context()
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, 50)
            s.connect(address)
            try:
                while not stop.is_set():
                    with contextlib.suppress(zmq.Again):
                        s.send(b"\x93garbage")
            finally:
                s.close(linger=0)
                ctx.term()

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        ticks = 0
        try:
            await asyncio.sleep(0.3)  # the flood is on
            good = make_socket(owner.ctx, zmq.PUSH, connect=address)
            sent_at = time.monotonic()
            await good.send_multipart(encode(Kind.ACT, {"job": "j", "vw": 0, "p": 1}))
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                await asyncio.sleep(0.01)
                ticks += 1
            good.close(linger=0)
        finally:
            stop.set()
            flooder.join(timeout=5)
        assert ticks >= 40, ticks  # ~100 without any flood; a starved loop gets 0-1
        assert got and got[0] - sent_at < 1.0, got

    run(body)
