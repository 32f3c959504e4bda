"""Training throughput of one 4-stage virtual worker on CPU: ours vs torch.distributed.pipelining.

Both sides train the same ``nn.Sequential`` (same builder, same seed), cut into the same four
contiguous stages, one process per stage with one intra-op thread each, on this host:

- ``ours``: a :class:`hetpipe.localcluster.LocalCluster` of four unslowed emulated devices
  (speed 1.0, 1 GiB each) and its parameter-server shard(s); one job, one virtual worker,
  ``nm = 4`` minibatches in flight, WSP D = 0 (a single VW never waits on the server).
- ``torch``: ``torch.distributed.pipelining`` with ``Schedule1F1B`` over gloo on 127.0.0.1,
  ``n_microbatches = 4`` and microbatch size = our minibatch, so one schedule step runs four
  microbatches, as many as ours has in flight; cross entropy, SGD with momentum stepped after
  every schedule step (ours steps after every minibatch: that is HetPipe's local update).

Throughput is counted the same way on both sides: samples per second between the end of the
warm-up (the first ``--warmup`` minibatches) and the end of the run, each measured at stage 0
when the backward of the last minibatch of the window finishes there. The head's own figure
for the whole job (start-up and first pull included) is printed too.

Each side runs ``--rounds`` times, the sides alternating (ours, torch, torch, ours, ...), and
the median run of each side is reported: other processes on a small shared host move single
runs by tens of percent. CPU seconds per sample (all processes of a side) are printed as well,
and ours split by thread kind (compute threads, event loops, ZeroMQ I/O, parameter server).

    python scripts/bench_pipeline.py [--json] [--minibatches N] [--microbatch B] [--model cnn]
                                     [--rounds R]

With ``--json`` the last line is one JSON object with both figures and
``ratio_vs_torch_pipelining`` (ours / torch, steady state).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _bench import emit_json, free_port, machine, parser, print_table, retain_freed_as_daemons

from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml

STAGES = 4
NM = 4  # minibatches in flight (ours) = microbatches per schedule step (torch)
# model -> (builder args, data, layers per stage); splits balance the measured stage times
MODELS: dict[str, tuple[dict[str, Any], str, list[int]]] = {
    "cnn": ({"width": 64}, "digits", [3, 1, 4, 8]),
    "mlp": ({"hidden": [1024] * 5}, "digits", [5, 2, 2, 3]),
}
LR, MOMENTUM, SEED = 0.05, 0.9, 0
HOST = "127.0.0.1"


def job_dict(
    model: str, minibatch: int, minibatches: int, schedule: str = "async"
) -> dict[str, Any]:
    """The job both sides run, in the job file's shape (``schedule``: ours; torch runs
    ``Schedule1F1B``, or ``ScheduleGPipe`` for ``gpipe``)."""
    args, data, split = MODELS[model]
    return {
        "name": f"bench-{model}",
        "model": {"name": model, "args": args},
        "data": {"name": data},
        "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM, "weight_decay": 0.0},
        "train": {
            "minibatch": minibatch,
            "nm": NM,
            "seed": SEED,
            "minibatches": minibatches,
            "schedule": schedule,
            **({"staleness": 0} if schedule == "async" else {}),  # WSP's D: async only
        },
        "vw": [{"devices": [f"gpu{i}" for i in range(STAGES)], "layers": split}],
    }


# --------------------------------------------------------------------------- ours


def run_ours(
    job: dict[str, Any],
    warmup: int,
    shards: int,
    curve: bool = True,
    host_shm: bool = True,
    inline_ms: int | None = None,
) -> dict[str, Any]:
    """Run the job on a local cluster; steady-state samples/s from stage 0's records.
    ``curve``: the daemons speak CurveZMQ (the default; False: ``[security] curve = false``,
    plaintext like gloo); ``host_shm``: activations and gradients between the stages (all on
    this host) go through shared memory (the default; False: ``[runtime] host_shm = false``,
    every byte through the sockets); ``inline_ms``: ``[runtime] inline_ms`` (None: the
    default; 0: every compute on the compute thread)."""
    minibatch = job["train"]["minibatch"]
    n = job["train"]["minibatches"]
    with tempfile.TemporaryDirectory(prefix="hetpipe-bench-") as tmp:
        root = Path(tmp)
        path = root / "cluster.toml"
        stage_devices = job["vw"][0]["devices"]  # a device named twice runs both stages
        devices = [DeviceDef(d, "fast", "1GiB", 1.0) for d in dict.fromkeys(stage_devices)]
        path.write_text(
            cluster_toml(
                devices, shards=shards, curve=curve, host_shm=host_shm, inline_ms=inline_ms
            )
        )
        with LocalCluster(path, root / "run", timeout=60) as cluster:
            cpu0 = {name: _cpu_s(p.pid) for name, p in cluster.procs.items()}
            threads0 = {name: _thread_cpu_s(p.pid) for name, p in cluster.procs.items()}
            t0 = time.perf_counter()
            info = cluster.submit(job, timeout=900)
            wall = time.perf_counter() - t0
            cpu = {name: _cpu_s(p.pid) - cpu0[name] for name, p in cluster.procs.items()}
            by_kind = _by_kind(cluster.procs, threads0)
            if info.get("state") != "done":
                raise RuntimeError(f"our job ended {info.get('state')}: {info.get('error')}")
            stages = json.loads(Path(info["stages_path"]).read_text())
    recs = {}
    for where, r in stages.items():
        fields = r["stats"]["record_fields"]
        recs[where] = [dict(zip(fields, row, strict=True)) for row in r["records"]]
    first = recs["vw0/stage0"]
    t_start, t_end = first[warmup - 1]["t_bwd"], first[n - 1]["t_bwd"]
    per_stage = []
    for s in range(len(stage_devices)):
        st = stages[f"vw0/stage{s}"]["stats"]
        per_stage.append(
            {
                "stage": s,
                "forward_s": st["forward_s"],
                "backward_s": st["backward_s"],
                "elapsed_s": st["elapsed_s"],
            }
        )
    return {
        "samples_per_s": (n - warmup) * minibatch / (t_end - t_start),
        # whole job (start-up included), every daemon: an upper bound of the steady cost
        "cpu_ms_per_sample": 1e3 * sum(cpu.values()) / (n * minibatch),
        "cpu_s": cpu,
        "cpu_s_by_thread": by_kind,
        "job_samples_per_s": info["samples_per_s"],
        "job_seconds": info["seconds"],
        "submit_to_done_s": wall,
        "window_s": t_end - t_start,
        "window": [t_start, t_end],  # wall clock (time.time) of the steady state
        "stages": per_stage,
    }


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds of each thread of a process: {tid: (thread name, seconds)}."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (name, (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def _by_kind(procs: dict[str, Any], before: dict[str, dict[int, tuple[str, float]]]) -> dict:
    """Our daemons' CPU seconds over the job by what runs it: the workers' compute threads,
    their event loops (main thread), ZeroMQ I/O threads, and the parameter-server processes."""
    kinds = {"compute": 0.0, "event_loop": 0.0, "zmq_io": 0.0, "ps": 0.0}
    for name, proc in procs.items():
        for tid, (comm, secs) in _thread_cpu_s(proc.pid).items():
            used = secs - before[name].get(tid, (comm, 0.0))[1]
            if not name.startswith("worker-"):
                kinds["ps"] += used
            elif comm.startswith("ZMQbg"):
                kinds["zmq_io"] += used
            elif tid == proc.pid:
                kinds["event_loop"] += used
            else:
                kinds["compute"] += used
    return kinds


# --------------------------------------------------------------------------- torch


# torch.distributed.pipelining's schedule for each kind this benchmark compares with; the
# last three run several stages per process (``placement``)
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv-zero-bubble": "ScheduleZBVZeroBubble",
}


def _torch_rank(
    rank: int,
    job: dict[str, Any],
    port: int,
    warmup: int,
    out_path: str,
    retain_freed: bool,
    placement: list[int],
    kind: str,
) -> None:
    """The stages of one process of the torch.distributed.pipelining run (a spawned
    process): stage ``s`` runs on rank ``placement[s]``, under ``TORCH_SCHEDULES[kind]``."""
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage

    from hetpipe.data import MinibatchStream, load_dataset
    from hetpipe.models import build_model, cross_entropy

    if retain_freed:
        retain_freed_as_daemons()
    torch.set_num_threads(1)
    world = max(placement) + 1
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(SEED)
        model = build_model(job["model"]["name"], job["model"]["args"])
        split = job["vw"][0]["layers"]
        n_stages = len(split)
        mine = [s for s, r in enumerate(placement) if r == rank]
        parts, stages = [], []
        for s in mine:
            first = sum(split[:s])
            part = model[first : first + split[s]]
            part.train()
            parts.append(part)
            stages.append(PipelineStage(part, s, n_stages, torch.device("cpu")))
        cls = getattr(pipelining, TORCH_SCHEDULES[kind])
        several = len(placement) > world  # the multi-stage schedules take a list of stages
        schedule = cls(stages if several else stages[0], n_microbatches=NM, loss_fn=cross_entropy)
        params = [p for part in parts for p in part.parameters()]
        opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
        train = job["train"]
        stream = None
        feeds, scores = 0 in mine, n_stages - 1 in mine
        if feeds or scores:
            data = load_dataset(job["data"]["name"], job["data"].get("args"))
            stream = MinibatchStream(data, train["minibatch"], train["seed"])
        steps = train["minibatches"] // NM
        t_start = wall_start = 0.0
        cpu_start = time.process_time()  # from the first step: warm-up included, as ours
        for step in range(steps):
            if stream is not None:
                batches = [stream.batch(step * NM + i) for i in range(NM)]
                x = torch.cat([b[0] for b in batches])
                y = torch.cat([b[1] for b in batches])
            if feeds and scores:  # a V: the first and the last stage in one process
                schedule.step(x, target=y, losses=[])
            elif feeds:
                schedule.step(x)
            elif scores:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
            opt.step()
            opt.zero_grad()
            if (step + 1) * NM == warmup:
                t_start, wall_start = time.perf_counter(), time.time()
        t_end, cpu = time.perf_counter(), time.process_time() - cpu_start
        Path(f"{out_path}.{rank}").write_text(
            json.dumps(
                {
                    "t_start": t_start,
                    "t_end": t_end,
                    "cpu_s": cpu,
                    "window": [wall_start, time.time()],
                }
            )
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_torch(
    job: dict[str, Any],
    warmup: int,
    retain_freed: bool = False,
    placement: list[int] | None = None,
    kind: str | None = None,
) -> dict[str, Any]:
    """Spawned processes on gloo, one per rank of ``placement`` (stage -> rank; default one
    stage each); steady-state samples/s measured at rank 0. ``kind``: a key of
    :data:`TORCH_SCHEDULES` (default: the job's schedule, 1F1B unless it is gpipe).
    ``retain_freed``: each keeps freed memory as our daemons do (:mod:`hetpipe.hostmem`,
    the runtime's default), not glibc's defaults."""
    placement = placement or list(range(len(job["vw"][0]["layers"])))
    kind = kind or ("gpipe" if job["train"].get("schedule") == "gpipe" else "1f1b")
    world = max(placement) + 1
    import torch.multiprocessing as tmp_mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    minibatch = job["train"]["minibatch"]
    n = job["train"]["minibatches"] // NM * NM
    with tempfile.TemporaryDirectory(prefix="hetpipe-bench-") as tmp:
        out_path = str(Path(tmp) / "torch.json")
        t0 = time.perf_counter()
        ctx = tmp_mp.start_processes(
            _torch_rank,
            args=(job, free_port(HOST), warmup, out_path, retain_freed, placement, kind),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        try:
            while not ctx.join():
                pass
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
        wall = time.perf_counter() - t0
        ranks = [json.loads(Path(f"{out_path}.{r}").read_text()) for r in range(world)]
    window = ranks[0]["t_end"] - ranks[0]["t_start"]
    return {
        "samples_per_s": (n - warmup) * minibatch / window,
        "window_s": window,
        "window": ranks[0]["window"],  # wall clock (time.time) of the steady state
        "spawn_to_done_s": wall,
        "cpu_ms_per_sample": 1e3 * sum(r["cpu_s"] for r in ranks) / (n * minibatch),
        "cpu_s": [r["cpu_s"] for r in ranks],
    }


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", choices=sorted(MODELS), default="cnn")
    ap.add_argument(
        "--minibatches", type=int, default=400, help="minibatches per side (a multiple of 4)"
    )
    ap.add_argument(
        "--microbatch", type=int, default=32, help="our minibatch size = torch's microbatch size"
    )
    ap.add_argument(
        "--warmup", type=int, default=40, help="minibatches left out of the count (a multiple of 4)"
    )
    ap.add_argument("--shards", type=int, default=1, help="parameter-server shards (ours)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="run each side this many times, alternating (ABBA...), report the median run",
    )
    args = ap.parse_args()
    if args.minibatches % NM or args.warmup % NM or not 0 < args.warmup < args.minibatches:
        ap.error(f"--minibatches and --warmup must be multiples of {NM}, warmup < minibatches")
    torch.set_num_threads(1)
    job = job_dict(args.model, args.microbatch, args.minibatches)
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "torch": []}
    for r in range(args.rounds):
        order = ("ours", "torch") if r % 2 == 0 else ("torch", "ours")
        for side in order:
            if side == "ours":
                runs[side].append(run_ours(job, args.warmup, args.shards))
            else:
                runs[side].append(run_torch(job, args.warmup))
    # the run with the median throughput of each side (its other figures go with it)
    ours, theirs = (
        sorted(runs[k], key=lambda x: x["samples_per_s"])[len(runs[k]) // 2]
        for k in ("ours", "torch")
    )
    ratio = ours["samples_per_s"] / theirs["samples_per_s"]

    cfg = MODELS[args.model]
    print(
        f"one virtual worker, {STAGES} stages {cfg[2]} of {args.model} {cfg[0]} on "
        f"{cfg[1]}, minibatch {args.microbatch}, {NM} in flight, {args.minibatches} "
        f"minibatches ({args.warmup} warm-up), 1 thread per stage, "
        f"{machine()['cores']} cores, median of {args.rounds} run(s) per side"
    )
    print_table(
        ["side", "samples/s", "window s", "CPU ms/sample", "all runs samples/s"],
        [
            [
                "hetpipe",
                ours["samples_per_s"],
                ours["window_s"],
                ours["cpu_ms_per_sample"],
                " ".join(f"{x['samples_per_s']:.0f}" for x in runs["ours"]),
            ],
            [
                "torch 1F1B",
                theirs["samples_per_s"],
                theirs["window_s"],
                theirs["cpu_ms_per_sample"],
                " ".join(f"{x['samples_per_s']:.0f}" for x in runs["torch"]),
            ],
        ],
    )
    print(
        f"ratio ours / torch.distributed.pipelining: {ratio:.3f}  "
        f"(head's figure for the whole job: {ours['job_samples_per_s']:.1f} samples/s "
        f"over {ours['job_seconds']:.1f} s)"
    )
    print(
        "CPU ms/sample: every process of a side, from the job's submission (ours) or the first"
        " step (torch) to the end, warm-up included"
    )
    kinds = ours["cpu_s_by_thread"]
    total = sum(kinds.values()) or 1.0
    print(
        "our CPU by thread: "
        + ", ".join(f"{k} {v:.2f} s ({100 * v / total:.0f}%)" for k, v in kinds.items())
        + f"; torch's 4 ranks: {sum(theirs['cpu_s']):.2f} s"
    )
    print_table(
        ["our stage", "forward s", "backward s", "compute % of run"],
        [
            [
                s["stage"],
                s["forward_s"],
                s["backward_s"],
                100.0 * (s["forward_s"] + s["backward_s"]) / s["elapsed_s"],
            ]
            for s in ours["stages"]
        ],
    )
    if args.json:
        emit_json(
            {
                "bench": "pipeline",
                "machine": machine(),
                "model": args.model,
                "model_args": cfg[0],
                "data": cfg[1],
                "split": cfg[2],
                "minibatch": args.microbatch,
                "nm": NM,
                "minibatches": args.minibatches,
                "warmup": args.warmup,
                "shards": args.shards,
                "rounds": args.rounds,
                "ours_samples_per_s": ours["samples_per_s"],
                "ours_job_samples_per_s": ours["job_samples_per_s"],
                "torch_samples_per_s": theirs["samples_per_s"],
                "ratio_vs_torch_pipelining": ratio,
                "ratio_job_vs_torch_pipelining": ours["job_samples_per_s"]
                / theirs["samples_per_s"],
                "ours_runs": [x["samples_per_s"] for x in runs["ours"]],
                "torch_runs": [x["samples_per_s"] for x in runs["torch"]],
                "ours_cpu_ms_per_sample": ours["cpu_ms_per_sample"],
                "torch_cpu_ms_per_sample": theirs["cpu_ms_per_sample"],
                "ours_cpu_s": ours["cpu_s"],
                "ours_cpu_s_by_thread": ours["cpu_s_by_thread"],
                "torch_cpu_s": theirs["cpu_s"],
                "ours_stages": ours["stages"],
            }
        )


if __name__ == "__main__":
    main()
