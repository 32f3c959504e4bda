"""Training throughput of one 4-stage virtual worker on CPU: hetpipe vs torch.distributed.pipelining.

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

    python scripts/bench_pipeline.py [--json] [--minibatches N] [--microbatch B] [--model cnn]

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

from _bench import emit_json, free_port, machine, parser, print_table
from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml

STAGES = 4
NM = 4  # minibatches in flight (ours) = microbatches per schedule step (torch)
# model -> (builder args, data, layers per stage); splits balance the measured stage times
MODELS: dict[str, tuple[dict[str, Any], str, list[int]]] = {
    "cnn": ({"width": 64}, "digits", [3, 1, 3, 9]),
    "mlp": ({"hidden": [1024] * 5}, "digits", [5, 2, 2, 3]),
}
LR, MOMENTUM, SEED = 0.05, 0.9, 0
HOST = "127.0.0.1"


def job_dict(model: str, minibatch: int, minibatches: int) -> dict[str, Any]:
    """The job both sides run, in the job file's shape."""
    args, data, split = MODELS[model]
    return {
        "name": f"bench-{model}",
        "model": {"name": model, "args": args},
        "data": {"name": data},
        "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM, "weight_decay": 0.0},
        "train": {"minibatch": minibatch, "nm": NM, "staleness": 0, "seed": SEED,
                  "minibatches": minibatches},
        "vw": [{"devices": [f"gpu{i}" for i in range(STAGES)], "layers": split}],
    }


# --------------------------------------------------------------------------- ours


def run_ours(job: dict[str, Any], warmup: int, shards: int) -> dict[str, Any]:
    """Run the job on a local cluster; steady-state samples/s from stage 0's records."""
    minibatch = job["train"]["minibatch"]
    n = job["train"]["minibatches"]
    with tempfile.TemporaryDirectory(prefix="hetpipe-bench-") as tmp:
        root = Path(tmp)
        path = root / "cluster.toml"
        devices = [DeviceDef(f"gpu{i}", "fast", "1GiB", 1.0) for i in range(STAGES)]
        path.write_text(cluster_toml(devices, shards=shards))
        with LocalCluster(path, root / "run", timeout=60) as cluster:
            t0 = time.perf_counter()
            info = cluster.submit(job, timeout=900)
            wall = time.perf_counter() - t0
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
    for s in range(STAGES):
        st = stages[f"vw0/stage{s}"]["stats"]
        per_stage.append({"stage": s, "forward_s": st["forward_s"], "backward_s": st["backward_s"],
                          "elapsed_s": st["elapsed_s"]})
    return {
        "samples_per_s": (n - warmup) * minibatch / (t_end - t_start),
        "job_samples_per_s": info["samples_per_s"],
        "job_seconds": info["seconds"],
        "submit_to_done_s": wall,
        "window_s": t_end - t_start,
        "stages": per_stage,
    }


# --------------------------------------------------------------------------- torch


def _torch_rank(rank: int, job: dict[str, Any], port: int, warmup: int, out_path: str) -> None:
    """One stage of the torch.distributed.pipelining run (a spawned process)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from hetpipe.data import MinibatchStream, load_dataset
    from hetpipe.models import build_model, cross_entropy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank,
                            world_size=STAGES)
    try:
        torch.manual_seed(SEED)
        model = build_model(job["model"]["name"], job["model"]["args"])
        split = job["vw"][0]["layers"]
        first = sum(split[:rank])
        part = model[first:first + split[rank]]
        part.train()
        stage = PipelineStage(part, rank, STAGES, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=NM, loss_fn=cross_entropy)
        opt = torch.optim.SGD(part.parameters(), lr=LR, momentum=MOMENTUM)
        train = job["train"]
        stream = None
        if rank in (0, STAGES - 1):
            data = load_dataset(job["data"]["name"], job["data"].get("args"))
            stream = MinibatchStream(data, train["minibatch"], train["seed"])
        steps = train["minibatches"] // NM
        t_start = t_end = 0.0
        for step in range(steps):
            if stream is not None:
                batches = [stream.batch(step * NM + i) for i in range(NM)]
                x = torch.cat([b[0] for b in batches])
                y = torch.cat([b[1] for b in batches])
            if rank == 0:
                schedule.step(x)
            elif rank == STAGES - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
            opt.step()
            opt.zero_grad()
            if (step + 1) * NM == warmup:
                t_start = time.perf_counter()
        t_end = time.perf_counter()
        if rank == 0:
            Path(out_path).write_text(json.dumps({"t_start": t_start, "t_end": t_end}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_torch(job: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Four spawned processes on gloo; steady-state samples/s measured at rank 0."""
    import torch.multiprocessing as tmp_mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    minibatch = job["train"]["minibatch"]
    n = job["train"]["minibatches"] // NM * NM
    with tempfile.TemporaryDirectory(prefix="hetpipe-bench-") as tmp:
        out_path = str(Path(tmp) / "torch.json")
        t0 = time.perf_counter()
        ctx = tmp_mp.start_processes(_torch_rank, args=(job, free_port(HOST), warmup, out_path),
                                     nprocs=STAGES, join=False, start_method="spawn")
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
        times = json.loads(Path(out_path).read_text())
    window = times["t_end"] - times["t_start"]
    return {"samples_per_s": (n - warmup) * minibatch / window, "window_s": window,
            "spawn_to_done_s": wall}


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", choices=sorted(MODELS), default="cnn")
    ap.add_argument("--minibatches", type=int, default=400,
                    help="minibatches per side (a multiple of 4)")
    ap.add_argument("--microbatch", type=int, default=32,
                    help="our minibatch size = torch's microbatch size")
    ap.add_argument("--warmup", type=int, default=40,
                    help="minibatches left out of the count (a multiple of 4)")
    ap.add_argument("--shards", type=int, default=1, help="parameter-server shards (ours)")
    args = ap.parse_args()
    if args.minibatches % NM or args.warmup % NM or not 0 < args.warmup < args.minibatches:
        ap.error(f"--minibatches and --warmup must be multiples of {NM}, warmup < minibatches")
    torch.set_num_threads(1)
    job = job_dict(args.model, args.microbatch, args.minibatches)
    ours = run_ours(job, args.warmup, args.shards)
    theirs = run_torch(job, args.warmup)
    ratio = ours["samples_per_s"] / theirs["samples_per_s"]

    cfg = MODELS[args.model]
    print(f"one virtual worker, {STAGES} stages {cfg[2]} of {args.model} {cfg[0]} on "
          f"{cfg[1]}, minibatch {args.microbatch}, {NM} in flight, {args.minibatches} "
          f"minibatches ({args.warmup} warm-up), 1 thread per stage, "
          f"{machine()['cores']} cores")
    print_table(["side", "samples/s", "window s", "whole run s"], [
        ["hetpipe", ours["samples_per_s"], ours["window_s"], ours["submit_to_done_s"]],
        ["torch 1F1B", theirs["samples_per_s"], theirs["window_s"], theirs["spawn_to_done_s"]],
    ])
    print(f"ratio ours / torch.distributed.pipelining: {ratio:.3f}  "
          f"(head's figure for the whole job: {ours['job_samples_per_s']:.1f} samples/s "
          f"over {ours['job_seconds']:.1f} s)")
    print_table(["stage", "forward s", "backward s", "busy %"], [
        [s["stage"], s["forward_s"], s["backward_s"],
         100.0 * (s["forward_s"] + s["backward_s"]) / s["elapsed_s"]] for s in ours["stages"]
    ])
    if args.json:
        emit_json({
            "bench": "pipeline", "machine": machine(), "model": args.model,
            "model_args": cfg[0], "data": cfg[1], "split": cfg[2],
            "minibatch": args.microbatch, "nm": NM, "minibatches": args.minibatches,
            "warmup": args.warmup, "shards": args.shards,
            "ours_samples_per_s": ours["samples_per_s"],
            "ours_job_samples_per_s": ours["job_samples_per_s"],
            "torch_samples_per_s": theirs["samples_per_s"],
            "ratio_vs_torch_pipelining": ratio,
            "ratio_job_vs_torch_pipelining": ours["job_samples_per_s"] / theirs["samples_per_s"],
            "ours_stages": ours["stages"],
        })


if __name__ == "__main__":
    main()
