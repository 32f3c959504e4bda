"""A job under a garbage flood: throughput against the same job unflooded, start latency, RSS.

A cluster of two emulated devices and one shard (the head) runs one virtual worker
(``mlp`` cut 3+3, Nm = 2) for ``--minibatches`` minibatches, first unflooded, then while two
sender processes flood it with garbage as fast as one sender can: one at the head's ROUTER
(a DEALER that never reads the error replies) and one at the last stage's data port (a
PUSH). Each sender sends in a tight loop as fast as its socket takes messages; its rate is
what one sender reaches, including what queues and TCP buffers absorb (a daemon under flood
lets its queues fill, so the sender is held back by ZeroMQ's high-water marks).

Figures:

- ``throughput_under_flood``: the flooded job's samples/s / the unflooded job's (target
  >= 0.8);
- ``start_latency_s``: from ``submit`` to the job's state ``running`` under the flood, as a
  client sees it through the same flooded head (target <= 5);
- ``rss_growth_mb``: the daemons' summed resident memory at its highest during the flooded
  job, minus before the flood (target <= 50);
- ``flood_msgs_per_s``: each sender's rate.

    python scripts/bench_flood.py [--json] [--minibatches 300] [--repeats 3]

The job's figures come from the head (samples over its training seconds). After an untimed
warm-up job, unflooded and flooded runs alternate ``--repeats`` times so that other load on
the host disturbs both alike; samples/s and start latency are medians, RSS growth the worst.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq
from _bench import emit_json, machine, median, parser, print_table

from hetpipe.client import HeadClient
from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml

WAIT_S = 600.0
GARBAGE = b"\x93not a hetpipe message" + bytes(32)


def _flood(address: str, kind: int, stop: Any, sent: Any) -> None:
    """Send garbage to ``address`` as fast as one sender can until ``stop`` is set."""
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.SNDTIMEO, 100)  # a blocked send wakes up to look at ``stop``
    sock.connect(address)
    n = 0
    t0 = time.monotonic()
    try:
        while not stop.is_set():
            for _ in range(1000):
                try:
                    sock.send(GARBAGE)  # as fast as the socket takes them
                    n += 1
                except zmq.Again:
                    break  # the receiver holds us back (its queue is full)
    finally:
        sent.value = n / max(time.monotonic() - t0, 1e-9)
        sock.close(linger=0)
        ctx.term()


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _job(minibatches: int, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"name": "mlp", "args": {}},
        "data": {"name": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {"minibatch": 32, "nm": 2, "minibatches": minibatches},
        "vw": [{"devices": ["gpu0", "gpu1"], "layers": [3, 3]}],
    }


async def _run(head: str, job: dict[str, Any], pids: list[int]) -> dict[str, Any]:
    """Submit, time the start, follow to the end sampling RSS; the job's figures."""
    async with HeadClient(head, timeout=30) as client:
        t0 = time.monotonic()
        job_id = await client.submit(job)
        start = None
        peak = _rss_mb(pids)
        deadline = t0 + WAIT_S
        while True:
            info = await client.job(job_id)
            if start is None and info["state"] in ("running", "done", "failed", "cancelled"):
                start = time.monotonic() - t0
            peak = max(peak, _rss_mb(pids))
            if info["state"] in ("done", "failed", "cancelled"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job_id} did not finish in {WAIT_S:g} s")
            await asyncio.sleep(0.05)
    return {
        "state": info["state"],
        "error": info.get("error"),
        "start_s": start,
        "samples_per_s": info.get("samples_per_s") or 0.0,
        "rss_peak_mb": peak,
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--minibatches", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--flood-s-before",
        type=float,
        default=1.0,
        help="seconds of flood before the job is submitted",
    )
    args = ap.parse_args()
    bases: list[dict[str, Any]] = []
    floodeds: list[dict[str, Any]] = []
    growths: list[float] = []
    rates: dict[str, list[float]] = {"head": [], "worker": []}
    with tempfile.TemporaryDirectory(prefix="bench-flood-") as tmp:
        root = Path(tmp)
        path = root / "cluster.toml"
        # security off: the flooders are plain sockets (with Curve, a keyless one is refused
        # in the handshake and floods nothing but libzmq)
        path.write_text(cluster_toml((DeviceDef("gpu0"), DeviceDef("gpu1")), shards=1, curve=False))
        with LocalCluster(path, root / "run", timeout=120) as c:
            pids = [p.pid for p in c.procs.values()]
            asyncio.run(_run(c.head, _job(20, "warmup"), pids))
            targets = {
                "head": (c.head, zmq.DEALER),
                "worker": (c.ready["worker-gpu1"]["address"], zmq.PUSH),
            }
            for r in range(args.repeats):
                bases.append(asyncio.run(_run(c.head, _job(args.minibatches, "base"), pids)))
                rss_before = _rss_mb(pids)
                stop = mp.Event()
                sent = {k: mp.Value("d", 0.0) for k in targets}
                floods = [
                    mp.Process(target=_flood, args=(*targets[k], stop, sent[k])) for k in targets
                ]
                for f in floods:
                    f.start()
                try:
                    time.sleep(args.flood_s_before)
                    floodeds.append(
                        asyncio.run(_run(c.head, _job(args.minibatches, f"flooded{r}"), pids))
                    )
                finally:
                    stop.set()
                    for f in floods:
                        f.join(timeout=30)
                        if f.is_alive():
                            f.kill()
                growths.append(floodeds[-1]["rss_peak_mb"] - rss_before)
                for k in targets:
                    rates[k].append(sent[k].value)
            alive = all(c.alive(n) for n in c.procs)
    base = {k: median([b[k] for b in bases]) for k in ("start_s", "samples_per_s")}
    flooded = {k: median([b[k] for b in floodeds]) for k in ("start_s", "samples_per_s")}
    flooded["state"] = ",".join(sorted({f["state"] for f in floodeds}))
    flooded["error"] = next((f["error"] for f in floodeds if f["state"] != "done"), None)
    ratio = flooded["samples_per_s"] / base["samples_per_s"] if base["samples_per_s"] else 0.0
    growth = max(growths)
    print_table(
        ["run", "state", "start s", "samples/s", "peak RSS MB"],
        [
            [name, r["state"], r["start_s"], r["samples_per_s"], r["rss_peak_mb"]]
            for pair in zip(bases, floodeds, strict=True)
            for name, r in zip(("unflooded", "flooded"), pair, strict=True)
        ],
    )
    print(
        f"flood: head {median(rates['head']):.0f} msgs/s, worker data port "
        f"{median(rates['worker']):.0f} msgs/s (medians); daemons alive after: {alive}"
    )
    print(
        f"throughput_under_flood {ratio:.3f} (target >= 0.8), start_latency_s "
        f"{flooded['start_s']:.3f} (target <= 5), rss_growth_mb {growth:.1f} (target <= 50)"
    )
    if flooded["state"] != "done":
        print(f"flooded job {flooded['state']}: {flooded['error']}")
    if args.json:
        emit_json(
            {
                "throughput_under_flood": ratio,
                "start_latency_s": flooded["start_s"],
                "start_latency_unflooded_s": base["start_s"],
                "rss_growth_mb": growth,
                "samples_per_s_unflooded": base["samples_per_s"],
                "samples_per_s_flooded": flooded["samples_per_s"],
                "flooded_job_states": flooded["state"],
                "flood_msgs_per_s": {k: median(v) for k, v in rates.items()},
                "repeats": args.repeats,
                "daemons_alive": alive,
                "minibatches": args.minibatches,
                "machine": machine(),
                "cpu_count": os.cpu_count(),
            }
        )


if __name__ == "__main__":
    main()
