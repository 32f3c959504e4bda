"""Would deferring weight-gradient steps fill the asynchronous pipeline's bubbles? Measured.

The zero-bubble schedules split a backward into the input gradient (I), sent upstream at once,
and the weights' gradient (W), run later where a stage would otherwise idle. In the
asynchronous (HetPipe) pipeline of one virtual worker this would take W off the round trip
of a minibatch: the first stage admits minibatch ``p + Nm`` once ``p``'s backward is back,
so a shorter round trip raises the rate where ``Nm`` minibatches do not fill the pipeline.
Deferral only moves work inside a stage; it never removes any.

This benchmark runs one virtual worker on a mixed cluster of emulated devices, one stage per
device of ``--speeds`` (a fixed split of the builtin ``mlp``, one hidden layer per stage),
under ``schedule = "async"`` at each ``Nm`` of ``--nm`` and measures, in the steady state
(after ``--warmup`` minibatches):

- ``rate``: minibatches per second at the first stage;
- per stage, its work per minibatch ``D`` (forward + backward with the local step, padded to
  the device's speed, from the stage's own spans) and its sends.

The Nm minibatches in flight circulate through the stages as in a closed queueing network,
whose rate is bounded by ``bound(Nm, path) = min(1 / max D, Nm / path)``, ``path`` being a
minibatch's own work and sends along the pipeline (the run's ``rate_vs_bound`` says how
close the runtime comes). Deferring W leaves every stage's work ``D`` as it is and takes
``W`` (the weight-gradient part of each backward: 1 - the schedule's input-gradient share,
:data:`hetpipe.core.schedule.INPUT_GRAD_SHARE`) off the path. So, per ``Nm``:

- ``deferral_gain``: ``bound(Nm, path - W) / bound(Nm, path)``, the most deferral can gain;
- ``nm_plus_one_gain``: ``bound(Nm + 1, path) / bound(Nm, path)``, the gain of one more
  minibatch in flight instead. A deferred W keeps its minibatch's saved tensors and weight
  version until it runs, about one more minibatch's memory on each stage, so this is the
  alternative at about the same memory; ``nm_plus_one_measured`` is the measured ratio of
  the runs at ``Nm + 1`` and ``Nm``.

``deferral_wins`` holds at an ``Nm`` where the deferral gain beats both 1 and the gain of one
more minibatch in flight by more than ``--margin``.

With ``--defer`` each ``Nm`` also runs with ``train.defer_weight_grad = true`` (right after
its run without, so both see about the same load on the host), and
``measured_deferral_gain`` is the measured rate with deferral over the rate without.

    python scripts/bench_async_deferral.py [--json] [--nm 1 2 3 4] [--speeds 1 .7 .5 .35]
                                           [--minibatches N] [--defer]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from _bench import emit_json, machine, parser, print_table

from hetpipe.core.schedule import INPUT_GRAD_SHARE
from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml


def job(k: int, nm: int, minibatches: int, minibatch: int, defer: bool = False) -> dict[str, Any]:
    """The asynchronous job of ``k`` stages at ``nm`` minibatches in flight: the mlp with one
    ``Linear``/``ReLU`` pair of width 1024 per stage (the first also flattens, the last also
    holds the classifier); ``defer``: with ``train.defer_weight_grad``."""
    return {
        "name": f"deferral-k{k}-nm{nm}",
        "model": {"name": "mlp", "args": {"hidden": [1024] * k}},
        "data": {"name": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "train": {
            "minibatch": minibatch,
            "nm": nm,
            "seed": 0,
            "minibatches": minibatches,
            "schedule": "async",
            "staleness": 0,
            "defer_weight_grad": defer,
        },
        "vw": [{"devices": [f"gpu{i}" for i in range(k)], "layers": [3, *[2] * (k - 2), 3]}],
    }


def measure(stages: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Rate, per-stage work and sends, and the weight-gradient time of a finished job's
    ``stages.json``."""
    first = stages["vw0/stage0"]
    fields = first["stats"]["record_fields"]
    rows = sorted(
        (dict(zip(fields, row, strict=True)) for row in first["records"]), key=lambda r: r["p"]
    )
    steady = rows[warmup:]
    rate = (len(steady) - 1) / (steady[-1]["t_bwd"] - steady[0]["t_bwd"])
    n = len(rows)
    timing = [s["stats"]["timing"] for k, s in sorted(stages.items()) if k.startswith("vw0/")]
    work = [(t["forward"] + t["backward"]) / n for t in timing]
    sends = sum(t["send"] for t in timing) / n
    return {
        "rate": rate,
        "stage_work_s": work,
        "path_s": sum(work) + sends,
        "weight_grad_s": (1 - INPUT_GRAD_SHARE) * sum(t["backward"] for t in timing) / n,
    }


def bound(nm: int, path: float, bottleneck: float) -> float:
    """The closed pipeline's rate bound: the bottleneck stage's, or Nm round trips of
    ``path``."""
    return min(1 / bottleneck, nm / path)


def run(
    nm: int,
    speeds: list[float],
    minibatches: int,
    minibatch: int,
    warmup: int,
    defer: bool = False,
) -> dict:
    """One job on a fresh local cluster of the emulated devices."""
    with tempfile.TemporaryDirectory(prefix="hetpipe-deferral-") as tmp:
        root = Path(tmp)
        devices = [DeviceDef(f"gpu{i}", f"t{i}", "1GiB", speed) for i, speed in enumerate(speeds)]
        (root / "cluster.toml").write_text(cluster_toml(devices, shards=1))
        with LocalCluster(root / "cluster.toml", root / "run", timeout=60) as cluster:
            spec = job(len(speeds), nm, minibatches, minibatch, defer)
            info = cluster.submit(spec, timeout=900)
            if info.get("state") != "done":
                raise RuntimeError(f"nm {nm}: the job ended {info.get('state')}: {info}")
            stages = json.loads(Path(info["stages_path"]).read_text())
    return measure(stages, warmup)


def derive(runs: dict[int, dict[str, Any]], margin: float) -> dict[int, dict[str, Any]]:
    """Per Nm: the bounds' gains of deferral and of one more minibatch, and the verdict."""
    out = {}
    for nm, r in runs.items():
        top = max(r["stage_work_s"])
        now = bound(nm, r["path_s"], top)
        deferral = bound(nm, r["path_s"] - r["weight_grad_s"], top) / now
        plus_one = bound(nm + 1, r["path_s"], top) / now
        nxt = runs.get(nm + 1)
        out[nm] = {
            **r,
            "rate_vs_bound": r["rate"] / now,
            "deferral_gain": deferral,
            "nm_plus_one_gain": plus_one,
            "nm_plus_one_measured": nxt["rate"] / r["rate"] if nxt else None,
            "deferral_wins": deferral > 1 + margin and deferral > plus_one * (1 + margin),
        }
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--nm", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument(
        "--speeds", type=float, nargs="+", default=[1.0, 0.7, 0.5, 0.35], help="one per stage"
    )
    ap.add_argument("--minibatches", type=int, default=240)
    ap.add_argument("--minibatch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--defer", action="store_true", help="also run each Nm with deferral on")
    args = ap.parse_args()
    runs, deferred = {}, {}
    for nm in sorted(set(args.nm)):
        runs[nm] = run(nm, args.speeds, args.minibatches, args.minibatch, args.warmup)
        if args.defer:
            deferred[nm] = run(
                nm, args.speeds, args.minibatches, args.minibatch, args.warmup, defer=True
            )
    figures = derive(runs, args.margin)
    for nm, d in deferred.items():
        figures[nm]["deferred"] = d
        figures[nm]["measured_deferral_gain"] = d["rate"] / runs[nm]["rate"]
    print_table(
        ["Nm", "rate/s", "of bound", "deferral gain", "Nm+1 gain", "Nm+1 measured"]
        + (["deferred rate/s", "measured deferral gain"] if deferred else []),
        [
            [
                nm,
                f"{f['rate']:.2f}",
                f"{f['rate_vs_bound']:.2f}",
                f"{f['deferral_gain']:.2f}",
                f"{f['nm_plus_one_gain']:.2f}",
                "-" if f["nm_plus_one_measured"] is None else f"{f['nm_plus_one_measured']:.2f}",
            ]
            + (
                [f"{f['deferred']['rate']:.2f}", f"{f['measured_deferral_gain']:.2f}"]
                if deferred
                else []
            )
            for nm, f in figures.items()
        ],
    )
    wins = [nm for nm, f in figures.items() if f["deferral_wins"]]
    print(f"deferral wins at Nm {wins}" if wins else "deferral wins at no Nm measured")
    if args.json:
        emit_json(
            {
                "machine": machine(),
                "args": vars(args),
                "per_nm": {str(k): v for k, v in figures.items()},
                "deferral_wins_at": wins,
            }
        )


if __name__ == "__main__":
    main()
