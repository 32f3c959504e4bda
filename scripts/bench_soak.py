#!/usr/bin/env python
"""Soak: one long job on a local cluster, watching each daemon's memory and message sizes.

The builtin mlp as one stage on one emulated device, minibatch 1, ``--minibatches`` of them
(a million by default: what a weeks-long job looks like to the runtime's bookkeeping, per
minibatch records and spans, in an hour or so), with ``heartbeat_s = 0.5`` and
``lost_after_s = 3``. Figures:

- ``rss_growth_mb``: the largest growth of any daemon's resident memory from the moment the
  job has done 10 % of its minibatches to its end (target <= 50): nothing kept per
  minibatch may pile up on the head, a shard or a worker;
- ``largest_message_mib``: the largest message any daemon sent (every frame counted, target
  <= 16), measured by a hook on :meth:`hetpipe.sockio.SocketIO.send` that the daemons load
  through ``sitecustomize`` (``HETPIPE_SOAK_DIR``);
- ``job_dir_mib``: the size of the job's directory at the end, and ``job_dir_bounded_mib``
  the part of it that ``[runtime] job_dir_max_bytes`` bounds (all but checkpoints and models,
  :func:`hetpipe.jobdir.bounded_bytes`), at the end and at its largest while the job ran
  (``job_dir_bounded_peak_mib``), against the limit (``job_dir_limit_mib``; ``--job-dir-max``
  lowers it); ``records_summarised``: the minibatches each stage's records summarise.

``--minibatches 3000`` runs in well under a minute; ``tests/test_soak.py`` runs it that way.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _bench import emit_json, machine, parser, print_table

from hetpipe.config import parse_size
from hetpipe.core.keys import CLUSTER
from hetpipe.jobdir import bounded_bytes
from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml

ROOT = Path(__file__).resolve().parents[1]

TARGET_RSS_MB = 50.0
TARGET_MESSAGE_MIB = 16.0
WARM = 0.10  # RSS is measured from this share of the job's minibatches

# Loaded by every daemon (PYTHONPATH): record the largest message this process sends in
# <HETPIPE_SOAK_DIR>/<pid>.json, rewritten whenever it grows (rare).
HOOK = """
import json, os
_dir = os.environ.get("HETPIPE_SOAK_DIR")
if _dir:
    from hetpipe import sockio, wire
    _send = sockio.SocketIO.send
    _most = [0]

    async def send(self, frames, **kw):
        n = wire.frames_nbytes(frames)
        if n > _most[0]:
            _most[0] = n
            path = os.path.join(_dir, f"{os.getpid()}.json")
            with open(path + ".tmp", "w") as f:
                json.dump({"pid": os.getpid(), "bytes": n}, f)
            os.replace(path + ".tmp", path)
        return await _send(self, frames, **kw)

    sockio.SocketIO.send = send
"""


def rss_mb(pid: int) -> float | None:
    """Resident memory of ``pid`` in MB (``/proc/<pid>/status``), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def dir_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def soak(
    minibatches: int,
    timeout_s: float,
    max_frame: str | None = None,
    job_dir_max: str | None = None,
) -> dict[str, Any]:
    """Run the job (``max_frame``: the cluster's ``[runtime] max_frame_bytes``, lowered to
    show that no message grows with the job; ``job_dir_max``: its ``job_dir_max_bytes``,
    lowered to show the job directory's bound); return its figures."""
    limit = job_dir_max or CLUSTER.default("runtime.job_dir_max_bytes")
    with tempfile.TemporaryDirectory(prefix="hetpipe-soak-") as tmp:
        root = Path(tmp)
        hooks = root / "hooks"
        sizes = root / "sizes"
        hooks.mkdir()
        sizes.mkdir()
        (hooks / "sitecustomize.py").write_text(HOOK)
        os.environ["HETPIPE_SOAK_DIR"] = str(sizes)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(hooks), str(ROOT), os.environ.get("PYTHONPATH")])
        )
        path = root / "cluster.toml"
        text = cluster_toml(
            [DeviceDef("gpu0", "fast", "1GiB", 1.0)], shards=1, heartbeat_s=0.5, lost_after_s=3.0
        )
        if max_frame is not None:
            text = text.replace("[runtime]\n", f'[runtime]\nmax_frame_bytes = "{max_frame}"\n')
        if job_dir_max is not None:
            text = text.replace("[runtime]\n", f'[runtime]\njob_dir_max_bytes = "{job_dir_max}"\n')
        path.write_text(text)
        job = {
            "name": "soak",
            "model": {"name": "mlp"},
            "data": {"name": "digits"},
            "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
            "train": {"minibatch": 1, "nm": 1, "minibatches": minibatches, "staleness": 0},
            "vw": [{"devices": ["gpu0"], "layers": [6]}],
        }
        samples: dict[str, list[tuple[float, float]]] = {}  # daemon -> (done share, MB)
        progress = [0.0]
        peak = [0]  # the largest bounded part of the job's directory seen
        stop = threading.Event()

        with LocalCluster(path, root / "run", timeout=120) as c:
            pids = {name: p.pid for name, p in c.procs.items()}

            jobs = c.run_dir / "jobs"

            def watch() -> None:
                while not stop.wait(0.5):
                    for name, pid in pids.items():
                        mb = rss_mb(pid)
                        if mb is not None:
                            samples.setdefault(name, []).append((progress[0], mb))
                    for d in jobs.glob("*") if jobs.exists() else ():
                        peak[0] = max(peak[0], bounded_bytes(d))

            async def go() -> dict[str, Any]:
                async with c.client(timeout=30) as client:
                    job_id = await client.submit(job)
                    deadline = time.monotonic() + timeout_s
                    while True:
                        info = await client.job(job_id)
                        total = info.get("total") or minibatches
                        progress[0] = (info.get("minibatches") or 0) / total
                        if info["state"] in ("done", "failed", "cancelled"):
                            return info
                        if time.monotonic() > deadline:
                            await client.cancel(job_id)
                            raise TimeoutError(f"job not done after {timeout_s:.0f} s: {info}")
                        await asyncio.sleep(0.5)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            t0 = time.monotonic()
            try:
                info = LocalCluster.run(go())
            finally:
                stop.set()
                watcher.join()
            seconds = time.monotonic() - t0
            job_dir = c.run_dir / "jobs" / info["id"]
            job_size = dir_mib(job_dir) if job_dir.exists() else 0.0
            bounded = bounded_bytes(job_dir) if job_dir.exists() else 0
            peak[0] = max(peak[0], bounded)

        growth = {}
        for name, rows in samples.items():
            warm = [mb for share, mb in rows if share >= WARM]
            if warm:
                growth[name] = max(warm) - warm[0]
        largest = max((json.loads(f.read_text())["bytes"] for f in sizes.glob("*.json")), default=0)
    return {
        "minibatches": minibatches,
        "max_frame_bytes": max_frame,
        "state": info["state"],
        "error": info.get("error"),
        "seconds": round(seconds, 1),
        "minibatches_per_s": round(minibatches / seconds, 1),
        "rss_growth_mb": round(max(growth.values(), default=0.0), 2),
        "rss_growth_mb_by_daemon": {k: round(v, 2) for k, v in sorted(growth.items())},
        "largest_message_mib": round(largest / 2**20, 4),
        "job_dir_mib": round(job_size, 3),
        "job_dir_bounded_mib": round(bounded / 2**20, 3),
        "job_dir_bounded_peak_mib": round(peak[0] / 2**20, 3),
        "job_dir_limit_mib": round(parse_size(limit) / 2**20, 3),
        "job_dir_max_bytes": limit,
        "records_summarised": {
            k: v.get("count") for k, v in (info.get("records_summarised") or {}).items()
        },
        "targets": {
            "rss_growth_mb": TARGET_RSS_MB,
            "largest_message_mib": TARGET_MESSAGE_MIB,
            "job_dir_bounded_peak_mib": round(parse_size(limit) / 2**20, 3),
        },
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--minibatches", type=int, default=1_000_000, help="the job's length")
    ap.add_argument("--timeout", type=float, default=6 * 3600, help="give up after (s)")
    ap.add_argument("--max-frame", default=None, help='[runtime] max_frame_bytes, e.g. "1MiB"')
    ap.add_argument("--job-dir-max", default=None, help='[runtime] job_dir_max_bytes, e.g. "16MiB"')
    args = ap.parse_args()
    figures = soak(args.minibatches, args.timeout, args.max_frame, args.job_dir_max)
    rows = [
        [
            "job",
            f"{figures['state']} ({figures['minibatches']} minibatches, {figures['seconds']} s)",
        ],
        [
            "rss growth (MB, largest daemon)",
            f"{figures['rss_growth_mb']} (target <= {TARGET_RSS_MB:g})",
        ],
        *[[f"  {k}", v] for k, v in figures["rss_growth_mb_by_daemon"].items()],
        [
            "largest message (MiB)",
            f"{figures['largest_message_mib']} (target <= {TARGET_MESSAGE_MIB:g})",
        ],
        ["job directory (MiB)", figures["job_dir_mib"]],
        [
            "  bounded part, end / peak (MiB)",
            f"{figures['job_dir_bounded_mib']} / {figures['job_dir_bounded_peak_mib']} "
            f"(limit {figures['job_dir_limit_mib']:g})",
        ],
        *[[f"  {k}: minibatches summarised", v] for k, v in figures["records_summarised"].items()],
    ]
    print_table(["figure", "value"], rows)
    if args.json:
        emit_json({**figures, "machine": machine()})
    if figures["state"] != "done":
        sys.exit(f"soak job {figures['state']}: {figures['error']}")


if __name__ == "__main__":
    main()
