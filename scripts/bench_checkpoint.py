"""What checkpoints cost and how fast a job resumes from one, on real daemons on this host.

A :class:`hetpipe.localcluster.LocalCluster` of two unslowed emulated devices and two shards
runs the same job (cnn on digits, one 2-stage virtual worker) twice, interleaved ``--repeats``
times: without checkpoints (``checkpoint_every = 0``) and at the default interval. A
checkpoint holds the shards' cut of the global weights and every stage's state (local
weights, optimizer state, data position). Figures:

- ``checkpoint_overhead``: (the head's time fetching the shards' cuts and writing the
  checkpoints + the stages' time taking their state, the slowest stage per checkpoint) as a
  share of the job's training time (the direct cost; the target is <= 0.03). The head's
  part runs beside the training (it waits for the cut and writes on its own thread); the
  stages' part holds their pipeline up;
- ``slowdown``: (training time with checkpoints) / (without) - 1, medians (noisy on a busy
  host: the direct cost above is the steadier figure);
- ``resume_s``: a checkpointed job is cancelled once it wrote two checkpoints, then resumed:
  from ``submit --resume`` to its first minibatch trained again (checkpoint read and
  verified, plan, the cut to the shards, stages started from their states).

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
    return {
        "name": name,
        "model": {"name": "cnn", "args": {}},
        "data": {"name": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
        "train": {
            "minibatch": 32,
            "nm": 2,
            "staleness": 0,
            "seed": 0,
            "minibatches": minibatches,
            "checkpoint_every": every,
        },
        "vw": [{"devices": ["gpu0", "gpu1"], "layers": [8, 8]}],
    }


async def _ended(head: Any, job_id: str) -> dict[str, Any]:
    while True:
        info = await head.job(job_id)
        if info["state"] in ("done", "failed", "cancelled"):
            return info
        await asyncio.sleep(0.05)


async def _resume(c: LocalCluster, job: dict[str, Any]) -> float:
    """Cancel ``job`` once it wrote two checkpoints; time its resume to the first minibatch
    trained again (the resumed job is cancelled then)."""
    async with c.client(timeout=30.0) as head:
        job_id = await head.submit(job)
        while True:
            info = await head.job(job_id)
            if info.get("checkpoints", 0) >= 2:
                break
            assert info["state"] in ("queued", "planning", "running"), info
            await asyncio.sleep(0.05)
        await head.cancel(job_id)
        await _ended(head, job_id)
        t0 = time.monotonic()
        new_id = await head.submit(None, resume=job_id)
        while True:
            info = await head.job(new_id)
            if info.get("minibatches", 0) > 0:
                first = time.monotonic() - t0
                break
            assert info["state"] in ("queued", "planning", "running"), info.get("error")
            await asyncio.sleep(0.02)
        await head.cancel(new_id)
        await _ended(head, new_id)
        return first


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each way (median)")
    ap.add_argument("--minibatches", type=int, default=600, help="per run")
    args = ap.parse_args()
    every = DEFAULT_EVERY
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    resumes: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = root / "cluster.toml"
        path.write_text(
            cluster_toml([DeviceDef("gpu0"), DeviceDef("gpu1")], shard_ports=free_ports(2))
        )
        with LocalCluster(path, root / "run", timeout=120) as c:
            for i in range(args.repeats):
                for way, n in (("off", 0), ("on", every)):
                    info = c.submit(_job(f"{way}{i}", n, args.minibatches), timeout=600)
                    assert info["state"] == "done", info.get("error")
                    runs[way].append(info)
                resumes.append(c.run(_resume(c, _job(f"cut{i}", every, args.minibatches))))
    off = median([r["seconds"] for r in runs["off"]])
    on = median([r["seconds"] for r in runs["on"]])

    def cost(r: dict[str, Any]) -> float:
        return r["checkpoint_s"] + r["checkpoint_stage_s"]

    overhead = median([cost(r) / r["seconds"] for r in runs["on"]])
    head_share = median([r["checkpoint_s"] / r["seconds"] for r in runs["on"]])
    stage_share = median([r["checkpoint_stage_s"] / r["seconds"] for r in runs["on"]])
    per_ckpt = median([cost(r) / max(1, r["checkpoints"]) for r in runs["on"]])
    resume_s = median(resumes)
    count = median([r["checkpoints"] for r in runs["on"]])
    print(
        f"checkpoints of a cnn job ({args.minibatches} minibatches, 2 stages, 2 shards) "
        f"every {every} waves; median of {args.repeats} ({machine()['cores']} cores)"
    )
    print_table(
        ["way", "train s", "checkpoints", "checkpoint s", "share of train"],
        [["off", off, 0, 0.0, 0.0], [f"every {every}", on, count, overhead * on, overhead]],
    )
    print(
        f"checkpoint_overhead {overhead:.4f} (target <= 0.03; head {head_share:.4f}, "
        f"stages {stage_share:.4f}), {per_ckpt * 1e3:.1f} ms per checkpoint; slowdown "
        f"{on / off - 1:+.3f}; resume_s {resume_s:.2f} (submit --resume to the first "
        f"minibatch trained again)"
    )
    if args.json:
        emit_json(
            {
                "checkpoint_overhead": overhead,
                "checkpoint_overhead_head": head_share,
                "checkpoint_overhead_stages": stage_share,
                "checkpoint_ms": per_ckpt * 1e3,
                "checkpoints": count,
                "train_s_off": off,
                "train_s_on": on,
                "slowdown": on / off - 1,
                "resume_s": resume_s,
                "every_waves": every,
                "machine": machine(),
            }
        )


if __name__ == "__main__":
    main()
