"""Where a replicated stage combines its gradients, measured: directly between the replicas
(what the runtime does, :mod:`hetpipe.replicas`) or through a parameter-server shard.

Two figures on this host:

- ``exchange``: one minibatch's gradient exchange of two replicas holding ``--params``
  float32 weights, median over ``--rounds``. *direct*: each replica sends its gradients to
  the other's data port (PUSH to PULL, what the workers do) and has the sum once the other's
  arrive. *ps*: each sends them to a real ``hetpipe-ps`` shard as a ``reduce`` request (the
  synchronous kinds' exchange), which parks until both are in and answers both with the
  mean: two transfers per replica, and the shard between them. Both replicas are this
  process's asyncio tasks; the shard is its own process.
- ``job``: a 2-stage mlp virtual worker on real daemons, its second stage (the bottleneck,
  on devices emulated ``--speed`` times as fast) on one device and then replicated on two of
  that speed, ``--minibatches`` each; minibatches per second, and the replicated stage's
  ``replicas`` share (sending its gradients and waiting for the other replica's) of its
  time.

    python scripts/bench_replicas.py [--json] [--params N] [--rounds N] [--minibatches N]
                                     [--speed S]
"""

from __future__ import annotations

import asyncio
import json
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


async def _exchange(address: str, grads: list[dict[str, torch.Tensor]], rounds: int
                    ) -> tuple[list[float], list[float]]:
    """Times of the direct and the shard exchange, alternated round by round (so both see
    the same load on this shared host); the first round of each connects and is dropped."""
    ctx = zmq.asyncio.Context()
    inbox: list[asyncio.Queue[Message]] = [asyncio.Queue(), asyncio.Queue()]
    chans: list[Channel] = []

    def channel(kind: int, name: str, handler: Any = None, **where: str) -> Channel:
        sock = make_socket(ctx, kind, max_frame_bytes=MAX_FRAME, **where)
        ch = Channel(sock, handler, name=name, max_frame_bytes=MAX_FRAME)
        chans.append(ch)
        return ch.start()

    try:
        # direct: each replica a PULL socket (its data port) and a PUSH to the other's
        pulls = []
        for r in range(2):
            async def take(_peer: bytes | None, msg: Message, r: int = r) -> None:
                await inbox[r].put(msg)
            pulls.append(channel(zmq.PULL, f"replica{r}", take, bind=tcp("127.0.0.1", 0)))
        pushes = [channel(zmq.PUSH, f"to{1 - r}", connect=bound_address(pulls[1 - r].sock))
                  for r in range(2)]
        # ps: the head's channel to the shard, then one per replica
        dealers = [channel(zmq.DEALER, f"c{r}", connect=address) for r in range(3)]
        names = list(grads[0])
        members = {str(v): {"waves": rounds + 1, "stages": {"0": names}} for v in range(2)}
        await dealers[0].request(Kind.SHARD_INIT, {"job": "bench", "members": members,
                                                   "staleness": 0},
                                 {n: torch.zeros_like(t) for n, t in grads[0].items()},
                                 timeout=TIMEOUT_S, what="shard")

        async def direct(r: int, p: int) -> None:
            await pushes[r].send(Kind.REPLICA_GRAD, {"job": "b", "vw": 0, "stage": 0, "p": p,
                                                     "replica": r}, grads[r])
            got = await asyncio.wait_for(inbox[r].get(), TIMEOUT_S)
            with torch.no_grad():  # the sum each replica takes
                for n, g in got.tensors.items():
                    _ = grads[r][n] + g

        async def via_shard(r: int, it: int) -> None:
            await dealers[1 + r].request(Kind.REDUCE, {"job": "bench", "vw": r, "stage": 0,
                                                       "iteration": it, "samples": 16},
                                         grads[r], timeout=TIMEOUT_S, what="shard")

        times: tuple[list[float], list[float]] = ([], [])
        for it in range(rounds + 1):
            for out, fn in zip(times, (direct, via_shard), strict=True):
                t0 = time.perf_counter()
                await asyncio.gather(fn(0, it), fn(1, it))
                if it:
                    out.append(time.perf_counter() - t0)
        await dealers[0].request(Kind.SHARD_DROP, {"job": "bench"}, timeout=TIMEOUT_S,
                                 what="shard")
        return times
    finally:
        for ch in chans:
            await ch.close()
        ctx.term()


def _job(name: str, devices: list[Any], minibatches: int) -> dict[str, Any]:
    return {"name": name, "model": {"name": "mlp", "args": {"hidden": [512, 512]}},
            "data": {"name": "digits"},
            "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9},
            "train": {"minibatch": 64, "nm": 2, "staleness": 0, "seed": 0,
                      "minibatches": minibatches, "checkpoint_every": 0},
            "vw": [{"devices": devices, "layers": [2, 4]}]}


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
    ap.add_argument("--minibatches", type=int, default=60)
    ap.add_argument("--speed", type=float, default=0.1,
                    help="emulated speed of the second stage's devices")
    args = ap.parse_args()
    grads = [{"w": torch.randn(args.params)} for _ in range(2)]
    # the second stage's devices are slow: their compute is mostly padding (sleep), so two
    # replicas really run side by side on this host's few cores, as two GPUs would
    devices = (DeviceDef("g0", "fast", "512MiB", 1.0),
               *(DeviceDef(f"g{i}", "slow", "512MiB", args.speed) for i in (1, 2)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.toml"
        path.write_text(cluster_toml(devices, shards=2, curve=False))
        c = LocalCluster(path, Path(tmp) / "run", timeout=60).__enter__()
        try:
            direct, ps = asyncio.run(_exchange(c.ready["ps1"]["address"], grads,
                                               args.rounds))
            one = c.submit(_job("one", ["g0", "g1"], args.minibatches))
            two = c.submit(_job("two", ["g0", ["g1", "g2"]], args.minibatches))
            for info in (one, two):
                assert info["state"] == "done", info.get("error")
            per_mb, share = _replica_share(two)
        finally:
            c.stop()
    mbs = {k: info["minibatches"] / info["seconds"] for k, info in (("one", one), ("two", two))}
    mb = args.params * 4 / 2**20
    result = {
        "params": args.params, "bytes_mib": mb,
        "exchange_direct_ms": 1e3 * median(direct), "exchange_ps_ms": 1e3 * median(ps),
        "ps_over_direct": median(ps) / median(direct),
        "job_minibatches_per_s_one_device": mbs["one"],
        "job_minibatches_per_s_replicated": mbs["two"],
        "job_replicas_ms_per_minibatch": 1e3 * per_mb, "job_replicas_share": share,
        "machine": machine(),
    }
    if args.json:
        emit_json(result)
        return
    print_table(["exchange of", "direct (ms)", "via a shard (ms)", "ps / direct"],
                [[f"{mb:.1f} MiB x 2", f"{result['exchange_direct_ms']:.2f}",
                  f"{result['exchange_ps_ms']:.2f}", f"{result['ps_over_direct']:.2f}"]])
    print()
    print_table(["job", "minibatches/s", "replicas ms/minibatch", "replicas share"],
                [["stage 1 on one device", f"{mbs['one']:.1f}", "-", "-"],
                 ["stage 1 on two devices", f"{mbs['two']:.1f}", f"{1e3 * per_mb:.2f}",
                  f"{share:.1%}"]])


if __name__ == "__main__":
    main()
