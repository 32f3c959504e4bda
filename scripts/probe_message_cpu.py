"""CPU per message of a stage's small messages: our Channel against raw pyzmq.

A stage whose activations and gradients go through shared memory (:mod:`hetpipe.hostshm`)
sends and receives header-only messages: the tensor's description, not its bytes. On a
host whose cores are saturated, what each such message costs in CPU is throughput lost. Two
processes play ping-pong over loopback TCP (plaintext) with that message, ``--n`` round
trips a way, in alternated turns:

- ``ours``: :func:`hetpipe.transport.make_socket` PUSH/PULL sockets and
  :class:`hetpipe.transport.Channel` (``hetpipe.wire`` encoding and schema checks, the
  reader task, sends and receives through :class:`hetpipe.sockio.SocketIO`), as a
  worker's data port runs;
- ``raw``: synchronous pyzmq PUSH/PULL and ``msgpack`` of the same fields.

Each side's process CPU (all threads) over its round trips is divided by the messages it
sent and received (two per round trip); the figure is the median over the turns of both
sides.

    python scripts/probe_message_cpu.py [--n 5000] [--turns 2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import statistics
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from hetpipe.transport import Channel, bound_address, make_socket
from hetpipe.wire import Kind

HOST = "127.0.0.1"
# an activation's header as a stage sends it when the tensor went through shared memory
FIELDS: dict[str, Any] = {
    "job": "probe",
    "vw": 0,
    "p": 0,
    "shm": {
        "x": {
            "file": "hetpipe-123-4-deadbeef",
            "dtype": "float32",
            "shape": [32, 64, 4, 4],
            "nbytes": 131072,
        }
    },
}


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _ours(mine: Any, theirs: Any, first: bool, n: int, out: Any) -> None:
    """One side of ``ours``: serve on a PULL channel, answer or start each round trip."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        got: asyncio.Queue[Any] = asyncio.Queue()

        async def on(_peer: bytes | None, msg: Any) -> None:
            got.put_nowait(msg)

        pull = make_socket(ctx, zmq.PULL, bind=f"tcp://{HOST}:0", hwm=1000)
        rx = Channel(pull, on, name="probe-rx", max_frame_bytes=1 << 20).start()
        mine.put(bound_address(pull))
        push = make_socket(ctx, zmq.PUSH, connect=theirs.get(timeout=30), hwm=1000)
        tx = Channel(push, None, name="probe-tx", max_frame_bytes=1 << 20)
        if first:
            await tx.send(Kind.ACT, FIELDS)  # both connected before the clock starts
            await asyncio.wait_for(got.get(), 30)
        else:
            await tx.send(Kind.GRAD, {**FIELDS, "p": (await asyncio.wait_for(got.get(), 30))["p"]})
        c0 = _cpu_s()
        for p in range(n):
            if first:
                await tx.send(Kind.ACT, {**FIELDS, "p": p})
                await asyncio.wait_for(got.get(), 30)
            else:
                msg = await asyncio.wait_for(got.get(), 30)
                await tx.send(Kind.GRAD, {**FIELDS, "p": msg["p"]})
        out.put(_cpu_s() - c0)
        await rx.close(linger_ms=0)
        await tx.close(linger_ms=0)
        ctx.term()

    asyncio.run(main())


def _raw(mine: Any, theirs: Any, first: bool, n: int, out: Any) -> None:
    """One side of ``raw``: the same ping-pong, synchronous pyzmq and msgpack."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.rcvtimeo = 30_000
    mine.put(f"tcp://{HOST}:{pull.bind_to_random_port(f'tcp://{HOST}')}")
    push = ctx.socket(zmq.PUSH)
    push.connect(theirs.get(timeout=30))
    rounds = range(-1, n)  # round -1: both connected before the clock starts
    c0 = 0.0
    for p in rounds:
        if p == 0:
            c0 = _cpu_s()
        if first:
            push.send(msgpack.packb({**FIELDS, "p": p}))
            msgpack.unpackb(pull.recv(copy=False).bytes)
        else:
            msg = msgpack.unpackb(pull.recv(copy=False).bytes)
            push.send(msgpack.packb({**FIELDS, "p": msg["p"]}))
    out.put(_cpu_s() - c0)
    push.close(linger=0)
    pull.close(linger=0)
    ctx.term()


def _turn(side: Any, n: int) -> list[float]:
    """Both sides of one way for ``n`` round trips: each side's CPU us per message."""
    ctx = mp.get_context("spawn")
    a, b, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=side, args=(a, b, True, n, out)),
        ctx.Process(target=side, args=(b, a, False, n, out)),
    ]
    for p in procs:
        p.start()
    try:
        cpu = [out.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=30)
            if p.exitcode != 0:
                raise RuntimeError(f"{side.__name__} side ended with exit code {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [c / (2 * n) * 1e6 for c in cpu]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000, help="round trips per turn")
    ap.add_argument("--turns", type=int, default=2, help="turns of each way, alternated")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args()
    if args.n < 1 or args.turns < 1:
        ap.error("--n and --turns must be at least 1")
    us: dict[str, list[float]] = {"ours": [], "raw": []}
    for _ in range(args.turns):
        for name, side in (("ours", _ours), ("raw", _raw)):
            us[name] += _turn(side, args.n)
    med = {k: statistics.median(v) for k, v in us.items()}
    print(
        f"CPU per message sent or received, median of {args.turns} turns x 2 sides, "
        f"{args.n} round trips each"
    )
    for k, v in med.items():
        print(f"  {k:5s} {v:6.1f} us   (all: {', '.join(f'{x:.1f}' for x in us[k])})")
    print(f"  ours / raw: {med['ours'] / med['raw']:.2f}")
    if args.json:
        print(
            json.dumps(
                {
                    "probe": "message_cpu",
                    "n": args.n,
                    "turns": args.turns,
                    "ours_us_per_message": med["ours"],
                    "raw_us_per_message": med["raw"],
                    "ours_over_raw": med["ours"] / med["raw"],
                    "runs": us,
                }
            )
        )


if __name__ == "__main__":
    main()
