"""What checkpoints cost and how fast a job resumes from one, on real daemons on this host.

A :class:`hetpipe.localcluster.LocalCluster` of two unslowed emulated devices and two shards
runs the same job (cnn on digits, one 2-stage virtual worker) twice, interleaved ``--repeats``
times: without checkpoints (``checkpoint_every = 0``) and at the default interval. Figures:

- ``checkpoint_overhead``: the head's time spent fetching the global weights and writing
  checkpoints, as a share of the job's training time (the direct cost; the target is <= 0.03);
- ``slowdown``: (training time with checkpoints) / (without) - 1, medians (noisy on a busy
  host: the direct cost above is the steadier figure);
- ``resume_s``: from ``submit --resume`` of the checkpointed job to its first minibatch
  trained again (checkpoint read and verified, plan, weights to the shards, stages started).

    python scripts/bench_checkpoint.py [--json] [--repeats N] [--minibatches N]
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench import emit_json, machine, median, parser, print_table

from hetpipe.job import JobSpec
from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml, free_ports

DEFAULT_EVERY = JobSpec.__dataclass_fields__["checkpoint_every"].default


def _job(name: str, every: int, minibatches: int) -> dict[str, Any]:
    return {"name": name, "model": {"name": "cnn", "args": {}}, "data": {"name": "digits"},
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
            "train": {"minibatch": 32, "nm": 2, "staleness": 0, "seed": 0,
                      "minibatches": minibatches, "checkpoint_every": every},
            "vw": [{"devices": ["gpu0", "gpu1"], "layers": [8, 8]}]}


async def _resume(c: LocalCluster, job_id: str) -> tuple[float, dict[str, Any]]:
    async with c.client(timeout=30.0) as head:
        t0 = time.monotonic()
        new_id = await head.submit(None, resume=job_id)
        first = None
        while True:
            info = await head.job(new_id)
            if first is None and info.get("minibatches", 0) > 0:
                first = time.monotonic() - t0
            if info["state"] in ("done", "failed", "cancelled"):
                break
            await asyncio.sleep(0.02)
        assert info["state"] == "done", info.get("error")
        return first if first is not None else time.monotonic() - t0, info


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each way (median)")
    ap.add_argument("--minibatches", type=int, default=600, help="per run")
    args = ap.parse_args()
    every = DEFAULT_EVERY
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    resumes: list[tuple[float, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = root / "cluster.toml"
        path.write_text(cluster_toml([DeviceDef("gpu0"), DeviceDef("gpu1")],
                                     shard_ports=free_ports(2)))
        with LocalCluster(path, root / "run", timeout=120) as c:
            for i in range(args.repeats):
                for way, n in (("off", 0), ("on", every)):
                    info = c.submit(_job(f"{way}{i}", n, args.minibatches), timeout=600)
                    assert info["state"] == "done", info.get("error")
                    runs[way].append(info)
                resumes.append(c.run(_resume(c, runs["on"][-1]["id"])))
    off = median([r["seconds"] for r in runs["off"]])
    on = median([r["seconds"] for r in runs["on"]])
    overhead = median([r["checkpoint_s"] / r["seconds"] for r in runs["on"]])
    per_ckpt = median([r["checkpoint_s"] / max(1, r["checkpoints"]) for r in runs["on"]])
    resume_s = median([s for s, _ in resumes])
    count = median([r["checkpoints"] for r in runs["on"]])
    print(f"checkpoints of a cnn job ({args.minibatches} minibatches, 2 stages, 2 shards) "
          f"every {every} waves; median of {args.repeats} ({machine()['cores']} cores)")
    print_table(["way", "train s", "checkpoints", "checkpoint s", "share of train"],
                [["off", off, 0, 0.0, 0.0],
                 [f"every {every}", on, count, overhead * on, overhead]])
    print(f"checkpoint_overhead {overhead:.4f} (target <= 0.03), {per_ckpt * 1e3:.1f} ms per "
          f"checkpoint; slowdown {on / off - 1:+.3f}; resume_s {resume_s:.2f} "
          f"(submit --resume to the first minibatch trained again)")
    if args.json:
        emit_json({"checkpoint_overhead": overhead, "checkpoint_ms": per_ckpt * 1e3,
                   "checkpoints": count, "train_s_off": off, "train_s_on": on,
                   "slowdown": on / off - 1, "resume_s": resume_s, "every_waves": every,
                   "machine": machine()})


if __name__ == "__main__":
    main()
