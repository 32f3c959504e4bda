"""hetpipe.sockio under Channel: waits that must wake, on real loopback sockets.

ZeroMQ's FD is edge-triggered and any send, receive or EVENTS read can consume its signal;
these tests drive the cases where a lost wake-up would hang (a send beside a waiting
receive, a send that waits for a peer or for room), each under a deadline.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq

from hetpipe.daemon import Owner
from hetpipe.localcluster import free_ports
from hetpipe.transport import Channel, bound_address, make_socket
from hetpipe.wire import Kind, Message

MAX_FRAME = 1 << 20
ANY_PORT = "tcp://127.0.0.1:0"

pytestmark = pytest.mark.timeout(60)


def run(body):  # type: ignore[no-untyped-def]
    async def go() -> None:
        owner = Owner()
        try:
            await body(owner)
        finally:
            await owner.close()

    asyncio.run(go())


def test_requests_both_ways_on_one_dealer_never_lose_a_wake_up() -> None:
    """Each side sends while its own reader waits, thousands of times: every send may take
    the FD's signal of a reply that just arrived, which must still be read."""

    async def body(owner: Owner) -> None:
        async def answer(peer: bytes | None, msg: Message) -> None:
            await server.send(Kind.OK, {"rid": msg["rid"], "info": {"p": msg["job"]}}, to=peer)

        sock = make_socket(owner.ctx, zmq.ROUTER, bind=ANY_PORT, router_mandatory=True)
        server = owner.channel(Channel(sock, answer, name="server", max_frame_bytes=MAX_FRAME))
        clients = [
            owner.channel(
                Channel(
                    make_socket(
                        owner.ctx,
                        zmq.DEALER,
                        connect=bound_address(sock),
                        identity=f"c{i}".encode(),
                    ),
                    None,
                    name=f"c{i}",
                    max_frame_bytes=MAX_FRAME,
                )
            )
            for i in range(3)
        ]

        async def ask(ch: Channel, n: int) -> list[str]:
            return [
                (await ch.request(Kind.JOB_STATUS, {"job": str(i)}, timeout=10, what="server"))[
                    "info"
                ]["p"]
                for i in range(n)
            ]

        got = await asyncio.wait_for(asyncio.gather(*(ask(c, 1500) for c in clients)), 50)
        assert got == [[str(i) for i in range(1500)]] * 3

    run(body)


def test_a_push_waits_for_its_peer_and_then_delivers() -> None:
    """A PUSH socket whose peer is not there yet queues up to its high-water mark; the
    next send waits (no busy loop, no error) and goes on once the PULL side is there."""

    async def body(owner: Owner) -> None:
        # a free port: nobody listens there yet. Not a ZeroMQ socket bound and closed: its
        # close is finished by ZeroMQ's I/O thread later, and on a busy host the PUSH below
        # could still connect to its listener and lose the first messages into it
        address = f"tcp://127.0.0.1:{free_ports(1)[0]}"
        tx = owner.channel(
            Channel(
                make_socket(owner.ctx, zmq.PUSH, connect=address, hwm=2),
                None,
                name="tx",
                max_frame_bytes=MAX_FRAME,
            )
        )

        async def send_all() -> None:
            for i in range(10):
                await tx.send(Kind.START, {"job": str(i)})

        sending = asyncio.ensure_future(send_all())
        await asyncio.sleep(0.3)
        assert not sending.done()  # waiting for room, not failed
        got: asyncio.Queue[Message] = asyncio.Queue()

        async def on(_peer: bytes | None, msg: Message) -> None:
            got.put_nowait(msg)

        owner.channel(
            Channel(
                make_socket(owner.ctx, zmq.PULL, bind=address),
                on,
                name="rx",
                max_frame_bytes=MAX_FRAME,
            )
        )
        await asyncio.wait_for(sending, 20)
        assert [(await asyncio.wait_for(got.get(), 20))["job"] for _ in range(10)] == [
            str(i) for i in range(10)
        ]

    run(body)


def test_a_full_queue_holds_the_sender_back_and_loses_nothing() -> None:
    """With high-water marks of 2 and a slow reader, sends wait for room; every message
    arrives, in order."""

    async def body(owner: Owner) -> None:
        got: list[str] = []

        async def slow(_peer: bytes | None, msg: Message) -> None:
            got.append(msg["job"])
            await asyncio.sleep(0.002)

        pull = make_socket(owner.ctx, zmq.PULL, bind=ANY_PORT, hwm=2)
        owner.channel(Channel(pull, slow, name="rx", max_frame_bytes=MAX_FRAME))
        tx = owner.channel(
            Channel(
                make_socket(owner.ctx, zmq.PUSH, connect=bound_address(pull), hwm=2),
                None,
                name="tx",
                max_frame_bytes=MAX_FRAME,
            )
        )
        blob = "x" * 200_000  # fills the TCP buffers too, so the HWM is reached
        for i in range(300):
            await asyncio.wait_for(tx.send(Kind.ABORT, {"job": str(i), "reason": blob}), 20)
        for _ in range(2000):
            if len(got) == 300:
                break
            await asyncio.sleep(0.01)
        assert got == [str(i) for i in range(300)]

    run(body)


def test_a_closed_channel_refuses_to_send_and_its_peer_keeps_what_was_sent() -> None:
    """A send after close raises pyzmq's own error for a closed socket (the shadow of a
    closed socket is never touched)."""

    async def body(owner: Owner) -> None:
        got: asyncio.Queue[Message] = asyncio.Queue()

        async def on(_peer: bytes | None, msg: Message) -> None:
            got.put_nowait(msg)

        pull = make_socket(owner.ctx, zmq.PULL, bind=ANY_PORT)
        owner.channel(Channel(pull, on, name="rx", max_frame_bytes=MAX_FRAME))
        tx = Channel(
            make_socket(owner.ctx, zmq.PUSH, connect=bound_address(pull), linger_ms=5000),
            None,
            name="tx",
            max_frame_bytes=MAX_FRAME,
        )
        await tx.send(Kind.START, {"job": "j"})
        await tx.close(linger_ms=5000)
        with pytest.raises(zmq.ZMQError):
            await tx.send(Kind.START, {"job": "k"})
        assert (await asyncio.wait_for(got.get(), 20))["job"] == "j"

    run(body)


def test_a_message_events_announced_but_receive_did_not_find_is_none_not_a_failure() -> None:
    """ZMQ_EVENTS may show POLLIN for a message a receive then does not find (dropped on
    arrival): that is "nothing waits", and a real message after it is still received."""
    from hetpipe.sockio import SocketIO

    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        io = SocketIO(pull)
        real = io.sock.recv_multipart

        def vanished(*a: object, **k: object) -> list[object]:
            raise zmq.Again()

        io.sock.recv_multipart = vanished  # type: ignore[method-assign]
        io.events = lambda: int(zmq.POLLIN)  # type: ignore[method-assign]
        assert io.recv_now() is None
        io.sock.recv_multipart = real  # type: ignore[method-assign]
        del io.events
        push.send(b"after")
        deadline = 10.0
        while (got := io.recv_now()) is None and deadline > 0:
            pull.poll(100)
            deadline -= 0.1
        assert got is not None and got[0].bytes == b"after"
    finally:
        push.close(0)
        pull.close(0)
