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

**Cross-host** (after the loopback figures, unless ``--no-cross-host``): two network
namespaces joined by veth pairs and a bridge (:class:`hetpipe.netns.Network`), the sender in
one, the receivers in the other, 4 MiB tensors (``--cross-sizes``) over that link, rounds
interleaved as above: ``zmq`` (plain ZeroMQ), ``ours`` (the runtime without security),
``ours-curve`` (``[security] data_path = "curve"``: every byte encrypted) and ``ours-mac``
(``data_path = "mac"``: plain TCP, every message MAC-tagged under a key handed over Curve,
checked before decoding; :mod:`hetpipe.framemac`). Where namespaces cannot be made (not
root, no ``ip``) the case is skipped with the reason.

    python scripts/bench_wire.py [--json] [--sizes 64KiB 4MiB ...] [--repeats N] [--diagnose]
                                 [--curve] [--no-cross-host] [--cross-sizes 4MiB ...]

With ``--json`` the last line is one JSON object: per-size figures and ``ratio_vs_zmq_4mib``,
``ratio_vs_gloo_4mib``; the cross-host case under ``cross_host`` and, at 4 MiB,
``ratio_authenticated_vs_plain_4mib`` (ours-mac against plain ZeroMQ on the same link;
target >= 0.8), ``ratio_mac_vs_ours_plain_4mib`` and ``ratio_curve_vs_plain_4mib``.
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
# cross-host: plain ZeroMQ, the runtime plain, with Curve, with the MAC data path
CROSS = {
    "zmq": ("zmq", "zmq"),
    "ours": ("ours", "ours"),
    "ours-curve": ("ours-curve", "ours-curve"),
    "ours-mac": ("ours-mac", "ours-mac"),
}
CROSS_TARGET = 0.8  # ratio_authenticated_vs_plain_4mib
CLONE_NEWNET = 0x40000000
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


def enter_netns(path: str | int) -> None:
    """Move the calling thread (and the threads it starts later: ZeroMQ's I/O threads) into
    the network namespace at ``path`` (or an open descriptor of one)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY) if isinstance(path, str) else path
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        if isinstance(path, str):
            os.close(fd)


def _receiver(
    way: str, ctl_address: str, gloo_port: int, host: str = HOST, netns: str | None = None
) -> None:
    """Child process: bind (or join gloo), then serve rounds until told to stop."""
    if netns is not None:  # before any socket or thread
        enter_netns(netns)
    torch.set_num_threads(1)
    if way.startswith("ours"):
        asyncio.run(_receive_ours(ctl_address, way, host))
    elif way == "zmq":
        _receive_zmq(ctl_address, host)
    else:
        _receive_gloo(ctl_address, gloo_port)


def _curve(name: str, *, serve: bool, data_path: str = "curve") -> Any:
    from hetpipe.security import SecuritySpec, load_curve

    spec = SecuritySpec(keys=os.environ[KEYS_ENV], data_path=data_path)
    return load_curve(spec, name, serve=serve)


def _security(way: str) -> str | None:
    """The data path of a way of ours: None (no security), ``curve`` or ``mac``."""
    return {"ours-curve": "curve", "ours-mac": "mac"}.get(way)


async def _receive_ours(ctl_address: str, way: str, host: str = HOST) -> None:
    from hetpipe.security import SecuritySpec, start_authenticator
    from hetpipe.transport import Channel, bound_address, make_socket
    from hetpipe.wire import Kind, Message

    ctx = zmq.asyncio.Context()
    auth = None
    data_path = _security(way)
    if data_path:  # as a worker's data port: Curve server, the process's ZAP handler on
        auth = start_authenticator(ctx, SecuritySpec(keys=os.environ[KEYS_ENV]), "bench-rx")
    ctl = ctx.socket(zmq.PAIR)
    ctl.setsockopt(zmq.LINGER, 0)
    ctl.connect(ctl_address)
    data = make_socket(
        ctx,
        zmq.PULL,
        bind=f"tcp://{host}:0",
        hwm=HWM,
        max_frame_bytes=1 << 30,
        curve=_curve("worker-rx", serve=True, data_path=data_path) if data_path else None,
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
            refused = sum(ch.mac_refused.values())
            await ctl.send_json({"bytes": nbytes, "cpu_s": _cpu_s() - cpu0, "refused": refused})
    finally:
        await ch.close()
        ctl.close(linger=0)
        if auth is not None:
            auth.stop()
        ctx.term()


def _receive_zmq(ctl_address: str, host: str = HOST) -> None:
    ctx = zmq.Context()
    ctl = ctx.socket(zmq.PAIR)
    ctl.setsockopt(zmq.LINGER, 0)
    ctl.connect(ctl_address)
    data = ctx.socket(zmq.PULL)
    data.setsockopt(zmq.LINGER, 0)
    data.setsockopt(zmq.RCVHWM, HWM)
    data.bind(f"tcp://{host}:0")
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

    def __init__(self, address: str, *, data_path: str | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.ctx = zmq.asyncio.Context()
        self.ch = self.loop.run_until_complete(self._open(address, data_path))

    async def _open(self, address: str, data_path: str | None) -> Any:
        from hetpipe.transport import Channel, make_socket

        # as a worker's data channel (hetpipe.daemon.Owner.connect): a MAC link where asked
        sock = make_socket(
            self.ctx,
            zmq.PUSH,
            connect=address,
            hwm=HWM,
            curve=_curve("worker-tx", serve=False, data_path=data_path) if data_path else None,
            mac_link=True,
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

    def __init__(
        self,
        way: str,
        tx: str,
        rx: str,
        *,
        host: str = HOST,
        ctl_host: str = HOST,
        netns: str | None = None,
    ) -> None:
        """``host``: where the receiver binds; ``ctl_host``: where this process binds the
        control socket; ``netns``: the receiver's network namespace (cross-host)."""
        self.way, self.tx, self.rx = way, tx, rx
        self.refused = 0  # messages the receiver's MAC check dropped (must stay 0)
        self.ctx = zmq.Context()
        self.ctl = self.ctx.socket(zmq.PAIR)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.ctl.setsockopt(zmq.RCVTIMEO, CTL_TIMEOUT_MS)
        self.ctl.bind(f"tcp://{ctl_host}:0")
        ctl_address = self.ctl.getsockopt_string(zmq.LAST_ENDPOINT)
        gloo_port = free_port(HOST) if rx == "gloo" else 0
        self.proc = mp.get_context("spawn").Process(
            target=_receiver,
            args=(rx, ctl_address, gloo_port, host, netns),
            name=f"rx-{way}",
            daemon=True,
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
        if tx.startswith("ours"):
            self.sender = _OursSender(self.address, data_path=_security(tx))
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
        self.refused += got.get("refused", 0)
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
    ways: dict[str, tuple[str, str]],
    sizes: list[int],
    repeats: int,
    round_s: float,
    **where: Any,
) -> dict[str, dict[int, dict]]:
    """Every way on every size, rounds interleaved across ways so that load from other
    processes on the host disturbs all ways alike; medians of ``repeats`` rounds.
    ``where``: :class:`Link`'s placement (host, ctl_host, netns) for every way."""
    links: dict[str, Link] = {}
    out: dict[str, dict[int, dict]] = {w: {} for w in ways}
    try:
        for way, (tx, rx) in ways.items():
            links[way] = Link(way, tx, rx, **where)
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
                    "refused": links[way].refused,
                }
    finally:
        for link in links.values():
            link.close()
    return out


def cross_host(sizes: list[int], repeats: int, round_s: float) -> dict[str, Any]:
    """The cross-host case: sender in namespace ``a``, receivers in ``b``, over the veth
    link between them; the figures of :func:`measure` by way and size, or the reason it
    could not run. Keys must be in ``$HETPIPE_BENCH_KEYS``."""
    from hetpipe import netns

    why = netns.unavailable(shaping=False)
    if why is not None:
        return {"skipped": why}
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        with netns.Network(["a", "b"]) as net:
            # this process (the senders, and the ZeroMQ threads they start) moves to host a
            enter_netns(f"/run/netns/{net.namespace('a')}")
            try:
                figures = measure(
                    CROSS,
                    sizes,
                    repeats,
                    round_s,
                    host=net.address("b"),
                    ctl_host=net.address("a"),
                    netns=f"/run/netns/{net.namespace('b')}",
                )
            finally:
                enter_netns(home)  # back, so that the network can be taken down
    finally:
        os.close(home)
    return {"figures": figures, "link": "veth pair + bridge between two namespaces"}


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
    ap.add_argument(
        "--no-cross-host",
        action="store_true",
        help="skip the cross-host case (two network namespaces)",
    )
    ap.add_argument(
        "--cross-sizes",
        nargs="+",
        default=["4MiB"],
        help="tensor sizes of the cross-host case (default: 4MiB)",
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
    cross_sizes = [parse_size(s) for s in args.cross_sizes]
    with tempfile.TemporaryDirectory() as keys:
        from hetpipe.security import ensure_keys

        ensure_keys(keys, ["server", "worker-rx", "worker-tx"])
        os.environ[KEYS_ENV] = keys  # the receiver processes are spawned with this env
        if args.curve:
            ways.update(CURVE)
        figures = measure(ways, sizes, args.repeats, args.round_s)
        cross: dict[str, Any] = (
            {"skipped": "--no-cross-host"}
            if args.no_cross_host
            else cross_host(cross_sizes, args.repeats, args.round_s)
        )
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
    cross_json = _report_cross(cross, cross_sizes)
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
        out.update(cross_json)
        emit_json(out)


def _report_cross(cross: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    """Print the cross-host table; its JSON keys (the 4 MiB ratios at the top level)."""
    if "skipped" in cross:
        print(f"cross-host case skipped: {cross['skipped']}")
        return {"cross_host": cross}
    figures = cross["figures"]
    print(
        "\ncross-host: one-way tensor throughput between two network namespaces (veth +"
        " bridge), sender in one, receiver in the other; GB/s (CPU s/GB tx|rx)"
    )
    rows, per_size = [], {}
    for s in sizes:
        f = {w: figures[w][s] for w in CROSS}
        plain, ours, curve, mac = (f[w]["gbps"] for w in CROSS)
        rows.append(
            [
                format_size(s),
                *(
                    f"{f[w]['gbps']:.3f} ({f[w]['tx_cpu_s_per_gb']:.2f}|"
                    f"{f[w]['rx_cpu_s_per_gb']:.2f})"
                    for w in CROSS
                ),
                mac / plain,
                curve / plain,
            ]
        )
        per_size[format_size(s)] = {
            "bytes": s,
            **{f"{w}_gbps": f[w]["gbps"] for w in CROSS},
            **{f"{w}_runs": [round(x, 4) for x in f[w]["runs"]] for w in CROSS},
            **{f"{w}_tx_cpu_s_per_gb": f[w]["tx_cpu_s_per_gb"] for w in CROSS},
            **{f"{w}_rx_cpu_s_per_gb": f[w]["rx_cpu_s_per_gb"] for w in CROSS},
            "mac_refused": f["ours-mac"]["refused"],
            "ratio_mac_vs_plain": mac / plain,
            "ratio_mac_vs_ours_plain": mac / ours,
            "ratio_curve_vs_plain": curve / plain,
        }
    print_table(["size", *(f"{w}" for w in CROSS), "mac / plain", "curve / plain"], rows)
    out: dict[str, Any] = {"cross_host": {"link": cross["link"], "sizes": per_size}}
    key = format_size(4 << 20)
    if key in per_size:
        ratio = per_size[key]["ratio_mac_vs_plain"]
        out["ratio_authenticated_vs_plain_4mib"] = ratio
        out["ratio_mac_vs_ours_plain_4mib"] = per_size[key]["ratio_mac_vs_ours_plain"]
        out["ratio_curve_vs_plain_4mib"] = per_size[key]["ratio_curve_vs_plain"]
        out["target_authenticated_vs_plain_4mib"] = CROSS_TARGET
        print(
            f"ratio_authenticated_vs_plain_4mib = {ratio:.3f} (target >= {CROSS_TARGET}: "
            f"{'met' if ratio >= CROSS_TARGET else 'MISSED'})"
        )
    return out


if __name__ == "__main__":
    main()
