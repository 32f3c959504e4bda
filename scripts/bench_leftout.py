"""Whether a device the planner leaves out of its virtual worker is one the job is faster
without: the plan's choice, its stated reason, and the measured throughput with and without.

On real daemons on this host, a :class:`hetpipe.localcluster.LocalCluster` of three emulated
devices on one node (:func:`devices`): two of one helpful type at speed ``--speed-scale``
and one of another type ``--slow-ratio`` times slower, so slow that any stage it runs (even
of the least layer, with the per-task costs its padding stretches too) is the slowest of the
pipeline it joins (the "whimpy" GPU the heterogeneous planners leave out). The default ratio
leaves the plan's choice a wide margin: nearer where the plan starts leaving the device out,
the choice turns on a profile the head measured once on a loaded host (``--slow-ratio`` and
``--kept-ratio`` probe there). The job (cnn on digits, one virtual worker: ``train.vws =
1``) runs two ways, same model, data, optimizer, minibatches and seed:

- ``planned``: no ``[[vw]]`` split (policy ``auto``): the head profiles the model and plans;
  the plan must leave the slow device out, naming it with its reason
  (``info["predicted"]["left_out"]``: the predicted samples/s with and without it);
- ``forced``: ``[[vw]] devices`` naming all three devices (the slow one included), the
  planner cutting the layers and picking Nm for that order (:func:`hetpipe.planner.explicit
  .explicit_plan`): the plan the planner would make with the device.

With ``--kept-ratio R`` a second cluster, whose slow device is only ``R`` times slower, runs
the other way round: where its plan keeps the device, the other arm leaves it out
(``[[vw]] devices`` the plan's less it), which checks the planner's keeping of a device too.

A short warm-up job over all three devices comes first (the head profiles the model then,
and the workers pay their first-use costs). The two jobs then run ``--repeats`` times,
alternating. Measured samples/s come from each job's metrics.jsonl progress lines (the first
tenth left out as warm-up, the lines after the last minibatch's report left out as the tail).

The speeds are well below 1: an emulated device pads its compute thread's CPU time to
(CPU time) / speed, so slow devices keep the padding, not the host's contention for its
cores, setting their speed. Figures:

- ``left_out_ok``: the plan left the slow device out and its reason names it (target true);
- ``left_out_speedup_measured``: the median over runs of planned / forced measured samples/s
  (target >= 1.0);
- ``left_out_speedup_predicted``: the plan's own figures, without / with the device, beside
  the forced job's predicted samples/s (the explicit plan's figure);
- ``reason``: the plan's line for the device left out;
- ``kept_case`` (with ``--kept-ratio``): the same figures for the second cluster, its
  ``speedup_measured`` being planned (with the device) / without it.

    python scripts/bench_leftout.py [--json] [--minibatches N] [--repeats N]
                                    [--slow-ratio R] [--speed-scale S] [--kept-ratio R]
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench import HostCpu, emit_json, machine, median, parser, print_table

from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml

SLOW = "gpu2"
ALL = ("gpu0", "gpu1", SLOW)
SPEED_SCALE = 0.3  # the helpful devices' speed
SLOW_RATIO = 40.0  # how much slower the slow device is than the helpful ones
MINIBATCHES = 200  # per run of each job


def devices(scale: float = SPEED_SCALE, slow_ratio: float = SLOW_RATIO) -> list[DeviceDef]:
    """The benchmark's cluster: two devices of type ``fast`` at speed ``scale`` and one of
    type ``whimpy`` (:data:`SLOW`) ``slow_ratio`` times slower, all on one node, each on a
    port of its own choosing. A type of its own gives the slow device a profile of its own
    (the head measures a node's emulated devices once and scales by speed)."""
    return [
        DeviceDef("gpu0", "fast", "256MiB", scale),
        DeviceDef("gpu1", "fast", "256MiB", scale),
        DeviceDef(SLOW, "whimpy", "256MiB", scale / slow_ratio),
    ]


def job(name: str, minibatches: int, vw: list[str] | None) -> dict[str, Any]:
    """The job every run runs; ``vw``: the one virtual worker's devices (``[[vw]] devices``,
    the planner cutting the layers for that order), None leaves them to the planner too
    (``train.vws = 1``)."""
    out: dict[str, Any] = {
        "name": name,
        "model": {"name": "cnn"},
        "data": {"name": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.03, "momentum": 0.9, "weight_decay": 1e-4},
        "train": {"minibatch": 32, "minibatches": minibatches, "staleness": 0, "seed": 0},
    }
    if vw is not None:
        out["vw"] = [{"devices": list(vw)}]
    else:
        out["train"]["vws"] = 1
    return out


def plan_alone(
    cluster_file: Path, scale: float, slow_ratio: float, measured: dict[str, Any] | None = None
) -> Any:
    """The plan the head makes for the ``planned`` job on this cluster, made here without
    daemons: the model measured once on this host's CPU at speed 1 (:func:`hetpipe.measure
    .measure`), each type's times divided by its speed as an emulated device pads them, then
    :func:`hetpipe.profiling.plan_for` (the head's own planning call). ``measured``: a
    measurement made before (:func:`hetpipe.measure.measure`'s answer), reused."""
    import dataclasses

    from hetpipe.config import load_cluster
    from hetpipe.core.profile import CallProfile, LayerProfile, ModelProfile
    from hetpipe.job import JobSpec
    from hetpipe.measure import measure
    from hetpipe.profiling import plan_for

    cluster = load_cluster(cluster_file)
    spec = JobSpec.from_dict(job("planned", MINIBATCHES, None))
    one = dataclasses.replace(cluster.devices[0], speed=1.0)
    if measured is None:
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as a worker computes by default (hetpipe-worker --threads)
        try:
            measured = measure(spec, one)
        finally:
            torch.set_num_threads(threads)
    got = measured
    layers = [LayerProfile.from_dict(lp) for lp in got["layers"]]
    call = CallProfile.from_dict(got["call"])

    def slowed(speed: float) -> tuple[tuple[LayerProfile, ...], CallProfile]:
        return tuple(
            dataclasses.replace(
                lp, fwd_s=lp.fwd_s / speed, bwd_s=lp.bwd_s / speed, update_s=lp.update_s / speed
            )
            for lp in layers
        ), CallProfile(call.fwd_s / speed, call.bwd_s / speed, call.update_s / speed)

    speeds = {"fast": scale, "whimpy": scale / slow_ratio}
    per = {t: slowed(v) for t, v in speeds.items()}
    profile = ModelProfile(
        "cnn",
        spec.minibatch,
        int(got["input_bytes"]),
        {t: v[0] for t, v in per.items()},
        calls={t: v[1] for t, v in per.items()},
    )
    return plan_for(spec, cluster, profile)


def rate(info: dict[str, Any]) -> float:
    """Samples per second of a finished job from its metrics.jsonl progress lines: the first
    tenth left out as warm-up, and the lines at the last minibatch (the tail waits on the
    job's end)."""
    lines = [json.loads(x) for x in Path(info["metrics_path"]).read_text().splitlines()]
    lines = [x for x in lines if x.get("minibatches") is not None and "replan" not in x]
    done = info["minibatches"]
    lines = [x for x in lines if x["minibatches"] < done] or lines
    part = lines[len(lines) // 10 :]
    if len(part) < 2 or part[-1]["t"] <= part[0]["t"]:
        return 0.0
    mb = info["minibatch"]
    return (part[-1]["minibatches"] - part[0]["minibatches"]) * mb / (part[-1]["t"] - part[0]["t"])


def submit(c: LocalCluster, spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec`` to its end; a job that did not finish stops the benchmark."""
    info = c.submit(spec, timeout=600)
    if info.get("state") != "done":
        raise SystemExit(f"job {spec['name']} ended {info.get('state')}: {info.get('error')}")
    return info


def devices_of(info: dict[str, Any]) -> list[list[str]]:
    """Each virtual worker's devices in the job's plan, in stage order."""
    vws = (info.get("predicted") or {}).get("vws", [])
    return [[s["device"] for s in v["stages"]] for v in vws]


def layers_of(info: dict[str, Any]) -> list[list[Any]]:
    """Each virtual worker's stages' layer ranges in the job's plan."""
    vws = (info.get("predicted") or {}).get("vws", [])
    return [[s.get("layers") for s in v["stages"]] for v in vws]


def stage_times(info: dict[str, Any]) -> list[dict[str, Any]]:
    """Each stage's device, layers, and compute time per minibatch measured (the job's
    ``stages``) beside the plan's predicted one."""
    pred = info.get("predicted") or {}
    out = []
    for s in info.get("stages", []):
        ps = pred["vws"][s["vw"]]["stages"][s["stage"]] if pred else {}
        out.append(
            {
                "device": s["device"],
                "layers": s.get("layers"),
                "measured_time_s": s.get("time_s"),
                "predicted_time_s": ps.get("time_s"),
            }
        )
    return out


def pair(
    root: Path, scale: float, slow_ratio: float, minibatches: int, repeats: int
) -> dict[str, Any]:
    """The planned job and its other arm on a fresh cluster of :func:`devices`, ``repeats``
    times alternating: where the plan leaves :data:`SLOW` out, the other arm forces it in
    (every device); where it keeps it, the other arm leaves it out (the plan's devices less
    it). ``speedup_measured``: the median over runs of planned / other samples/s."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "cluster.toml"
    path.write_text(cluster_toml(devices(scale, slow_ratio)))
    planned: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    planned_rate: list[float] = []
    other_rate: list[float] = []
    with LocalCluster(path, root / "run", timeout=180) as c:
        cpu = HostCpu().start()
        submit(c, job("warmup", 12, list(ALL)))  # the head profiles the model; first-use costs
        for i in range(repeats):
            planned.append(submit(c, job(f"planned{i}", minibatches, None)))
            planned_rate.append(rate(planned[-1]))
            used = [d for v in devices_of(planned[0]) for d in v]
            arm = list(ALL) if SLOW not in used else [d for d in used if d != SLOW]
            other.append(submit(c, job(f"other{i}", minibatches, arm)))
            other_rate.append(rate(other[-1]))
            print(
                f"  ratio {slow_ratio:g} run {i}: planned {planned_rate[-1]:.1f} samples/s on "
                f"{devices_of(planned[-1])}, other {other_rate[-1]:.1f} on "
                f"{devices_of(other[-1])}",
                flush=True,
            )
        host_busy = cpu.stop()
    pred = planned[0].get("predicted") or {}
    entry = next((e for e in pred.get("left_out") or () if e["device"] == SLOW), None)
    warned = [w for w in pred.get("warnings", ()) if w.startswith(f"{SLOW} unused: left out")]
    # left out by every planned run, named as unused with its reason in the plan's warnings
    left_out = (
        entry is not None
        and SLOW in pred.get("unused", ())
        and bool(warned)
        and all(SLOW not in {d for v in devices_of(p) for d in v} for p in planned)
    )
    ratios = [p / o for p, o in zip(planned_rate, other_rate, strict=True) if o > 0]
    return {
        "slow_ratio": slow_ratio,
        "left_out": left_out,
        "speedup_measured": median(ratios) if ratios else None,
        "speedup_runs": ratios,
        "samples_per_s_planned": planned_rate,
        "samples_per_s_other": other_rate,
        "predicted_samples_per_s_planned": pred.get("samples_per_s"),
        "predicted_samples_per_s_other": (other[0].get("predicted") or {}).get("samples_per_s"),
        "left_out_entry": entry,
        "reason": entry.get("why") if entry else None,
        "warning": warned[0] if warned else None,
        "unused": pred.get("unused"),
        "planned_vws": devices_of(planned[0]),
        "planned_layers": layers_of(planned[0]),
        "other_vws": devices_of(other[0]),
        "other_layers": layers_of(other[0]),
        "planned_stages": stage_times(planned[0]),
        "other_stages": stage_times(other[0]),
        "nm_planned": [v.get("nm") for v in pred.get("vws", [])],
        "nm_other": [v.get("nm") for v in (other[0].get("predicted") or {}).get("vws", [])],
        "host_busy": host_busy,
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--minibatches", type=int, default=MINIBATCHES, help="per run of each job")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each job, alternating")
    ap.add_argument("--slow-ratio", type=float, default=SLOW_RATIO, help="how much slower gpu2 is")
    ap.add_argument(
        "--speed-scale", type=float, default=SPEED_SCALE, help="the helpful devices' speed"
    )
    ap.add_argument(
        "--kept-ratio",
        type=float,
        default=None,
        help="also a cluster whose slow device is only this much slower (the plan keeps it)",
    )
    args = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        main_case = pair(
            Path(tmp) / "out", args.speed_scale, args.slow_ratio, args.minibatches, args.repeats
        )
    kept_case = None
    if args.kept_ratio is not None:
        with tempfile.TemporaryDirectory() as tmp:
            kept_case = pair(
                Path(tmp) / "kept",
                args.speed_scale,
                args.kept_ratio,
                args.minibatches,
                args.repeats,
            )
    entry = main_case["left_out_entry"]
    pred_with = entry["with_samples_per_s"] if entry else None
    pred_without = entry["without_samples_per_s"] if entry else None
    pred_speedup = pred_without / pred_with if pred_with else None
    speedup = main_case["speedup_measured"] if main_case["left_out"] else None
    print(f"plan: {main_case['planned_vws']}; unused: {main_case['unused']}")
    print(f"reason: {main_case['reason']}")
    rows: list[list[Any]] = [
        ["left_out_ok", main_case["left_out"], "true"],
        ["samples/s without (planned), median", median(main_case["samples_per_s_planned"]), ""],
        ["samples/s with (forced), median", median(main_case["samples_per_s_other"]), ""],
        ["left_out_speedup_measured", speedup if speedup is not None else "none", ">= 1.0"],
        ["predicted samples/s without", pred_without or "none", ""],
        ["predicted samples/s with (left-out entry)", pred_with or "none", ""],
        ["predicted samples/s with (forced plan)", main_case["predicted_samples_per_s_other"], ""],
        ["left_out_speedup_predicted", pred_speedup or "none", ""],
    ]
    if kept_case is not None:
        rows += [
            [f"kept case (ratio {args.kept_ratio:g}): left out", kept_case["left_out"], ""],
            ["kept case: planned / other, measured", kept_case["speedup_measured"], ""],
        ]
    print_table(["figure", "value", "target"], rows)
    print(f"host CPU busy {main_case['host_busy']:.0%} of its {machine()['cores']} cores")
    if args.json:
        emit_json(
            {
                "left_out_ok": main_case["left_out"],
                "left_out_speedup_measured": speedup,
                "left_out_speedup_runs": main_case["speedup_runs"],
                "samples_per_s_without": main_case["samples_per_s_planned"],
                "samples_per_s_with": main_case["samples_per_s_other"],
                "predicted_samples_per_s_without": pred_without,
                "predicted_samples_per_s_with": pred_with,
                "predicted_samples_per_s_forced_plan": main_case["predicted_samples_per_s_other"],
                "left_out_speedup_predicted": pred_speedup,
                "reason": main_case["reason"],
                "case": main_case,
                "kept_case": kept_case,
                "minibatches": args.minibatches,
                "repeats": args.repeats,
                "slow_ratio": args.slow_ratio,
                "speed_scale": args.speed_scale,
                "host_busy": main_case["host_busy"],
                "wall_s": time.monotonic() - t0,
                "machine": machine(),
            }
        )


if __name__ == "__main__":
    main()
