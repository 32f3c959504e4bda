"""Time to accuracy on the default heterogeneous cluster: hetpipe (WSP) vs DDP data parallelism.

The default cluster (``./cluster.toml``: gpu0 fast 1.0, gpu1/gpu2 medium 0.5, gpu3 whimpy 0.25
with 3 MiB) trains the builtin ``cnn`` on the bundled digits until the test accuracy first
reaches ``--target``, side by side in one run:

- **hetpipe**: the same devices from a copy of ``cluster.toml`` with every port 0, started
  with :class:`hetpipe.localcluster.LocalCluster`; two virtual workers over all four devices
  (VW0 = gpu0 + gpu3, VW1 = gpu1 + gpu2; layers per stage ``--split0``/``--split1``, balanced
  for the emulated speeds and gpu3's 3 MiB), Nm = ``--nm``, WSP with each staleness D of
  ``--staleness`` (default 0 and 2). The head evaluates the global weights every
  ``--eval-every`` seconds *while the job trains* (its ``evals``); the clock starts when the
  head starts the job, launch included. An untimed warm-up job runs first (a fresh worker's
  first job pays imports and data loading, which DDP's ranks pay before their clock starts).
- **DDP**: ``torch.nn.parallel.DistributedDataParallel`` over gloo on 127.0.0.1 (a gradient
  all-reduce every minibatch: the Horovod-style baseline) on the devices that hold the whole
  model: gpu0, gpu1, gpu2 (gpu3's 3 MiB cannot). Each rank emulates its device as a hetpipe
  worker does (:func:`hetpipe.emulate.pad`): the forward, the backward compute (padded in
  the DDP communication hook *before* its all-reduce, so waiting for peers is not
  stretched) and the optimizer step each take their CPU time / speed, from the least CPU
  time each kind of pass took (:class:`hetpipe.emulate.Pace`). One torch thread per rank;
  ``broadcast_buffers=False`` (each rank keeps its batch-norm statistics). Rank 0 evaluates
  every ``--eval-every`` seconds of training; that pauses training, so its time is left out
  of DDP's clock (hetpipe's evaluations run beside training and stay in: a choice in DDP's
  favour). The clock starts after the process group and the model are up.

Both sides: the same model and initial weights (``torch.manual_seed(seed)``), the same
minibatch per process (``--minibatch``), SGD (``--momentum``, ``--weight-decay``) with a
constant learning rate (no schedule, no warm-up) that means the same on both sides: every
minibatch contributes ``lr x its gradient``. hetpipe sums the VWs' updates at the parameter
server; DDP averages gradients over its W ranks, so it steps with ``lr x W``
(``--ddp-lr-scale``, default W). Each rank or VW reads a disjoint shard of every epoch
(:class:`hetpipe.data.MinibatchStream`); ``--epochs`` caps both. The defaults (lr 0.05, no
momentum, Nm 4) are what a small sweep found good for both sides: with momentum 0.9 the
pipeline's stale weights (up to Nm - 1 updates) make hetpipe oscillate, while DDP is not
hurt.

Each way runs ``--repeats`` times with seeds seed, seed+1, ... (the same seeds on both
sides), interleaved so that load on the host disturbs all alike; figures are medians. All
emulated devices share this host's real cores, so when several processes compute at once
the measured compute (and with it the padded time) inflates: every stage's and the whole
model's compute is measured alone first and each side's inflation is reported, with the CPU
its processes used per minibatch (``/proc``) and what an uncontended host would give
(every device on a core of its own, free communication).

Every emulated device runs at ``--speed-scale`` (default 0.25) times its speed in the cluster
file, on both sides, so that the devices mostly wait, as the GPUs modelled would, instead of
competing for this host's cores; the host's CPU utilisation over the runs is printed with the
result (near 1.0 the comparison measures contention, not the cluster).

    python scripts/bench_convergence.py [--json] [--target 0.95] [--epochs 30] [--repeats 7]

With ``--json`` the last line is one JSON object: each side's time to target (median and
runs) and the median run's curve, ``speedup_vs_ddp`` = DDP time to target / hetpipe's (best
D), and the contention figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing as mp
import os
import queue
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from _bench import (
    HostCpu,
    cpu_seconds,
    emit_json,
    free_port,
    machine,
    median,
    parser,
    print_table,
)

from hetpipe.config import load_cluster

ROOT = Path(__file__).resolve().parent.parent
DDP_DEVICES = ("gpu0", "gpu1", "gpu2")  # the devices that hold the whole model
N_LAYERS = 16  # of the builtin cnn
WAIT_S = 300.0


# --------------------------------------------------------------------------- alone


def measure_alone(ranges: list[tuple[int, int]], mb: int, rounds: int = 40) -> dict[str, float]:
    """Seconds of forward + backward + SGD step of each layer range on one thread while nothing
    else of this benchmark runs: the compute without contention. Ranges are timed in turn,
    round after round, and each keeps its fastest round, so that load from other processes
    on the host (which only ever adds time) is filtered out as far as it can be."""
    import torch.nn.functional as F

    from hetpipe.data import MinibatchStream, load_dataset
    from hetpipe.models import build_model

    torch.manual_seed(0)
    model = build_model("cnn")
    stream = MinibatchStream(load_dataset("digits"), mb, 0)
    parts = {
        (a, b): (model[a:b], torch.optim.SGD(model[a:b].parameters(), lr=1e-3)) for a, b in ranges
    }
    best = dict.fromkeys(parts, math.inf)
    for p in range(rounds + 3):
        x, y = stream.batch(p)
        for (first, last), (part, opt) in parts.items():
            with torch.no_grad():
                h = model[:first](x)
            h.requires_grad_(first > 0)
            t0 = time.perf_counter()
            o = part(h)
            if last == len(model):
                F.cross_entropy(o, y).backward()
            else:
                o.backward(torch.ones_like(o))
            opt.step()
            opt.zero_grad()
            if p >= 3:
                best[(first, last)] = min(best[(first, last)], time.perf_counter() - t0)
    return {f"{a}:{b}": t for (a, b), t in best.items()}


# --------------------------------------------------------------------------- hetpipe


def job_dict(args: Any, staleness: int, seed: int) -> dict[str, Any]:
    """The job in the job file's shape."""
    return {
        "name": f"conv-d{staleness}-s{seed}",
        "model": {"name": "cnn", "args": {}},
        "data": {"name": "digits"},
        "optimizer": {
            "name": "sgd",
            "lr": args.lr,
            "momentum": args.momentum,
            "weight_decay": args.weight_decay,
        },
        "train": {
            "minibatch": args.minibatch,
            "nm": args.nm,
            "staleness": staleness,
            "seed": seed,
            "epochs": args.epochs,
            "eval_every_s": args.eval_every,
        },
        "vw": [
            {"devices": ["gpu0", "gpu3"], "layers": list(args.split0)},
            {"devices": ["gpu1", "gpu2"], "layers": list(args.split1)},
        ],
    }


async def _follow(local: Any, job: dict[str, Any], target: float, max_s: float) -> dict[str, Any]:
    """Submit and poll; once an evaluation reaches ``target`` (or ``max_s`` passes) cancel the
    rest of the job: it has told us what we came for."""
    from hetpipe.client import TERMINAL, HeadError

    async with local.client(timeout=30.0) as client:
        job_id = await client.submit(job)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_s + 120.0
        snapshot: dict[str, Any] | None = None
        while True:
            info = await client.job(job_id)
            if info["state"] in TERMINAL:
                break
            hit = any(acc >= target for _s, _n, acc in info.get("evals", []))
            if snapshot is None and (hit or info.get("seconds", 0.0) > max_s):
                snapshot = info
                # it may have ended between the poll and the cancel: nothing to stop then
                with contextlib.suppress(HeadError):
                    await client.cancel(job_id)
            if loop.time() > deadline:
                raise TimeoutError(f"job {job_id} still {info['state']} after {max_s + 120:g} s")
            await asyncio.sleep(0.1)
        info["stopped"] = snapshot is not None
        if snapshot is not None:  # the stage counters as they were at the target
            info["stages"] = snapshot.get("stages", info.get("stages"))
            info["samples_per_s"] = snapshot.get("samples_per_s", info.get("samples_per_s"))
        return info


class Hetpipe:
    """The daemons of the default cluster (ports 0), kept for every hetpipe run."""

    def __init__(
        self, args: Any, speeds: dict[str, float], alone: dict[str, float], tmp: Path
    ) -> None:
        from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml

        self.args, self.speeds, self.alone = args, speeds, alone
        cluster = load_cluster(args.cluster)
        defs = [  # at the global speed scale (speeds are scaled already)
            DeviceDef(d.name, d.type, str(d.memory), speeds[d.name], d.device)
            for d in cluster.devices
        ]
        path = tmp / "cluster.toml"
        path.write_text(cluster_toml(defs, shards=len(cluster.ps)))
        self.local = LocalCluster(path, tmp / "run", timeout=120.0)

    def start(self) -> Hetpipe:
        self.local.__enter__()
        try:
            warm = job_dict(self.args, 0, self.args.seed)
            warm["name"] = "conv-warmup"
            del warm["train"]["epochs"], warm["train"]["eval_every_s"]
            warm["train"]["minibatches"] = 4 * self.args.nm
            info = self.local.submit(warm, timeout=WAIT_S)
            if info["state"] != "done":
                raise RuntimeError(f"hetpipe warm-up job {info['state']}: {info.get('error')}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.local.stop()

    def run(self, staleness: int, seed: int) -> dict[str, Any]:
        a = self.args
        pids = [p.pid for p in self.local.procs.values()]
        cpu0, t0 = cpu_seconds(pids), time.perf_counter()
        info = asyncio.run(_follow(self.local, job_dict(a, staleness, seed), a.target, a.max_s))
        cpu, wall = cpu_seconds(pids) - cpu0, time.perf_counter() - t0
        done = sum(v.get("done") or 0 for v in info.get("vws") or [])
        if info.get("error") and not info["stopped"]:
            raise RuntimeError(f"hetpipe job D={staleness} failed: {info['error']}")
        evals = info.get("evals", [])  # a finished job's last one: its final weights
        hit = next((e for e in evals if e[2] >= a.target), None)
        stages = []
        for st in info.get("stages") or []:
            done = st.get("done") or 0
            padded = (st.get("forward_s") or 0.0) + (st.get("backward_s") or 0.0)
            key = f"{st['layers'][0]}:{st['layers'][1]}"
            per_mb = padded * self.speeds[st["device"]] / done if done else math.nan
            stages.append(
                {
                    "device": st["device"],
                    "layers": key,
                    "compute_ms": per_mb * 1e3,
                    "inflation": per_mb / self.alone[key],
                }
            )
        return {
            "seconds": hit[0] if hit else None,
            "minibatches": hit[1] if hit else None,
            "curve": [[round(s, 2), n, round(acc, 3)] for s, n, acc in evals],
            "stages": stages,
            "mb_per_s": (info.get("samples_per_s") or 0.0) / a.minibatch,
            "cpu_cores": cpu / wall,
            "cpu_ms_per_mb": cpu / done * 1e3 if done else math.nan,
        }


# --------------------------------------------------------------------------- DDP


def _ddp_rank(
    rank: int,
    world: int,
    port: int,
    speed: float,
    a: dict[str, Any],
    cmds: Any,
    stop_at: Any,
    results: Any,
    where: tuple[str | None, str] = (None, "127.0.0.1"),
) -> None:
    """Child: one DDP rank emulating a device of ``speed``; one training run per command.
    ``where``: the network namespace of its device's host (None: this one) and rank 0's
    address, where the process group meets."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    namespace, master = where
    try:
        if namespace is not None:
            from hetpipe.netns import enter

            enter(namespace)
            os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # its host's address, not loopback
        dist.init_process_group(
            "gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world
        )
    except BaseException as exc:
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise
    try:
        while True:
            seed = cmds.get(True, WAIT_S)
            if seed is None:
                return
            try:
                results.put(_ddp_train(rank, world, speed, a, seed, stop_at))
            except BaseException as exc:
                results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
                raise
    finally:
        dist.destroy_process_group()


def _ddp_train(
    rank: int, world: int, speed: float, a: dict[str, Any], seed: int, stop_at: Any
) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from hetpipe.data import MinibatchStream, evaluate, load_dataset
    from hetpipe.emulate import Pace, pad
    from hetpipe.emulate import mark as start
    from hetpipe.models import build_model

    torch.manual_seed(seed)
    if "data" in a:  # another benchmark's model and data (bench_paper.py)
        from hetpipe.data import load_data

        ds: Any = load_data(a["data"], a["data_args"])
        model = build_model(a["model"], a["model_args"])
    else:
        ds, model = load_dataset("digits"), build_model("cnn")
    with warnings.catch_warnings():  # its successor still syncs buffers at init
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.SGD(
        ddp.parameters(),
        lr=a["lr"] * a["lr_scale"],
        momentum=a["momentum"],
        weight_decay=a["weight_decay"],
    )
    stream = MinibatchStream(ds, a["minibatch"], seed, rank, world)
    total = a["epochs"] * stream.per_epoch
    mark: dict[str, Any] = {"t": start(), "compute": 0.0}
    pace = Pace()  # each kind of pass padded from its least work, as a worker pads

    # no annotations: DDP compares them literally with dist.GradBucket / Future[Tensor], and
    # this module's annotations are strings
    def hook(_state, bucket):  # type: ignore[no-untyped-def]
        # the bucket's gradients are computed: pad that compute, then all-reduce them
        mark["compute"] += time.perf_counter() - mark["t"].wall
        pad(mark["t"], speed, "cpu", pace, ("bucket", bucket.index()))
        fut = default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]
        mark["t"] = start()
        return fut

    ddp.register_comm_hook(None, hook)
    evals: list[list[float]] = []
    excluded = 0.0
    dist.barrier()
    started = time.perf_counter()
    next_eval = a["eval_every"]
    step = 0
    while step < min(total, stop_at.value):
        x, y = stream.batch(step)
        t0 = start()
        loss = F.cross_entropy(ddp(x), y)
        mark["compute"] += time.perf_counter() - t0.wall
        pad(t0, speed, "cpu", pace, "forward")
        mark["t"] = start()
        loss.backward()
        t2 = start()
        opt.step()
        opt.zero_grad()
        mark["compute"] += time.perf_counter() - t2.wall
        pad(t2, speed, "cpu", pace, "step")
        step += 1
        if rank != 0:
            continue
        clock = time.perf_counter() - started - excluded
        if clock >= next_eval or step == total:
            t_e = time.perf_counter()
            acc = evaluate(ddp.module, ds)
            excluded += time.perf_counter() - t_e
            evals.append([clock, step * world, acc])
            next_eval = clock + a["eval_every"]
            if (acc >= a["target"] or clock > a["max_s"]) and stop_at.value > step + 1:
                # the all-reduce keeps every rank within one step of rank 0, so all of them
                # read this before they would start step + 1
                stop_at.value = step + 1
    return {
        "rank": rank,
        "steps": step,
        "evals": evals,
        "compute_ms": mark["compute"] / max(step, 1) * 1e3,
        "mb_per_s": step * world / (time.perf_counter() - started - excluded),
    }


class Ddp:
    """One DDP rank per device (default gpu0, gpu1, gpu2), kept for every DDP run; always
    reaped. ``job``: another model and data than the digits cnn, as ``{"model",
    "model_args", "data", "data_args", "n_layers"}`` (``data`` a name :func:`hetpipe.data.
    load_data` knows). ``hosts``: each device's host as ``(network namespace, address)``
    (:mod:`hetpipe.netns`), so the ranks' all-reduce crosses the hosts' shaped links; None
    runs every rank here on loopback."""

    def __init__(
        self,
        args: Any,
        speeds: dict[str, float],
        alone: float,
        devices: tuple[str, ...] = DDP_DEVICES,
        job: dict[str, Any] | None = None,
        hosts: dict[str, tuple[str, str]] | None = None,
    ) -> None:
        self.args, self.alone, self.devices = args, alone, devices
        self.n_layers = job["n_layers"] if job else N_LAYERS
        self.world = len(devices)
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.stop_at = ctx.Value("q", 1 << 62)
        self.lr_scale = float(self.world) if args.ddp_lr_scale is None else args.ddp_lr_scale
        a = {
            "lr": args.lr,
            "lr_scale": self.lr_scale,
            "momentum": args.momentum,
            "weight_decay": args.weight_decay,
            "minibatch": args.minibatch,
            "epochs": args.epochs,
            "eval_every": args.eval_every,
            "target": args.target,
            "max_s": args.max_s,
        }
        if job:
            a.update({k: v for k, v in job.items() if k != "n_layers"})
        port = free_port()
        master = hosts[devices[0]][1] if hosts else "127.0.0.1"
        self.cmds = [ctx.Queue() for _ in devices]
        self.procs = [
            ctx.Process(
                target=_ddp_rank,
                daemon=True,
                name=f"ddp{r}",
                args=(
                    r,
                    self.world,
                    port,
                    speeds[dev],
                    a,
                    self.cmds[r],
                    self.stop_at,
                    self.results,
                    (hosts[dev][0] if hosts else None, master),
                ),
            )
            for r, dev in enumerate(devices)
        ]

    def start(self) -> Ddp:
        try:
            for p in self.procs:
                p.start()
        except BaseException:
            self.stop()
            raise
        return self

    def run(self, seed: int) -> dict[str, Any]:
        pids = [p.pid for p in self.procs]
        cpu0, t0 = cpu_seconds(pids), time.perf_counter()
        self.stop_at.value = 1 << 62
        for q in self.cmds:
            q.put(seed)
        got: dict[int, dict[str, Any]] = {}
        while len(got) < self.world:
            try:
                r = self.results.get(True, WAIT_S)
            except queue.Empty:
                raise TimeoutError(f"DDP ranks did not finish within {WAIT_S:g} s") from None
            if "error" in r:
                raise RuntimeError(f"DDP rank {r['rank']} failed: {r['error']}")
            got[r["rank"]] = r
        cpu, wall = cpu_seconds(pids) - cpu0, time.perf_counter() - t0
        evals = got[0]["evals"]
        hit = next((e for e in evals if e[2] >= self.args.target), None)
        return {
            "seconds": hit[0] if hit else None,
            "minibatches": hit[1] if hit else None,
            "curve": [[round(s, 2), n, round(acc, 3)] for s, n, acc in evals],
            "stages": [
                {
                    "device": self.devices[r],
                    "layers": f"0:{self.n_layers}",
                    "compute_ms": got[r]["compute_ms"],
                    "inflation": got[r]["compute_ms"] / (self.alone * 1e3),
                }
                for r in sorted(got)
            ],
            "mb_per_s": got[0]["mb_per_s"],
            "cpu_cores": cpu / wall,
            "cpu_ms_per_mb": cpu / (got[0]["steps"] * self.world) * 1e3,
        }

    def stop(self) -> None:
        for q in self.cmds:
            q.put(None)
        deadline = time.monotonic() + 10
        for p in self.procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


# --------------------------------------------------------------------------- main


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median time to target (a run that missed it counts as infinite) and the median run."""
    secs = [r["seconds"] if r["seconds"] is not None else math.inf for r in runs]
    med = median(secs)
    order = sorted(range(len(runs)), key=lambda i: secs[i])
    mid = runs[order[len(order) // 2]]
    inflation: dict[str, list[float]] = {}
    for st in (s for r in runs for s in r["stages"]):
        inflation.setdefault(st["device"], []).append(st["inflation"])
    return {
        "seconds_to_target": med if math.isfinite(med) else None,
        "runs": [None if math.isinf(s) else round(s, 2) for s in secs],
        "minibatches_to_target": [r["minibatches"] for r in runs],
        "median_run_curve": mid["curve"],
        "mb_per_s": round(median([r["mb_per_s"] for r in runs]), 1),
        "cpu_cores": round(median([r["cpu_cores"] for r in runs]), 2),
        "cpu_ms_per_mb": round(median([r["cpu_ms_per_mb"] for r in runs]), 2),
        "inflation": {d: round(median(v), 2) for d, v in inflation.items()},
    }


def ideal(args: Any, speeds: dict[str, float], alone: dict[str, float]) -> dict[str, Any]:
    """Minibatches/s each side would reach with every device on a core of its own and free
    communication (from the compute measured alone), and the real cores that would take."""
    vws = [
        [("gpu0", 0, args.split0[0]), ("gpu3", args.split0[0], N_LAYERS)],
        [("gpu1", 0, args.split1[0]), ("gpu2", args.split1[0], N_LAYERS)],
    ]
    # under WSP with a finite D every VW runs, in the long run, at the slowest VW's pace
    pace = min(1.0 / max(alone[f"{a}:{b}"] / speeds[d] for d, a, b in vw) for vw in vws)
    het_cores = sum(pace * alone[f"{a}:{b}"] for vw in vws for _d, a, b in vw)
    full = alone[f"0:{N_LAYERS}"]
    ddp_rate = len(DDP_DEVICES) / max(full / speeds[d] for d in DDP_DEVICES)
    return {
        "hetpipe_mb_per_s": round(pace * len(vws), 1),
        "hetpipe_cores": round(het_cores, 2),
        "ddp_mb_per_s": round(ddp_rate, 1),
        "ddp_cores": round(ddp_rate * full, 2),
        "hetpipe_alone_ms_per_mb": round(het_cores / pace / len(vws) * 1e3, 2),
        "ddp_alone_ms_per_mb": round(full * 1e3, 2),
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--target", type=float, default=0.95, help="test accuracy to reach")
    ap.add_argument("--epochs", type=int, default=30, help="cap on data passes, both sides")
    ap.add_argument(
        "--max-s",
        type=float,
        default=None,
        help="cap on seconds per run (default 30 / speed scale)",
    )
    ap.add_argument(
        "--speed-scale",
        type=float,
        default=0.25,
        help="global scale of every emulated device's speed, both sides: slow "
        "enough that the host's cores do not saturate (see host cpu)",
    )
    ap.add_argument("--repeats", type=int, default=7, help="runs per way (median), seeds differ")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 2], help="WSP D values")
    ap.add_argument("--lr", type=float, default=0.05, help="per-minibatch learning rate")
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument(
        "--ddp-lr-scale",
        type=float,
        default=None,
        help="DDP steps with lr x this on averaged gradients (default: its W ranks)",
    )
    ap.add_argument("--minibatch", type=int, default=32)
    ap.add_argument("--nm", type=int, default=4)
    ap.add_argument("--split0", type=int, nargs=2, default=[8, 8], help="layers of gpu0, gpu3")
    ap.add_argument("--split1", type=int, nargs=2, default=[7, 9], help="layers of gpu1, gpu2")
    ap.add_argument("--eval-every", type=float, default=0.25, help="seconds between evals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cluster", default=str(ROOT / "cluster.toml"))
    args = ap.parse_args()
    if sum(args.split0) != N_LAYERS or sum(args.split1) != N_LAYERS:
        ap.error(f"--split0 and --split1 must each sum to the model's {N_LAYERS} layers")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if not 0 < args.speed_scale <= 1:
        ap.error("--speed-scale must be in (0, 1]")
    if args.max_s is None:
        args.max_s = 30.0 / args.speed_scale
    torch.set_num_threads(1)
    speeds = {d.name: d.speed * args.speed_scale for d in load_cluster(args.cluster).devices}
    started = time.perf_counter()
    ranges = {
        (0, args.split0[0]),
        (args.split0[0], N_LAYERS),
        (0, args.split1[0]),
        (args.split1[0], N_LAYERS),
        (0, N_LAYERS),
    }
    alone = measure_alone(sorted(ranges), args.minibatch)
    ways = [f"hetpipe D={d}" for d in args.staleness] + ["DDP"]
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory(prefix="bench-conv-") as tmp:
        het = Hetpipe(args, speeds, alone, Path(tmp)).start()
        ddp = None
        try:
            ddp = Ddp(args, speeds, alone[f"0:{N_LAYERS}"]).start()
            host = HostCpu().start()
            for i in range(args.repeats):  # interleaved: drifting load hits every way alike
                seed = args.seed + i
                for d in args.staleness:
                    runs[f"hetpipe D={d}"].append(het.run(d, seed))
                runs["DDP"].append(ddp.run(seed))
            host_cpu = host.stop()
        finally:
            if ddp is not None:
                ddp.stop()
            het.stop()
    wall = time.perf_counter() - started
    summary = {w: summarize(r) for w, r in runs.items()}

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    print(
        f"time to {args.target:.0%} test accuracy: cnn on digits, minibatch {args.minibatch} "
        f"per process, SGD lr {args.lr} per minibatch (constant; DDP {args.lr} x "
        f"{ddp.lr_scale if ddp else 0:g} on averaged gradients), momentum {args.momentum}, "
        f"weight decay {args.weight_decay}; evaluations every {args.eval_every:g} s; median of "
        f"{args.repeats} seeds; {machine()['cores']} real cores shared by every device"
    )
    rows = []
    for w in ways:
        s = summary[w]
        if w == "DDP":
            conf = f"gpu0, gpu1, gpu2 (W={len(DDP_DEVICES)})"
        else:
            conf = f"gpu0+gpu3 {args.split0} | gpu1+gpu2 {args.split1}, Nm {args.nm}"
        hits = [m for m in s["minibatches_to_target"] if m is not None]
        rows.append(
            [
                w,
                conf,
                fmt(s["seconds_to_target"]),
                " ".join(fmt(x) for x in s["runs"]),
                round(median(hits)) if hits else "-",
            ]
        )
    print_table(["way", "devices", "s to target", "runs (s)", "minibatches"], rows)
    print("median run's curve (seconds:accuracy):")
    for w in ways:
        curve = summary[w]["median_run_curve"]
        print(f"  {w}: " + " ".join(f"{s:.1f}:{acc:.2f}" for s, _n, acc in curve))
    print("compute inflation (measured in the run / fastest alone on one core, median):")
    for w in ways:
        print(f"  {w}: " + ", ".join(f"{d} x{v:.2f}" for d, v in summary[w]["inflation"].items()))
    model = ideal(args, speeds, alone)
    print(
        "throughput, minibatches/s: measured hetpipe "
        + ", ".join(f"D={d} {summary[f'hetpipe D={d}']['mb_per_s']:.0f}" for d in args.staleness)
        + f", DDP {summary['DDP']['mb_per_s']:.0f}; uncontended model (compute alone, free "
        f"communication): hetpipe {model['hetpipe_mb_per_s']:.0f} needing "
        f"{model['hetpipe_cores']:.2f} cores, DDP {model['ddp_mb_per_s']:.0f} needing "
        f"{model['ddp_cores']:.2f} cores (this host: {os.cpu_count()})"
    )
    print(
        "CPU of each side's processes over a run (daemons or ranks, evaluations included): "
        + ", ".join(
            f"{w} {summary[w]['cpu_cores']:.2f} cores, {summary[w]['cpu_ms_per_mb']:.1f} ms per "
            "minibatch"
            for w in ways
        )
        + f"; compute alone per minibatch: hetpipe {model['hetpipe_alone_ms_per_mb']:.1f} ms, "
        f"DDP {model['ddp_alone_ms_per_mb']:.1f} ms"
    )
    reached = {d: summary[f"hetpipe D={d}"]["seconds_to_target"] for d in args.staleness}
    reached = {d: s for d, s in reached.items() if s is not None}
    best_d = min(reached, key=lambda d: reached[d]) if reached else None
    ddp_s = summary["DDP"]["seconds_to_target"]
    speedup = ddp_s / reached[best_d] if best_d is not None and ddp_s is not None else None
    if speedup is not None:
        print(
            f"speedup_vs_ddp {speedup:.2f} (DDP {ddp_s:.2f} s / hetpipe D={best_d} "
            f"{reached[best_d]:.2f} s)"
        )
    else:
        print("speedup_vs_ddp: n/a (a side missed the target; raise --epochs or --max-s)")
    print(
        f"host cpu utilisation over the runs: {host_cpu:.2f} (speed scale {args.speed_scale}; "
        "near 1.0 the figures measure this host's contention, not the cluster modelled)"
    )
    print(f"total {wall:.1f} s")
    if args.json:
        emit_json(
            {
                "bench": "convergence",
                "machine": machine(),
                "target": args.target,
                "model": "cnn",
                "data": "digits",
                "minibatch": args.minibatch,
                "lr": args.lr,
                "ddp_lr": args.lr * (ddp.lr_scale if ddp else 0),
                "lr_semantics": "constant, no warm-up; every minibatch contributes lr x its "
                "gradient (hetpipe sums the VWs' updates; DDP steps lr x W on averaged gradients)",
                "momentum": args.momentum,
                "weight_decay": args.weight_decay,
                "nm": args.nm,
                "split0": args.split0,
                "split1": args.split1,
                "eval_every_s": args.eval_every,
                "eval_time": "hetpipe: evaluations run beside training, counted; DDP: rank 0 "
                "pauses to evaluate, not counted",
                "clock_start": "hetpipe: the head starts the job (launch counted); DDP: after "
                "process group and model are up",
                "repeats": args.repeats,
                "ways": summary,
                "best_staleness": best_d,
                "hetpipe_seconds_to_target": reached.get(best_d) if best_d is not None else None,
                "ddp_seconds_to_target": ddp_s,
                "speedup_vs_ddp": speedup,
                "speed_scale": args.speed_scale,
                "host_cpu": host_cpu,
                "alone_ms": {k: round(v * 1e3, 2) for k, v in alone.items()},
                "uncontended_model": model,
                "seconds": wall,
            }
        )


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
