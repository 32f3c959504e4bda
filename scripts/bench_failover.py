"""What a lost worker costs a job that re-forms only its virtual worker.

On real daemons on this host, a :class:`hetpipe.localcluster.LocalCluster` of six uniform
emulated devices and two shards runs one job (mlp on digits; three virtual workers of two
devices each, layers 3 + 3, ``train.on_worker_loss = "reform"``) twice: undisturbed, then
with the worker of VW 1's second stage SIGKILLed once the job has trained ``--at``
minibatches. The head notices the loss after ``--lost-after`` s without a heartbeat
(``[runtime] lost_after_s``; heartbeats every ``--heartbeat`` s), takes VW 1 out of the
shards' clocks, and re-forms it on its surviving device from the shards' current weights
(:mod:`hetpipe.head.reform`). Figures, from the stages' per-minibatch records
(``stages.json``):

- ``others_paused_s``: the longest gap between two consecutive forwards of VW 0's or VW 2's
  last stage from the kill to their end (target: <= ``heartbeat_s`` + 1 s);
- ``lost_vw_back_s``: from the head's detection to the re-formed VW's first forward
  (target <= 10);
- ``samples_lost``: samples VW 1 had trained whose updates the shards did not hold, i.e.
  trained again (its last stage's minibatches before the kill, less the re-formed VW's
  data position), against its in-flight minibatches (Nm) x minibatch;
- ``accuracy`` of both runs (the killed one's target: the undisturbed one's, within 0.02).

Then a third run of the same job (``train.checkpoint_every`` = ``--every`` waves): parameter-
server shard 1 is SIGKILLed once the job has a checkpoint and has trained ``--at``
minibatches, and started again ``--shard-down`` s later (as its supervisor would, on a new
port). The job pauses and resumes by itself from its last cut (:mod:`hetpipe.head.shardwait`):
``shard_resumed`` (the same job ends done, nobody resubmitted it; target: true),
``shard_paused_s`` (the head's wait for the shard), ``shard_minibatches_redone`` (trained
before the kill and again after it, back to the cut) and ``accuracy_shard_killed``.

    python scripts/bench_failover.py [--json] [--minibatches N] [--at N] [--staleness D]
                                     [--heartbeat S] [--lost-after S] [--lr LR]
                                     [--speed-scale S] [--every W] [--shard-down S]
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench import HostCpu, emit_json, machine, parser, print_table

from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml

VICTIM = "gpu3"  # VW 1's second stage
SPLIT = (("gpu0", "gpu1"), ("gpu2", "gpu3"), ("gpu4", "gpu5"))
NM = 2
MINIBATCH = 32


def _job(name: str, minibatches: int, staleness: int, lr: float) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"name": "mlp"},
        "data": {"name": "digits"},
        "optimizer": {"name": "sgd", "lr": lr, "momentum": 0.9, "weight_decay": 1e-4},
        "train": {
            "minibatch": MINIBATCH,
            "minibatches": minibatches,
            "nm": NM,
            "staleness": staleness,
            "seed": 0,
            "on_worker_loss": "reform",
        },
        "vw": [{"devices": list(d), "layers": [3, 3]} for d in SPLIT],
    }


def _records(info: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """Each stage's per-minibatch records, by (vw, stage)."""
    out = {}
    for where, r in json.loads(Path(info["stages_path"]).read_text()).items():
        vw, stage = (int(x.lstrip("vwstage")) for x in where.split("/"))
        fields = r["stats"]["record_fields"]
        out[(vw, stage)] = [dict(zip(fields, row, strict=True)) for row in r["records"]]
    return out


def _retried(c: LocalCluster, spec: dict[str, Any], kill_at: int | None) -> dict[str, Any]:
    """:func:`_run`, once more where the run failed for a worker the head took for lost
    before the job trained (a loaded host can delay a heartbeat past ``--lost-after``); the
    retry is counted in the figures. A failure that names the killed worker is never retried."""
    info = c.run(_run(c, spec, kill_at))
    error = info.get("error") or ""
    named = kill_at is not None and f"worker {VICTIM}" in error  # the kill's own outcome
    if info["state"] != "done" and "no heartbeat" in error and not named:
        if not c.alive(f"worker-{VICTIM}"):
            c.restart(f"worker-{VICTIM}")
        c.run(_whole(c))
        again = c.run(_run(c, {**spec, "name": spec["name"] + "-again"}, kill_at))
        again["_retried"] = info.get("error")
        return again
    return info


async def _whole(c: LocalCluster, timeout: float = 60) -> None:
    """Until every worker is registered and idle again."""
    want = {d.name for d in c.cluster.devices}
    async with c.client() as head:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = await head.cluster()
            if {w["device"] for w in status["workers"] if w["state"] == "idle"} == want:
                return
            await asyncio.sleep(0.2)


async def _until(head: Any, job_id: str, reached: Any) -> dict[str, Any]:
    """The job's status once ``reached(status)``; fails where the job ends first or does not
    get there within 300 s."""
    deadline = time.monotonic() + 300
    while True:
        info = await head.job(job_id)
        assert info["state"] in ("queued", "planning", "running"), info.get("error")
        if reached(info):
            return info
        assert time.monotonic() < deadline, "the job did not get to the kill"
        await asyncio.sleep(0.05)


async def _run(c: LocalCluster, spec: dict[str, Any], kill_at: int | None) -> dict[str, Any]:
    """Run ``spec``; SIGKILL the victim once ``kill_at`` minibatches are trained."""
    async with c.client() as head:
        job_id = await head.submit(spec)
        killed = None
        if kill_at is not None:
            await _until(head, job_id, lambda i: i.get("minibatches", 0) >= kill_at)
            c.kill(f"worker-{VICTIM}", signal.SIGKILL)
            killed = time.time()
        info = await head.follow(job_id, every_s=0.2, timeout=600)
        info["_killed"] = killed
        return info


async def _shard_run(
    c: LocalCluster, spec: dict[str, Any], at: int, down_s: float
) -> tuple[str, dict[str, Any], int]:
    """Run ``spec``; SIGKILL shard 1 once the job has a checkpoint and ``at`` minibatches,
    start it again ``down_s`` s later; the job's id, its final status and the minibatches
    it had trained at the kill."""
    async with c.client() as head:
        job_id = await head.submit(spec)
        info = await _until(
            head, job_id, lambda i: i.get("checkpoints", 0) >= 1 and i.get("minibatches", 0) >= at
        )
        trained = sum(info["positions"])
        c.kill("ps1", signal.SIGKILL)
        await asyncio.sleep(down_s)
        c.restart("ps1")  # its supervisor starts it again: port 0, another address
        return job_id, await head.follow(job_id, every_s=0.2, timeout=600), trained


def shard_figures(job_id: str, info: dict[str, Any], trained: int) -> dict[str, Any]:
    """The shard-killed run's figures from its status."""
    waits = info.get("shard_waits") or []
    pause = waits[0] if waits else {}
    cut = sum(pause.get("checkpoint_positions") or [])
    return {
        "shard_resumed": info["state"] == "done" and info["id"] == job_id and len(waits) == 1,
        "shard_state": info["state"],
        "shard_error": info.get("error"),
        "shard_paused_s": round(pause["waited_s"], 3) if pause else None,
        "shard_minibatches_redone": max(0, trained - cut) if pause else None,
        "accuracy_shard_killed": info.get("test_accuracy"),
    }


def figures(info: dict[str, Any], heartbeat: float) -> dict[str, Any]:
    """The killed run's figures from its status and records."""
    killed = info["_killed"]
    records = _records(info)
    last = {v: len(SPLIT[v]) - 1 for v in range(len(SPLIT))}
    paused = 0.0
    for v in (0, 2):
        times = sorted(r["t_fwd"] for r in records[(v, last[v])])
        after = [t for t in times if t >= killed]
        before = [t for t in times if t < killed]
        series = ([before[-1]] if before else []) + after
        gaps = [b - a for a, b in itertools.pairwise(series)]
        paused = max([paused, *gaps])
    (reform,) = info["reforms"]
    new = [r["t_fwd"] for r in records[(1, 0)] if r["t_fwd"] > reform["detected_at"]]
    back = min(new) - reform["detected_at"] if new else None
    # how far the old VW 1 had trained: its stages' records before the kill (the chunks
    # they streamed; an aborted stage's last one may be missing) or, where further, the
    # furthest progress report the head had (``trained_to``)
    old = [r for s in range(len(SPLIT[1])) for r in records.get((1, s), []) if r["t_fwd"] < killed]
    trained = max(1 + max((r["p"] for r in old), default=-1), reform["trained_to"])
    redone = max(0, trained - reform["restart_at"])
    return {
        "others_paused_s": round(paused, 3),
        "others_paused_target_s": heartbeat + 1.0,
        "lost_vw_back_s": round(back, 3) if back is not None else None,
        "detection_s": round(reform["detected_at"] - killed, 3),
        "detected_as": reform["reason"],
        "reform_started_s": reform["started_s"],
        "samples_lost": redone * MINIBATCH,
        "samples_lost_target": NM * MINIBATCH,
        "restart_at": reform["restart_at"],
        "trained_before_kill": trained,
        "wave_offsets": reform["wave_offsets"],
        "reformed_on": reform["devices"],
        "positions": info["positions"],
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--minibatches", type=int, default=300, help="per virtual worker")
    ap.add_argument("--at", type=int, default=150, help="job minibatches before the kill")
    ap.add_argument("--staleness", type=int, default=4, help="WSP's D")
    ap.add_argument("--heartbeat", type=float, default=0.25, help="[runtime] heartbeat_s")
    ap.add_argument("--lost-after", type=float, default=1.0, help="[runtime] lost_after_s")
    ap.add_argument("--lr", type=float, default=0.02, help="SGD's learning rate")
    ap.add_argument("--speed-scale", type=float, default=1.0, help="every device's speed")
    ap.add_argument("--every", type=int, default=10, help="checkpoint_every (shard run)")
    ap.add_argument("--shard-down", type=float, default=2.0, help="s before shard 1 restarts")
    args = ap.parse_args()
    devices = [DeviceDef(f"gpu{i}", "fast", "256MiB", args.speed_scale) for i in range(6)]
    cpu = HostCpu()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = root / "cluster.toml"
        toml = cluster_toml(devices, heartbeat_s=args.heartbeat, lost_after_s=args.lost_after)
        # every record streamed at once: an aborted stage's last ones say how far it got
        path.write_text(toml.replace("[runtime]\n", "[runtime]\nrecords_every = 1\n", 1))
        with LocalCluster(path, root / "run", timeout=180) as c:
            plain = _retried(
                c, _job("undisturbed", args.minibatches, args.staleness, args.lr), None
            )
            assert plain["state"] == "done", plain.get("error")
            cpu.start()
            c.run(_whole(c))
            hit = _retried(c, _job("killed", args.minibatches, args.staleness, args.lr), args.at)
            busy = cpu.stop()
            assert hit["state"] == "done", hit.get("error")
            out = figures(hit, args.heartbeat)  # from its records, before they are gone
            c.restart(f"worker-{VICTIM}")  # its supervisor's restart: the cluster whole again
            c.run(_whole(c))
            spec = _job("shard-killed", args.minibatches, args.staleness, args.lr)
            spec["train"].update(checkpoint_every=args.every, shard_wait_s=120.0)
            out.update(shard_figures(*c.run(_shard_run(c, spec, args.at, args.shard_down))))
    out.update(
        accuracy_undisturbed=plain["test_accuracy"],
        accuracy_killed=hit["test_accuracy"],
        seconds_undisturbed=round(plain["seconds"], 2),
        seconds_killed=round(hit["seconds"], 2),
        host_cpu_busy=busy,
        retried={
            k: r["_retried"]
            for k, r in (("undisturbed", plain), ("killed", hit))
            if "_retried" in r
        },
        config={
            "minibatches_per_vw": args.minibatches,
            "kill_at": args.at,
            "staleness": args.staleness,
            "nm": NM,
            "heartbeat_s": args.heartbeat,
            "lost_after_s": args.lost_after,
            "speed_scale": args.speed_scale,
            "lr": args.lr,
            "victim": VICTIM,
            "checkpoint_every": args.every,
            "shard_down_s": args.shard_down,
        },
        machine=machine(),
    )
    out["targets"] = {
        "others_paused_s": out["others_paused_s"] <= out["others_paused_target_s"],
        "lost_vw_back_s": out["lost_vw_back_s"] is not None and out["lost_vw_back_s"] <= 10.0,
        "samples_lost": out["samples_lost"] <= out["samples_lost_target"],
        "accuracy": out["accuracy_killed"] >= out["accuracy_undisturbed"] - 0.02,
        "shard_resumed": out["shard_resumed"],
    }
    print_table(
        ["figure", "value", "target", "met"],
        [
            [
                "others_paused_s",
                out["others_paused_s"],
                f"<= {out['others_paused_target_s']}",
                out["targets"]["others_paused_s"],
            ],
            ["lost_vw_back_s", out["lost_vw_back_s"], "<= 10", out["targets"]["lost_vw_back_s"]],
            [
                "samples_lost",
                out["samples_lost"],
                f"<= {out['samples_lost_target']}",
                out["targets"]["samples_lost"],
            ],
            [
                "accuracy (killed)",
                out["accuracy_killed"],
                f">= {out['accuracy_undisturbed']:.3f} - 0.02",
                out["targets"]["accuracy"],
            ],
            ["detection_s", out["detection_s"], f"~ {args.lost_after}", ""],
            ["shard_resumed", out["shard_resumed"], "true", out["targets"]["shard_resumed"]],
            ["shard_paused_s", out["shard_paused_s"], "", ""],
            ["shard_minibatches_redone", out["shard_minibatches_redone"], "", ""],
            ["accuracy (shard killed)", out["accuracy_shard_killed"], "", ""],
        ],
    )
    if args.json:
        emit_json(out)


if __name__ == "__main__":
    main()
