"""Tensor throughput between two processes over loopback TCP: hetpipe's transport vs baselines.

For each size (float32 tensors of 64 KiB .. 64 MiB) this process streams N messages one way
to a receiver process, which answers with one small acknowledgement after the N-th; the time
from the first send to that acknowledgement gives GB/s (10^9 bytes/s of tensor payload).
Three ways, each with its own receiver process, measured in the same run:

- ``ours``: what the runtime does between stages. ``hetpipe.wire.encode`` + a
  :class:`hetpipe.transport.Channel` on a PUSH socket from ``make_socket`` (zmq.asyncio,
  ``Channel.send(Kind.ACT, ..., {"x": t})``) into a PULL ``Channel`` whose reader decodes every
  message with ``hetpipe.wire.decode`` into a torch tensor, as a worker's data port does.
- ``zmq``: raw sync pyzmq, PUSH -> PULL, ``send_multipart([header, buf], copy=False)`` of the
  same frames (encoded once) and ``recv_multipart(copy=False)``, same HWM, no decoding.
- ``gloo``: ``torch.distributed`` send/recv over gloo (``tcp://127.0.0.1``, loopback only).

The acknowledgement and the per-round arming travel on a separate ZeroMQ PAIR control socket,
so each round is: arm N (round trip, untimed), start clock, stream N, wait for "done". N is
calibrated per size and way from untimed warm-up rounds so that a round takes about
``--round-s`` seconds. Rounds of the ways are interleaved, so that load from other processes
on the host falls on all ways alike; each figure is the median of ``--repeats`` rounds. The
CPU seconds per GB of each side (all threads of the process, ZeroMQ/gloo I/O included) are
printed too: on a busy host they are steadier than GB/s. ``--diagnose`` adds two mixed ways,
our sender into the raw receiver and the raw sender into our receiver, to tell which side
costs what. ``--curve`` adds ``ours-curve``: ``ours`` with CurveZMQ as the daemons run it
(authenticated and encrypted, the receiver's ZAP handler on), to show what security costs.

    python scripts/bench_wire.py [--json] [--sizes 64KiB 4MiB ...] [--repeats N] [--diagnose]
                                 [--curve]

With ``--json`` the last line is one JSON object: per-size figures and ``ratio_vs_zmq_4mib``,
``ratio_vs_gloo_4mib``.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import time
from typing import Any

import torch
import zmq
import zmq.asyncio
from _bench import emit_json, free_port, machine, median, parser, print_table

from hetpipe.config import format_size, parse_size

DEFAULT_SIZES = ("64KiB", "256KiB", "1MiB", "4MiB", "16MiB", "64MiB")
# way -> (sender, receiver)
WAYS = {"ours": ("ours", "ours"), "zmq": ("zmq", "zmq"), "gloo": ("gloo", "gloo")}
# --diagnose: which side of ours costs the time
DIAGNOSE = {"ours-tx": ("ours", "zmq"), "ours-rx": ("zmq", "ours")}
# --curve: the runtime's path with CurveZMQ (keys made in a temporary folder, named in the env)
CURVE = {"ours-curve": ("ours-curve", "ours-curve")}
KEYS_ENV = "HETPIPE_BENCH_KEYS"
HOST = "127.0.0.1"
HWM = 64  # RuntimeSpec.hwm, what the runtime's data sockets use
MAX_MESSAGES = 50_000
MIN_MESSAGES = 6
CTL_TIMEOUT_MS = 120_000


# --------------------------------------------------------------------------- receivers


def _cpu_s() -> float:
    """CPU seconds of this process so far, every thread (ZeroMQ/gloo I/O threads included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _receiver(way: str, ctl_address: str, gloo_port: int) -> None:
    """Child process: bind (or join gloo), then serve rounds until told to stop."""
    torch.set_num_threads(1)
    if way in ("ours", "ours-curve"):
        asyncio.run(_receive_ours(ctl_address, curve=way == "ours-curve"))
    elif way == "zmq":
        _receive_zmq(ctl_address)
    else:
        _receive_gloo(ctl_address, gloo_port)


def _curve(name: str, *, serve: bool) -> Any:
    from hetpipe.security import SecuritySpec, load_curve

    return load_curve(SecuritySpec(keys=os.environ[KEYS_ENV]), name, serve=serve)


async def _receive_ours(ctl_address: str, *, curve: bool = False) -> None:
    from hetpipe.security import SecuritySpec, start_authenticator
    from hetpipe.transport import Channel, bound_address, make_socket
    from hetpipe.wire import Kind, Message

    ctx = zmq.asyncio.Context()
    auth = None
    if curve:  # as a worker's data port: Curve server, the process's ZAP handler on
        auth = start_authenticator(ctx, SecuritySpec(keys=os.environ[KEYS_ENV]), "bench-rx")
    ctl = ctx.socket(zmq.PAIR)
    ctl.setsockopt(zmq.LINGER, 0)
    ctl.connect(ctl_address)
    data = make_socket(
        ctx,
        zmq.PULL,
        bind=f"tcp://{HOST}:0",
        hwm=HWM,
        curve=_curve("worker-rx", serve=True) if curve else None,
    )
    left = 0
    nbytes = 0
    done = asyncio.Event()

    async def on_data(_peer: bytes | None, msg: Message) -> None:
        nonlocal left, nbytes
        assert msg.kind == Kind.ACT
        nbytes += msg.tensors["x"].nbytes  # a torch tensor aliasing the received frame
        left -= 1
        if left == 0:
            done.set()

    ch = Channel(data, on_data, name="bench-rx", max_frame_bytes=1 << 30).start()
    try:
        await ctl.send_json({"address": bound_address(data)})
        while True:
            cmd = await ctl.recv_json()
            if cmd["op"] == "stop":
                break
            left, nbytes = cmd["n"], 0
            done.clear()
            cpu0 = _cpu_s()
            await ctl.send_json({"armed": True})
            await done.wait()
            await ctl.send_json({"bytes": nbytes, "cpu_s": _cpu_s() - cpu0})
    finally:
        await ch.close()
        ctl.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.term()


def _receive_zmq(ctl_address: str) -> None:
    ctx = zmq.Context()
    ctl = ctx.socket(zmq.PAIR)
    ctl.setsockopt(zmq.LINGER, 0)
    ctl.connect(ctl_address)
    data = ctx.socket(zmq.PULL)
    data.setsockopt(zmq.LINGER, 0)
    data.setsockopt(zmq.RCVHWM, HWM)
    data.bind(f"tcp://{HOST}:0")
    try:
        ctl.send_json({"address": data.getsockopt_string(zmq.LAST_ENDPOINT)})
        while True:
            cmd = ctl.recv_json()
            if cmd["op"] == "stop":
                break
            cpu0 = _cpu_s()
            ctl.send_json({"armed": True})
            nbytes = 0
            for _ in range(cmd["n"]):
                frames = data.recv_multipart(copy=False)
                nbytes += len(frames[1])
            ctl.send_json({"bytes": nbytes, "cpu_s": _cpu_s() - cpu0})
    finally:
        data.close(linger=0)
        ctl.close(linger=0)
        ctx.term()


def _receive_gloo(ctl_address: str, port: int) -> None:
    import torch.distributed as dist

    ctx = zmq.Context()
    ctl = ctx.socket(zmq.PAIR)
    ctl.setsockopt(zmq.LINGER, 0)
    ctl.connect(ctl_address)
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=1, world_size=2)
    try:
        ctl.send_json({"address": None})
        while True:
            cmd = ctl.recv_json()
            if cmd["op"] == "stop":
                break
            buf = torch.empty(cmd["numel"], dtype=torch.float32)
            cpu0 = _cpu_s()
            ctl.send_json({"armed": True})
            for _ in range(cmd["n"]):
                dist.recv(buf, src=0)
            ctl.send_json({"bytes": cmd["n"] * buf.nbytes, "cpu_s": _cpu_s() - cpu0})
    finally:
        dist.destroy_process_group()
        ctl.close(linger=0)
        ctx.term()


# --------------------------------------------------------------------------- senders


class _OursSender:
    """The runtime's send path: a Channel on a PUSH socket, driven by an asyncio loop."""

    def __init__(self, address: str, *, curve: bool = False) -> None:
        self.loop = asyncio.new_event_loop()
        self.ctx = zmq.asyncio.Context()
        self.ch = self.loop.run_until_complete(self._open(address, curve))

    async def _open(self, address: str, curve: bool) -> Any:
        from hetpipe.transport import Channel, make_socket

        sock = make_socket(
            self.ctx,
            zmq.PUSH,
            connect=address,
            hwm=HWM,
            curve=_curve("worker-tx", serve=False) if curve else None,
        )
        return Channel(sock, None, name="bench-tx", max_frame_bytes=1 << 30)

    async def _stream(self, t: torch.Tensor, n: int) -> None:
        from hetpipe.wire import Kind

        send = self.ch.send
        for p in range(n):
            await send(Kind.ACT, {"job": "bench", "vw": 0, "p": p}, {"x": t})

    def send(self, t: torch.Tensor, n: int) -> None:
        self.loop.run_until_complete(self._stream(t, n))

    def close(self) -> None:
        self.loop.run_until_complete(self.ch.close())
        self.loop.close()
        self.ctx.term()


class _ZmqSender:
    """Raw sync pyzmq, zero-copy: the same frames (header and tensor bytes), encoded once."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.connect(address)

    def send(self, t: torch.Tensor, n: int) -> None:
        from hetpipe.wire import Kind, encode

        # a valid wire message, so this sender can also feed the runtime's receiver
        frames = encode(Kind.ACT, {"job": "bench", "vw": 0, "p": 0}, {"x": t})
        send = self.sock.send_multipart
        for _ in range(n):
            send(frames, copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class _GlooSender:
    def __init__(self) -> None:
        pass

    def send(self, t: torch.Tensor, n: int) -> None:
        import torch.distributed as dist

        for _ in range(n):
            dist.send(t, dst=1)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


# --------------------------------------------------------------------------- driver


class Link:
    """One way of sending: a receiver child process, its control socket, and our sender."""

    def __init__(self, way: str, tx: str, rx: str) -> None:
        self.way, self.tx, self.rx = way, tx, rx
        self.ctx = zmq.Context()
        self.ctl = self.ctx.socket(zmq.PAIR)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.ctl.setsockopt(zmq.RCVTIMEO, CTL_TIMEOUT_MS)
        self.ctl.bind(f"tcp://{HOST}:0")
        ctl_address = self.ctl.getsockopt_string(zmq.LAST_ENDPOINT)
        gloo_port = free_port(HOST) if rx == "gloo" else 0
        self.proc = mp.get_context("spawn").Process(
            target=_receiver, args=(rx, ctl_address, gloo_port), name=f"rx-{way}", daemon=True
        )
        self.proc.start()
        self.sender: Any = None
        if tx == "gloo":
            import torch.distributed as dist

            dist.init_process_group(
                "gloo", init_method=f"tcp://{HOST}:{gloo_port}", rank=0, world_size=2
            )
            self.sender = _GlooSender()
        self.address: str | None = self.ctl.recv_json()["address"]  # the receiver's data port
        if tx in ("ours", "ours-curve"):
            self.sender = _OursSender(self.address, curve=tx == "ours-curve")
        elif tx == "zmq":
            self.sender = _ZmqSender(self.address)

    def round(self, t: torch.Tensor, n: int) -> tuple[float, float, float]:
        """Stream ``n`` messages of ``t`` until the receiver acknowledges them all.

        Returns (seconds, sender CPU seconds, receiver CPU seconds).
        """
        self.ctl.send_json({"op": "round", "n": n, "numel": t.numel()})
        self.ctl.recv_json()  # armed
        cpu0 = _cpu_s()
        t0 = time.perf_counter()
        self.sender.send(t, n)
        got = self.ctl.recv_json()
        elapsed = time.perf_counter() - t0
        cpu = _cpu_s() - cpu0
        if got["bytes"] != n * t.nbytes:
            raise RuntimeError(
                f"{self.way}: receiver got {got['bytes']} bytes, sent {n * t.nbytes}"
            )
        return elapsed, cpu, got["cpu_s"]

    def close(self) -> None:
        """Stop and reap the receiver (terminate, then kill, if it does not exit)."""
        try:
            with contextlib.suppress(zmq.ZMQError):
                self.ctl.send_json({"op": "stop"}, flags=zmq.NOBLOCK)
            if self.sender is not None:
                self.sender.close()
        finally:
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
            self.ctl.close(linger=0)
            self.ctx.term()
        if self.proc.exitcode != 0:
            print(f"warning: {self.way} receiver exited with {self.proc.exitcode}", file=sys.stderr)


def measure(
    ways: dict[str, tuple[str, str]], sizes: list[int], repeats: int, round_s: float
) -> dict[str, dict[int, dict]]:
    """Every way on every size, rounds interleaved across ways so that load from other
    processes on the host disturbs all ways alike; medians of ``repeats`` rounds."""
    links: dict[str, Link] = {}
    out: dict[str, dict[int, dict]] = {w: {} for w in ways}
    try:
        for way, (tx, rx) in ways.items():
            links[way] = Link(way, tx, rx)
        for size in sizes:
            t = torch.randn(size // 4, dtype=torch.float32)
            counts = {}
            n0 = max(MIN_MESSAGES, min(2000, (64 << 20) // size))
            for way, link in links.items():
                # warm-up and calibration, untimed: the faster of two rounds, so that one
                # disturbed by another process does not shrink the timed rounds
                warm = min(link.round(t, n0)[0] for _ in range(2))
                counts[way] = max(MIN_MESSAGES, min(MAX_MESSAGES, round(round_s * n0 / warm)))
            rounds: dict[str, list[tuple[float, float, float]]] = {w: [] for w in ways}
            for _ in range(repeats):
                for way, link in links.items():
                    rounds[way].append(link.round(t, counts[way]))
            for way in ways:
                gb = counts[way] * size / 1e9
                gbps = [gb / secs for secs, _, _ in rounds[way]]
                out[way][size] = {
                    "gbps": median(gbps),
                    "runs": gbps,
                    "messages": counts[way],
                    # CPU seconds per GB moved, each side: robust to other load on the host
                    "tx_cpu_s_per_gb": median([tx / gb for _, tx, _ in rounds[way]]),
                    "rx_cpu_s_per_gb": median([rx / gb for _, _, rx in rounds[way]]),
                }
    finally:
        for link in links.values():
            link.close()
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument(
        "--sizes",
        nargs="+",
        default=list(DEFAULT_SIZES),
        help="tensor sizes, e.g. 64KiB 4MiB (default: 64KiB .. 64MiB)",
    )
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds per size (median)")
    ap.add_argument(
        "--diagnose",
        action="store_true",
        help="also time our sender alone and our receiver alone against raw zmq",
    )
    ap.add_argument("--round-s", type=float, default=0.2, help="target seconds per round")
    ap.add_argument(
        "--curve",
        action="store_true",
        help="also time the runtime's path with CurveZMQ on (ours-curve)",
    )
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes]
    for s in sizes:
        if s < 4 or s % 4:
            ap.error(f"size {s} is not a whole number of float32 values")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only, also in the child
    torch.set_num_threads(1)

    ways = dict(WAYS)
    if args.diagnose:
        ways.update(DIAGNOSE)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as keys:
        if args.curve:
            from hetpipe.security import ensure_keys

            ensure_keys(keys, ["server", "worker-rx", "worker-tx"])
            os.environ[KEYS_ENV] = keys  # the receiver processes are spawned with this env
            ways.update(CURVE)
        figures = measure(ways, sizes, args.repeats, args.round_s)
    wall = time.perf_counter() - started

    print(
        f"one-way tensor throughput over loopback TCP, 2 processes, median of {args.repeats}"
        f" interleaved rounds; GB/s = 1e9 payload bytes/s ({machine()['cores']} cores)"
    )
    extra = [w for w in ways if w not in WAYS]
    rows = []
    per_size = {}
    for s in sizes:
        ours, raw, gloo = (figures[w][s]["gbps"] for w in WAYS)
        rows.append(
            [
                format_size(s),
                ours,
                raw,
                gloo,
                ours / raw,
                ours / gloo,
                *(figures[w][s]["gbps"] for w in extra),
            ]
        )
        per_size[format_size(s)] = {
            "bytes": s,
            **{f"{w}_gbps": figures[w][s]["gbps"] for w in ways},
            **{f"{w}_runs": [round(x, 4) for x in figures[w][s]["runs"]] for w in ways},
            **{f"{w}_messages": figures[w][s]["messages"] for w in ways},
            **{f"{w}_tx_cpu_s_per_gb": figures[w][s]["tx_cpu_s_per_gb"] for w in ways},
            **{f"{w}_rx_cpu_s_per_gb": figures[w][s]["rx_cpu_s_per_gb"] for w in ways},
            "ratio_vs_zmq": ours / raw,
            "ratio_vs_gloo": ours / gloo,
        }
    print_table(
        [
            "size",
            "ours GB/s",
            "raw zmq GB/s",
            "gloo GB/s",
            "ratio vs zmq",
            "ratio vs gloo",
            *(f"{w} GB/s" for w in extra),
        ],
        rows,
    )
    if args.diagnose:
        print("ours-tx: runtime sender -> raw receiver; ours-rx: raw sender -> runtime receiver")
    if args.curve:
        print("ours-curve: the runtime's path with CurveZMQ (authenticated, encrypted)")
    print(
        "CPU seconds per GB moved (sender process | receiver process, all threads; less"
        " sensitive to other load than GB/s)"
    )
    print_table(
        ["size", *(f"{w} tx|rx" for w in ways)],
        [
            [
                format_size(s),
                *(
                    f"{figures[w][s]['tx_cpu_s_per_gb']:.2f}|{figures[w][s]['rx_cpu_s_per_gb']:.2f}"
                    for w in ways
                ),
            ]
            for s in sizes
        ],
    )
    print(f"total {wall:.1f} s")
    if args.json:
        key = format_size(4 << 20)
        out: dict[str, Any] = {
            "bench": "wire",
            "machine": machine(),
            "repeats": args.repeats,
            "sizes": per_size,
            "seconds": wall,
        }
        if key in per_size:
            out["ratio_vs_zmq_4mib"] = per_size[key]["ratio_vs_zmq"]
            out["ratio_vs_gloo_4mib"] = per_size[key]["ratio_vs_gloo"]
        emit_json(out)


if __name__ == "__main__":
    main()
