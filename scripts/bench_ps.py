"""Parameter-server throughput: 4 virtual workers push and pull a model through 1, 2, 4 shards.

A model of ``--mb`` MB (25 float32 weights of 1..7 MB, each with a 4 KiB bias) is spread
over the shards, balanced by bytes. Four client processes, one per virtual worker (VW), each
run ``--waves`` WSP waves: push its update of the wave (every tensor, to the shard holding
it), pull for the next wave (``need = wave - D``; D = ``--staleness``, default 0, so the VWs
advance together: the pull of wave c+1 waits until every VW has pushed wave c-1), then wait
for every answer. Throughput = payload bytes (pushed + pulled, all VWs) / wall time from the
common start to the last VW's end; GB/s = 1e9 bytes/s.

- ``ours``: real ``hetpipe-ps`` daemons (``python -m hetpipe.ps``; shard 0 is the head, the
  others get ``--head``) on a generated cluster file; ``shard_init`` is sent by this script
  with one member per VW (its stage 0 holds every tensor); the VWs talk through
  :class:`hetpipe.transport.Channel` DEALERs (``push``/``pull``, every reply decoded).
- ``zmq``: the best a ZeroMQ parameter server could do here: as many sync pyzmq ROUTER
  server processes, which answer a push (the same frames) with a small ack and a pull with
  frames of the same sizes from a fixed buffer (``copy=False``, no tensor decoding, no
  arithmetic), and the same 4 VW processes on sync DEALERs.

Both ways run interleaved (one run of each in turn) so that load on the host disturbs them
alike; each figure is the median of ``--repeats`` runs after an untimed warm-up. After each
run against ``hetpipe-ps`` the global weights are fetched and checked (waves x the sum of the
VWs' updates, exactly), so a lost or doubled push fails the benchmark.

``--diagnose`` adds the mixed ways, to tell which side costs: ``ours-client`` (our VWs against
the raw servers) and ``ours-server`` (raw sync VWs against ``hetpipe-ps``); ``--breakdown``
times the shard's per-push work in this process (decode, ``w + d``, ``add_``, a copy).

    python scripts/bench_ps.py [--json] [--mb 100] [--waves 4] [--shards 1 2 4] [--diagnose]

With ``--json`` the last line is one JSON object: per shard count ``ours_gbps``,
``zmq_gbps``, ``ratio``; ``ratio_vs_zmq`` = ours at its best shard count / raw zmq at that
same shard count (``ratio_basis`` says so), and ``ratio_vs_best_zmq`` against the best raw.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import torch
import zmq
from _bench import emit_json, machine, median, parser, print_table

HOST = "127.0.0.1"
VWS = 4
WAIT_S = 300.0  # the longest any single wait of this script may take
BIAS_BYTES = 4096
PATTERN = (1, 2, 4, 6, 7)  # MB of the weights at --mb 100, cycled over 25 tensors
WAYS = {"ours": ("ours", "ps"), "zmq": ("zmq", "raw")}  # way -> (VW client, server)
DIAGNOSE = {"ours-client": ("ours", "raw"), "ours-server": ("zmq", "ps")}

Spec = list[tuple[str, int]]  # (name, numel) of every float32 tensor


# --------------------------------------------------------------------------- the model


def model_spec(mb: float) -> Spec:
    """25 weights of assorted sizes (mean 4 MB at --mb 100) and 25 small biases."""
    out = []
    for i in range(25):
        numel = max(1, int(PATTERN[i % len(PATTERN)] * 1_000_000 * mb / 100.0) // 4)
        out += [(f"{i}.weight", numel), (f"{i}.bias", BIAS_BYTES // 4)]
    return out


def place(spec: Spec, shards: int) -> dict[str, int]:
    """Each tensor on the shard holding the fewest bytes so far, largest tensors first."""
    load = [0] * shards
    out = {}
    for name, numel in sorted(spec, key=lambda x: (-x[1], x[0])):
        pick = min(range(shards), key=lambda i: (load[i], i))
        load[pick] += numel * 4
        out[name] = pick
    return out


def delta_value(vw: int) -> float:
    """Every element of VW ``vw``'s update of a wave; a power of two, so sums are exact."""
    return (vw + 1) * 2.0**-10


# --------------------------------------------------------------------------- servers


class PsShards:
    """``n`` real hetpipe-ps daemons on ephemeral ports; always reaped."""

    def __init__(self, n: int, root: Path) -> None:
        from hetpipe.localcluster import DeviceDef, cluster_toml

        self.root = root / f"ps{n}"
        self.root.mkdir(parents=True, exist_ok=True)
        self.path = self.root / "cluster.toml"
        self.path.write_text(
            # security off: the benchmark's own plain sockets drive the shards directly
            cluster_toml(
                [DeviceDef("gpu0")], shards=n, heartbeat_s=1.0, lost_after_s=60.0, curve=False
            )
        )
        self.n = n
        self.procs: list[subprocess.Popen[bytes]] = []
        self.addresses: list[str] = []

    def start(self) -> PsShards:
        from hetpipe import launch

        run = self.root / "run"
        try:
            for i in range(self.n):
                argv = [
                    sys.executable,
                    "-m",
                    "hetpipe.ps",
                    "--cluster",
                    str(self.path),
                    "--shard",
                    str(i),
                    "--run-dir",
                    str(run),
                    "--log-level",
                    "warning",
                ]
                if i:
                    argv += ["--head", self.addresses[0]]
                proc = launch.spawn(launch.Daemon(f"ps{i}", tuple(argv)), run)
                self.procs.append(proc)
                ready = launch.wait_ready({f"ps{i}": proc}, run, 60.0)
                self.addresses.append(ready[f"ps{i}"]["address"])
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs.clear()


async def _admin(
    addresses: list[str],
    op: str,
    job: str,
    spec: Spec,
    placement: dict[str, int],
    waves: int,
    staleness: int,
) -> dict[str, Any]:
    """What the head does for a job: shard_init, shard_fetch (checked here), shard_drop."""
    import zmq.asyncio

    from hetpipe.transport import Channel, make_socket
    from hetpipe.wire import Kind

    ctx = zmq.asyncio.Context()
    chans = [
        Channel(
            make_socket(ctx, zmq.DEALER, connect=a), None, name=f"admin{i}", max_frame_bytes=1 << 31
        ).start()
        for i, a in enumerate(addresses)
    ]
    out: dict[str, Any] = {}
    try:
        for i, ch in enumerate(chans):
            names = [n for n, _ in spec if placement[n] == i]
            what = f"shard {i}"
            if op == "init":
                members = {str(v): {"waves": waves, "stages": {"0": names}} for v in range(VWS)}
                weights = {n: torch.zeros(k) for n, k in spec if placement[n] == i}
                await ch.request(
                    Kind.SHARD_INIT,
                    {"job": job, "members": members, "staleness": staleness},
                    weights,
                    timeout=WAIT_S,
                    what=what,
                )
            elif op == "check":
                reply = await ch.request(Kind.SHARD_FETCH, {"job": job}, timeout=WAIT_S, what=what)
                want = waves * sum(delta_value(v) for v in range(VWS))
                for n in names:
                    t = reply.tensors[n]
                    lo, hi = float(t.min()), float(t.max())
                    if not lo == hi == want:
                        raise RuntimeError(f"shard {i}: {n} holds [{lo}, {hi}], want {want}")
                info = reply.get("info") or {}
                out[str(i)] = {"pushes": info.get("pushes"), "global": info.get("global")}
            else:
                await ch.request(Kind.SHARD_DROP, {"job": job}, timeout=WAIT_S, what=what)
    finally:
        for ch in chans:
            await ch.close()
        ctx.term()
    return out


def _raw_server(conn: Any, tensors: Spec) -> None:
    """Child: sync ROUTER; acks a push, answers a pull with ``tensors`` from a fixed buffer.

    Only the small msgpack header is parsed (for the rid the VW matches replies by), so the
    VWs can be either ours or raw; the tensor frames are never looked at.
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 1024)
    sock.setsockopt(zmq.RCVHWM, 1024)
    sock.bind(f"tcp://{HOST}:0")
    buf = memoryview(bytearray(4 * sum(k for _, k in tensors) or 1))
    views, descs, at = [], [], 0
    for i, (name, k) in enumerate(tensors):
        views.append(buf[at : at + 4 * k])
        descs.append({"name": name, "dtype": "float32", "shape": [k], "frame": i + 1})
        at += 4 * k
    conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    pack = msgpack.Packer(use_bin_type=True).pack
    try:
        while True:
            frames = sock.recv_multipart(copy=False)
            head = msgpack.unpackb(frames[1].buffer)
            rid = head["f"]["rid"]
            if head["kind"] == "push":
                reply = {
                    "v": 1,
                    "kind": "ok",
                    "f": {"rid": rid, "info": {"applied": True}},
                    "t": [],
                }
                sock.send_multipart([frames[0], pack(reply)])
            else:
                reply = {
                    "v": 1,
                    "kind": "pulled",
                    "f": {"rid": rid, "clock": 0, "vw_clock": 0, "applied": []},
                    "t": descs,
                }
                sock.send_multipart([frames[0], pack(reply), *views], copy=False)
    finally:
        sock.close(linger=0)
        ctx.term()


class RawServers:
    """``n`` raw pyzmq server processes; always reaped."""

    def __init__(self, n: int, spec: Spec, placement: dict[str, int]) -> None:
        self.n = n
        self.held = [[(name, k) for name, k in spec if placement[name] == i] for i in range(n)]
        self.procs: list[Any] = []
        self.addresses: list[str] = []

    def start(self) -> RawServers:
        ctx = mp.get_context("spawn")
        try:
            for i in range(self.n):
                parent, child = ctx.Pipe()
                p = ctx.Process(
                    target=_raw_server, args=(child, self.held[i]), daemon=True, name=f"raw{i}"
                )
                p.start()
                self.procs.append(p)
                if not parent.poll(60):
                    raise TimeoutError(f"raw zmq server {i} did not start within 60 s")
                self.addresses.append(parent.recv())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        _reap(self.procs)


def _reap(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    procs.clear()


# --------------------------------------------------------------------------- VW clients


class _OursVW:
    """A VW on the runtime's transport: Channel DEALERs on zmq.asyncio, replies decoded."""

    def __init__(self, vw: int) -> None:
        import zmq.asyncio

        self.vw = vw
        self.loop = asyncio.new_event_loop()
        self.ctx = zmq.asyncio.Context()
        self.chans: list[Any] = []
        self.key: tuple[str, ...] = ()

    async def _connect(self, addresses: list[str]) -> None:
        from hetpipe.transport import Channel, make_socket

        for ch in self.chans:
            await ch.close()
        self.chans = [
            Channel(
                make_socket(self.ctx, zmq.DEALER, connect=a),
                None,
                name=f"vw{self.vw}-shard{i}",
                max_frame_bytes=1 << 31,
            ).start()
            for i, a in enumerate(addresses)
        ]
        self.key = tuple(addresses)

    async def _waves(
        self,
        addresses: list[str],
        deltas: list[dict[str, torch.Tensor]],
        job: str,
        waves: int,
        staleness: int,
        barrier: Any,
    ) -> dict[str, Any]:
        from hetpipe.wire import Kind

        if tuple(addresses) != self.key:
            await self._connect(addresses)
        await self.loop.run_in_executor(None, barrier.wait, WAIT_S)
        t0 = time.monotonic()
        pushed = pulled = 0
        base = {"job": job, "vw": self.vw, "stage": 0}
        for c in range(waves):
            futs = []
            for i, ch in enumerate(self.chans):
                futs.append(
                    await ch.send_request(
                        Kind.PUSH, {**base, "wave": c}, deltas[i], what=f"shard {i}"
                    )
                )
                pushed += sum(t.nbytes for t in deltas[i].values())
            for i, ch in enumerate(self.chans):
                futs.append(
                    await ch.send_request(
                        Kind.PULL, {**base, "need": c - staleness, "wave": c + 1}, what=f"shard {i}"
                    )
                )
            replies = await asyncio.wait_for(asyncio.gather(*futs), WAIT_S)
            for r in replies[len(self.chans) :]:
                pulled += sum(t.nbytes for t in r.tensors.values())
        return {"t0": t0, "t1": time.monotonic(), "pushed": pushed, "pulled": pulled}

    def run(self, *args: Any) -> dict[str, Any]:
        return self.loop.run_until_complete(self._waves(*args))

    def close(self) -> None:
        async def go() -> None:
            for ch in self.chans:
                await ch.close()

        self.loop.run_until_complete(go())
        self.loop.close()
        self.ctx.term()


class _RawVW:
    """A VW on sync pyzmq DEALERs: the same messages, encoded once per request, no decoding."""

    def __init__(self, vw: int) -> None:
        self.vw = vw
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []
        self.key: tuple[str, ...] = ()
        self.rid = 0

    def _connect(self, addresses: list[str]) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.socks = []
        for a in addresses:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 64)
            s.setsockopt(zmq.RCVHWM, 64)
            s.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
            s.connect(a)
            self.socks.append(s)
        self.key = tuple(addresses)

    def _frames(self, kind: Any, fields: dict[str, Any], tensors: Any = None) -> list[Any]:
        from hetpipe.wire import encode

        self.rid += 1
        return encode(kind, {**fields, "rid": self.rid}, tensors)

    def run(
        self,
        addresses: list[str],
        deltas: list[dict[str, torch.Tensor]],
        job: str,
        waves: int,
        staleness: int,
        barrier: Any,
    ) -> dict[str, Any]:
        from hetpipe.wire import Kind

        if tuple(addresses) != self.key:
            self._connect(addresses)
        barrier.wait(WAIT_S)
        t0 = time.monotonic()
        pushed = pulled = 0
        base = {"job": job, "vw": self.vw, "stage": 0}
        for c in range(waves):
            for s, d in zip(self.socks, deltas, strict=True):
                s.send_multipart(self._frames(Kind.PUSH, {**base, "wave": c}, d), copy=False)
                pushed += sum(t.nbytes for t in d.values())
            for s in self.socks:
                s.send_multipart(
                    self._frames(Kind.PULL, {**base, "need": c - staleness, "wave": c + 1})
                )
            for s in self.socks:
                for _ in range(2):  # the push's ack and the pull's answer, in either order
                    frames = s.recv_multipart(copy=False)
                    head = msgpack.unpackb(frames[0].buffer)
                    if head["kind"] == "error":
                        raise RuntimeError(head["f"]["message"])
                    pulled += sum(len(f) for f in frames[1:])
        return {"t0": t0, "t1": time.monotonic(), "pushed": pushed, "pulled": pulled}

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.ctx.term()


def _vw_process(vw: int, spec: Spec, cmds: Any, results: Any, barrier: Any) -> None:
    """Child: one VW for the whole benchmark; runs what each command asks for."""
    torch.set_num_threads(1)
    update = {n: torch.full((k,), delta_value(vw)) for n, k in spec}
    clients: dict[str, Any] = {}
    try:
        while True:
            cmd = cmds.get(True, WAIT_S)
            if cmd is None:
                return
            try:
                kind, addresses, placement, job, waves, staleness = cmd
                deltas: list[dict[str, torch.Tensor]] = [{} for _ in addresses]
                for n, t in update.items():
                    deltas[placement[n]][n] = t
                if kind not in clients:
                    clients[kind] = _OursVW(vw) if kind == "ours" else _RawVW(vw)
                got = clients[kind].run(addresses, deltas, job, waves, staleness, barrier)
                results.put({"vw": vw, **got})
            except Exception as exc:
                results.put({"vw": vw, "error": f"{type(exc).__name__}: {exc}"})
                return
    finally:
        for c in clients.values():
            with contextlib.suppress(Exception):
                c.close()


class VWs:
    """The four VW processes, kept for the whole benchmark; always reaped."""

    def __init__(self, spec: Spec) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.barrier = ctx.Barrier(VWS + 1)
        self.cmds = [ctx.Queue() for _ in range(VWS)]
        self.procs = [
            ctx.Process(
                target=_vw_process,
                name=f"vw{v}",
                daemon=True,
                args=(v, spec, self.cmds[v], self.results, self.barrier),
            )
            for v in range(VWS)
        ]
        for p in self.procs:
            p.start()

    def run(
        self,
        client: str,
        addresses: list[str],
        placement: dict[str, int],
        job: str,
        waves: int,
        staleness: int,
    ) -> tuple[float, int]:
        """One run: (seconds from the common start to the last VW's end, payload bytes)."""
        for q in self.cmds:
            q.put((client, addresses, placement, job, waves, staleness))
        got = []
        try:
            self.barrier.wait(WAIT_S)
        except Exception:  # broken: a VW failed before it got there; its error says why
            got.append(self.results.get(True, 10))
        while len(got) < VWS:
            try:
                got.append(self.results.get(True, WAIT_S))
            except queue.Empty:
                raise TimeoutError(f"a VW did not finish within {WAIT_S:g} s") from None
            if "error" in got[-1]:
                break
        for r in got:
            if "error" in r:
                raise RuntimeError(f"vw{r['vw']} ({client} client) failed: {r['error']}")
        seconds = max(r["t1"] for r in got) - min(r["t0"] for r in got)
        return seconds, sum(r["pushed"] + r["pulled"] for r in got)

    def stop(self) -> None:
        for q in self.cmds:
            with contextlib.suppress(Exception):
                q.put(None)
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        _reap(self.procs)


# --------------------------------------------------------------------------- driver


def measure(
    n: int,
    spec: Spec,
    vws: VWs,
    ways: dict[str, tuple[str, str]],
    waves: int,
    staleness: int,
    repeats: int,
    root: Path,
) -> dict[str, dict[str, Any]]:
    """Every way at ``n`` shards, runs interleaved; run 0 (half the waves) is a warm-up."""
    placement = place(spec, n)
    servers: dict[str, Any] = {}
    out: dict[str, dict[str, Any]] = {w: {"runs": []} for w in ways}
    try:
        if any(s == "ps" for _, s in ways.values()):
            servers["ps"] = PsShards(n, root).start()
        if any(s == "raw" for _, s in ways.values()):
            servers["raw"] = RawServers(n, spec, placement).start()
        for r in range(repeats + 1):
            w = max(1, waves // 2) if r == 0 else waves
            for way, (client, server) in ways.items():
                addresses = servers[server].addresses
                job = f"bench-{n}-{way}-{r}"
                if server == "ps":
                    asyncio.run(_admin(addresses, "init", job, spec, placement, w, staleness))
                seconds, nbytes = vws.run(client, addresses, placement, job, w, staleness)
                if server == "ps":
                    out[way]["shards"] = asyncio.run(
                        _admin(addresses, "check", job, spec, placement, w, staleness)
                    )
                    asyncio.run(_admin(addresses, "drop", job, spec, placement, w, staleness))
                if r:
                    out[way]["runs"].append(nbytes / seconds / 1e9)
    finally:
        for s in servers.values():
            s.stop()
    for f in out.values():
        f["gbps"] = median(f["runs"])
    return out


def breakdown(spec: Spec) -> dict[str, float]:
    """Seconds per model-size push of a shard's own work, one thread, best of 5."""
    from hetpipe.wire import Kind, decode, encode

    w = {n: torch.zeros(k) for n, k in spec}
    d = {n: torch.full((k,), 1e-3) for n, k in spec}
    fields = {"rid": 1, "job": "j", "vw": 0, "stage": 0, "wave": 0}
    received = [bytes(f) for f in encode(Kind.PUSH, fields, d)]  # separate buffers, as zmq's

    def best(fn: Any) -> float:
        fn()
        out = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return min(out)

    def out_of_place() -> None:
        for n in w:
            w[n] = w[n] + d[n]

    return {
        "encode_s": best(lambda: encode(Kind.PUSH, fields, d)),
        "decode_s": best(lambda: decode(received, max_frame_bytes=1 << 31)),
        "apply_out_of_place_s": best(out_of_place),
        "apply_in_place_s": best(lambda: [w[n].add_(d[n]) for n in w]),
        "copy_s": best(lambda: [t.clone() for t in w.values()]),
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--mb", type=float, default=100.0, help="model size in MB (1e6 bytes)")
    ap.add_argument("--waves", type=int, default=4, help="waves per VW in a run")
    ap.add_argument("--staleness", type=int, default=0, help="WSP staleness D of the pulls")
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per figure (median)")
    ap.add_argument("--diagnose", action="store_true", help="also run the mixed ways")
    ap.add_argument("--breakdown", action="store_true", help="time a shard's per-push work")
    args = ap.parse_args()
    if args.waves < 1 or args.mb <= 0 or args.repeats < 1 or min(args.shards) < 1:
        ap.error("--waves, --repeats and --shards must be >= 1, --mb > 0")
    torch.set_num_threads(1)
    spec = model_spec(args.mb)
    model_bytes = sum(k * 4 for _, k in spec)
    ways = {**WAYS, **(DIAGNOSE if args.diagnose else {})}
    started = time.perf_counter()
    figures: dict[int, dict[str, dict[str, Any]]] = {}
    vws = VWs(spec)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ps-") as tmp:
            for n in args.shards:
                figures[n] = measure(
                    n, spec, vws, ways, args.waves, args.staleness, args.repeats, Path(tmp)
                )
    finally:
        vws.stop()
    wall = time.perf_counter() - started
    parts = breakdown(spec) if args.breakdown else {}

    print(
        f"{VWS} VWs x {args.waves} waves of push + pull of a {model_bytes / 1e6:.1f} MB "
        f"model ({len(spec)} float32 tensors) through n shards, D = {args.staleness}; "
        f"median of {args.repeats} interleaved runs; GB/s = 1e9 payload bytes/s "
        f"(pushed + pulled, all VWs); {machine()['cores']} cores, loopback"
    )
    extra = [w for w in ways if w not in WAYS]
    rows = []
    per: dict[str, Any] = {}
    for n, f in figures.items():
        o, z = f["ours"]["gbps"], f["zmq"]["gbps"]
        rows.append([n, o, z, o / z, *(f[w]["gbps"] for w in extra)])
        per[str(n)] = {
            "ours_gbps": o,
            "zmq_gbps": z,
            "ratio": o / z,
            **{f"{w}_gbps": f[w]["gbps"] for w in extra},
            **{f"{w}_runs": [round(x, 4) for x in f[w]["runs"]] for w in ways},
            "shard_clocks": f["ours"].get("shards"),
        }
    print_table(
        ["shards", "ours GB/s", "raw zmq GB/s", "ratio", *(f"{w} GB/s" for w in extra)], rows
    )
    best_n = max(figures, key=lambda n: figures[n]["ours"]["gbps"])
    best_raw = max(f["zmq"]["gbps"] for f in figures.values())
    ratio = figures[best_n]["ours"]["gbps"] / figures[best_n]["zmq"]["gbps"]
    ratio_best = figures[best_n]["ours"]["gbps"] / best_raw
    print(
        f"ratio_vs_zmq {ratio:.3f}: ours at its best shard count ({best_n}) / raw zmq at "
        f"{best_n} shards; against the best raw figure {ratio_best:.3f}"
    )
    if extra:
        print("ours-client: our VWs -> raw servers; ours-server: raw VWs -> hetpipe-ps")
    if parts:
        print(
            "a shard's work per model-size push (one thread, best of 5): "
            + ", ".join(f"{k[:-2]} {v * 1e3:.1f} ms" for k, v in parts.items())
        )
    print(f"total {wall:.1f} s")
    if args.json:
        out: dict[str, Any] = {
            "bench": "ps",
            "machine": machine(),
            "vws": VWS,
            "waves": args.waves,
            "staleness": args.staleness,
            "model_bytes": model_bytes,
            "tensors": len(spec),
            "repeats": args.repeats,
            "shards": per,
            "best_shards": best_n,
            "ratio_vs_zmq": ratio,
            "ratio_basis": f"ours at its best shard count ({best_n}) / raw zmq at {best_n}",
            "ratio_vs_best_zmq": ratio_best,
            "seconds": wall,
        }
        if parts:
            out["breakdown"] = parts
        emit_json(out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
