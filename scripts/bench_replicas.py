"""Where a replicated stage combines its gradients, measured: directly between the replicas
(what the runtime does, :mod:`hetpipe.replicas`) or through a parameter-server shard.

Two figures on this host:

- ``exchange``: one minibatch's gradient exchange of two replicas holding ``--params``
  float32 weights, until both hold the result, median over ``--rounds`` (the two ways
  alternate round by round, so both see the same load on a shared host). *direct*: each
  replica sends its gradients to the other's data port (PUSH to PULL, what the workers do)
  and adds the other's once they arrive. *ps*: each sends them to a real ``hetpipe-ps`` shard
  as a ``reduce`` request (the synchronous kinds' exchange), which parks until both are in
  and answers both with the mean: two transfers per replica, and the shard between them.
  Each replica is its own process, as in the runtime.
- ``job``: a 2-stage mlp virtual worker on real daemons, its second stage (the bottleneck,
  on devices emulated ``--speed`` times as fast) on one device and then replicated on two of
  that speed, ``--minibatches`` each, ``--repeats`` times interleaved; medians of
  minibatches per second, and of the replicated stage's
  ``replicas`` share (sending its gradients and waiting for the other replica's) of its
  time.
- ``planned``: on the same cluster, a 1-VW job with no split planned by the head with
  ``train.max_replicas = 2`` (the planner decides where replicas pay) against the same job
  planned without replicas (``max_replicas = 1``), ``--repeats`` times interleaved: medians
  of minibatches per second, their ratio, the planner's predicted ratio, the splits it chose,
  and the host's load average (``os.getloadavg``) around each run. ``--planned-speeds``
  plans on a cluster of its own instead (one device per speed given); ``--planned-hidden``
  and ``--planned-minibatch`` choose the mlp and its minibatch (default: :func:`_job`'s).

    python scripts/bench_replicas.py [--json] [--params N] [--rounds N] [--minibatches N]
                                     [--repeats N] [--speed S] [--parts exchange,job,planned]
                                     [--planned-speeds S,S,..] [--planned-hidden W,W,..]
                                     [--planned-minibatch N]
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import zmq
import zmq.asyncio
from _bench import emit_json, machine, median, parser, print_table

from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml
from hetpipe.transport import Channel, bound_address, make_socket, tcp
from hetpipe.wire import Kind, Message

MAX_FRAME = 1 << 30
TIMEOUT_S = 60.0


async def _replica(
    r: int, shard: str, params: int, rounds: int, barrier: Any, addresses: Any, times: Any
) -> None:
    """One replica, in its own process as in the runtime: per round, the direct exchange
    and then the exchange through the shard, each started together with the other replica
    (a barrier); its own times go to ``times``."""
    torch.set_num_threads(1)  # as the workers run: spinning intra-op threads would only
    # fight over this host's cores
    ctx = zmq.asyncio.Context()
    grads = {"w": torch.randn(params)}
    inbox: asyncio.Queue[Message] = asyncio.Queue()

    async def take(_peer: bytes | None, msg: Message) -> None:
        await inbox.put(msg)

    def channel(kind: int, name: str, handler: Any = None, **where: str) -> Channel:
        sock = make_socket(ctx, kind, max_frame_bytes=MAX_FRAME, **where)
        return Channel(sock, handler, name=name, max_frame_bytes=MAX_FRAME).start()

    pull = channel(zmq.PULL, f"replica{r}", take, bind=tcp("127.0.0.1", 0))
    addresses.put((r, bound_address(pull.sock)))
    await asyncio.sleep(0)
    peer = await asyncio.get_running_loop().run_in_executor(None, _other, addresses, r)
    push = channel(zmq.PUSH, "peer", connect=peer)
    dealer = channel(zmq.DEALER, "shard", connect=shard)
    try:
        for it in range(rounds + 1):
            out = []
            for via_shard in (False, True):
                barrier.wait()
                t0 = time.perf_counter()
                if via_shard:
                    await dealer.request(
                        Kind.REDUCE,
                        {"job": "bench", "vw": r, "stage": 0, "iteration": it, "samples": 16},
                        grads,
                        timeout=TIMEOUT_S,
                        what="shard",
                    )
                else:
                    await push.send(
                        Kind.REPLICA_GRAD,
                        {"job": "b", "vw": 0, "stage": 0, "p": it, "replica": r},
                        grads,
                    )
                    got = await asyncio.wait_for(inbox.get(), TIMEOUT_S)
                    with torch.no_grad():  # the sum the replica takes
                        _ = grads["w"] + got.tensors["w"]
                out.append(time.perf_counter() - t0)
            if it:  # the first round connects
                times.put((r, *out))
    finally:
        for ch in (pull, push, dealer):
            await ch.close()
        ctx.term()


def _other(addresses: Any, r: int) -> str:
    """The other replica's data address (both put theirs; each takes the other's)."""
    seen: dict[int, str] = {}
    while 1 - r not in seen:
        i, a = addresses.get(timeout=TIMEOUT_S)
        seen[i] = a
        if i == r:
            addresses.put((i, a))  # not ours to take
            time.sleep(0.01)
    return seen[1 - r]


def _run_replica(*args: Any) -> None:
    asyncio.run(_replica(*args))


def _exchange(shard: str, params: int, rounds: int) -> tuple[list[float], list[float]]:
    """Per round, the time until both replicas hold the sum: directly, and via the shard."""

    async def init(drop: bool) -> None:
        ctx = zmq.asyncio.Context()
        sock = make_socket(ctx, zmq.DEALER, connect=shard, max_frame_bytes=MAX_FRAME)
        ch = Channel(sock, None, name="head", max_frame_bytes=MAX_FRAME).start()
        try:
            if drop:
                await ch.request(Kind.SHARD_DROP, {"job": "bench"}, timeout=TIMEOUT_S, what="shard")
            else:
                members = {str(v): {"waves": rounds + 1, "stages": {"0": ["w"]}} for v in range(2)}
                await ch.request(
                    Kind.SHARD_INIT,
                    {"job": "bench", "members": members, "staleness": 0},
                    {"w": torch.zeros(params)},
                    timeout=TIMEOUT_S,
                    what="shard",
                )
        finally:
            await ch.close()
            ctx.term()

    asyncio.run(init(False))
    mp = multiprocessing.get_context("spawn")
    barrier, addresses, times = mp.Barrier(2), mp.Queue(), mp.Queue()
    procs = [
        mp.Process(target=_run_replica, args=(r, shard, params, rounds, barrier, addresses, times))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    rows: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
    try:
        for _ in range(2 * rounds):
            r, direct, ps = times.get(timeout=TIMEOUT_S * 2)
            rows[r].append((direct, ps))
    finally:
        for p in procs:
            p.join(TIMEOUT_S)
            if p.is_alive():
                p.kill()
    asyncio.run(init(True))
    pairs = list(zip(rows[0], rows[1], strict=True))
    return ([max(a[0], b[0]) for a, b in pairs], [max(a[1], b[1]) for a, b in pairs])


def _job(name: str, devices: list[Any], minibatches: int) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"name": "mlp", "args": {"hidden": [512, 512]}},
        "data": {"name": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9},
        "train": {
            "minibatch": 64,
            "nm": 2,
            "staleness": 0,
            "seed": 0,
            "minibatches": minibatches,
            "checkpoint_every": 0,
        },
        "vw": [{"devices": devices, "layers": [2, 4]}],
    }


def _planned_job(
    name: str, max_replicas: int, minibatches: int, hidden: list[int], minibatch: int
) -> dict[str, Any]:
    """An mlp of ``hidden`` widths on the same data as :func:`_job`, no split: the head
    plans it."""
    job = _job(name, [], minibatches)
    del job["vw"], job["train"]["nm"]
    job["model"]["args"]["hidden"] = hidden
    job["train"].update({"vws": 1, "max_replicas": max_replicas, "minibatch": minibatch})
    return job


def _split(info: dict[str, Any]) -> str:
    """The split a job ran, as a job file's ``devices`` and ``layers``."""
    groups = [
        s["device"] if not s["replicas"] else "[" + ", ".join([s["device"], *s["replicas"]]) + "]"
        for s in info["stages"]
    ]
    layers = [b - a for a, b in (s["layers"] for s in info["stages"])]
    return f"[{', '.join(groups)}] layers {layers}"


def _planned(
    c: LocalCluster, minibatches: int, repeats: int, hidden: list[int], minibatch: int
) -> dict[str, Any]:
    """Planned with replicas against planned without, interleaved (see the module docs)."""
    rates: dict[str, list[float]] = {"with": [], "without": []}
    predicted: dict[str, float] = {}
    splits: dict[str, str] = {}
    loads: list[float] = []
    notes: list[Any] = []
    for i in range(repeats):
        for key, r in (("without", 1), ("with", 2)):
            loads.append(os.getloadavg()[0])
            info = c.submit(_planned_job(f"planned-{key}{i}", r, minibatches, hidden, minibatch))
            loads.append(os.getloadavg()[0])
            assert info["state"] == "done", info.get("error")
            rates[key].append(info["minibatches"] / info["seconds"])
            predicted[key] = info["predicted"]["samples_per_s"]
            splits[key] = _split(info)
            if key == "with":
                notes.append(info["predicted"]["replica_choice"])
    mbs = {k: median(v) for k, v in rates.items()}
    return {
        "planned_minibatches_per_s_with_replicas": mbs["with"],
        "planned_minibatches_per_s_without_replicas": mbs["without"],
        "planned_speedup": mbs["with"] / mbs["without"],
        "planned_predicted_speedup": predicted["with"] / predicted["without"],
        "planned_predicted_samples_per_s": predicted,
        "planned_splits": splits,
        "planned_runs": rates,
        "planned_loadavg_1min": [min(loads), max(loads)],
        "planned_model": {"hidden": hidden, "minibatch": minibatch},
        "planned_replica_choice": notes[-1] if notes else None,
    }


def _replica_share(info: dict[str, Any]) -> tuple[float, float]:
    """(the replicated stage's replicas time per minibatch, its share of the stage's time)."""
    stages = json.loads(Path(info["stages_path"]).read_text())
    stats = stages["vw0/stage1"]["stats"]
    total = sum(stats["timing"].values())
    return stats["timing"]["replicas"] / stats["done"], stats["timing"]["replicas"] / total


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--params", type=int, default=1 << 20, help="weights exchanged")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--minibatches", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each job, interleaved")
    ap.add_argument(
        "--speed", type=float, default=0.1, help="emulated speed of the second stage's devices"
    )
    ap.add_argument(
        "--parts", default="exchange,job,planned", help="which figures to measure (comma-separated)"
    )
    ap.add_argument(
        "--planned-hidden",
        default="512,512",
        metavar="W,W,..",
        help="planned: the mlp's hidden widths",
    )
    ap.add_argument("--planned-minibatch", type=int, default=64)
    ap.add_argument(
        "--planned-speeds",
        default=None,
        metavar="S,S,..",
        help="planned: a cluster of one device per speed (one type per speed) "
        "instead of the job's (one fast device, two at --speed)",
    )
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    planned = ([int(w) for w in args.planned_hidden.split(",")], args.planned_minibatch)
    # the second stage's devices are slow: their compute is mostly padding (sleep), so two
    # replicas really run side by side on this host's few cores, as two GPUs would
    devices = (
        DeviceDef("g0", "fast", "512MiB", 1.0),
        *(DeviceDef(f"g{i}", "slow", "512MiB", args.speed) for i in (1, 2)),
    )
    result: dict[str, Any] = {
        "params": args.params,
        "speed": args.speed,
        "minibatches": args.minibatches,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.toml"
        path.write_text(cluster_toml(devices, shards=2, curve=False))
        c = LocalCluster(path, Path(tmp) / "run", timeout=60).__enter__()
        try:
            if "exchange" in parts:
                direct, ps = _exchange(c.ready["ps1"]["address"], args.params, args.rounds)
                mb = args.params * 4 / 2**20
                result.update(
                    {
                        "bytes_mib": mb,
                        "exchange_direct_ms": 1e3 * median(direct),
                        "exchange_ps_ms": 1e3 * median(ps),
                        "ps_over_direct": median(ps) / median(direct),
                    }
                )
            if "job" in parts:
                result.update(_fixed(c, args.minibatches, args.repeats))
            if "planned" in parts and args.planned_speeds is None:
                result.update(_planned(c, args.minibatches, args.repeats, *planned))
        finally:
            c.stop()
        if "planned" in parts and args.planned_speeds is not None:
            speeds = [float(x) for x in args.planned_speeds.split(",")]
            own = tuple(
                DeviceDef(f"p{i}", f"speed{x:g}", "512MiB", x) for i, x in enumerate(speeds)
            )
            path.write_text(cluster_toml(own, shards=2, curve=False))
            c = LocalCluster(path, Path(tmp) / "run-planned", timeout=60).__enter__()
            try:
                result.update(
                    _planned(c, args.minibatches, args.repeats, *planned), planned_speeds=speeds
                )
            finally:
                c.stop()
    result["machine"] = machine()
    if "exchange" in parts:
        print_table(
            ["exchange of", "direct (ms)", "via a shard (ms)", "ps / direct"],
            [
                [
                    f"{result['bytes_mib']:.1f} MiB x 2",
                    f"{result['exchange_direct_ms']:.2f}",
                    f"{result['exchange_ps_ms']:.2f}",
                    f"{result['ps_over_direct']:.2f}",
                ]
            ],
        )
        print()
    if "job" in parts:
        print_table(
            ["job", "minibatches/s", "replicas ms/minibatch", "replicas share"],
            [
                [
                    "stage 1 on one device",
                    f"{result['job_minibatches_per_s_one_device']:.1f}",
                    "-",
                    "-",
                ],
                [
                    "stage 1 on two devices",
                    f"{result['job_minibatches_per_s_replicated']:.1f}",
                    f"{result['job_replicas_ms_per_minibatch']:.2f}",
                    f"{result['job_replicas_share']:.1%}",
                ],
            ],
        )
        print()
    if "planned" in parts:
        splits = result["planned_splits"]
        print_table(
            ["planned", "split", "minibatches/s", "predicted samples/s"],
            [
                [
                    f"max_replicas = {r}",
                    splits[key],
                    f"{result[f'planned_minibatches_per_s_{key}_replicas']:.1f}",
                    f"{result['planned_predicted_samples_per_s'][key]:.0f}",
                ]
                for key, r in (("without", 1), ("with", 2))
            ],
        )
        lo, hi = result["planned_loadavg_1min"]
        print(
            f"with / without: {result['planned_speedup']:.2f} measured, "
            f"{result['planned_predicted_speedup']:.2f} predicted "
            f"(load average {lo:.1f}-{hi:.1f})"
        )
    if args.json:
        emit_json(result)


def _fixed(c: LocalCluster, minibatches: int, repeats: int) -> dict[str, Any]:
    """The given 2-stage split, its second stage on one device and on two (interleaved)."""
    rates: dict[str, list[float]] = {"one": [], "two": []}
    replicas: list[tuple[float, float]] = []
    for i in range(repeats):  # interleaved: both see the same load
        for key, devs in (("one", ["g0", "g1"]), ("two", ["g0", ["g1", "g2"]])):
            info = c.submit(_job(f"{key}{i}", devs, minibatches))
            assert info["state"] == "done", info.get("error")
            rates[key].append(info["minibatches"] / info["seconds"])
            if key == "two":
                replicas.append(_replica_share(info))
    mbs = {k: median(v) for k, v in rates.items()}
    return {
        "job_minibatches_per_s_one_device": mbs["one"],
        "job_minibatches_per_s_replicated": mbs["two"],
        "job_speedup": mbs["two"] / mbs["one"],
        "job_runs": rates,
        "job_replicas_ms_per_minibatch": 1e3 * median([r[0] for r in replicas]),
        "job_replicas_share": median([r[1] for r in replicas]),
    }


if __name__ == "__main__":
    main()
