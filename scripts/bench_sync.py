"""Synchronous pipelines: ours against torch.distributed.pipelining, and planned against naive.

Three parts, each against a baseline measured in the same run:

(a) ``gpipe`` and ``1f1b`` on four unslowed CPU stages (one process and one intra-op thread
    each) against ``torch.distributed.pipelining``'s ``ScheduleGPipe`` and ``Schedule1F1B``
    over gloo: the same model, split, microbatch size, M = 4 microbatches per iteration and
    one SGD step per iteration on both sides (exactly the same training). Steady-state
    samples/s after the warm-up, median of ``--rounds`` runs per side, sides taking turns
    (the machinery of ``bench_pipeline.py``). ``ratio_vs_torch_gpipe``, ``ratio_vs_torch_1f1b``
    (target >= 1.0): ours as it runs by default (every message encrypted by CurveZMQ,
    activations and gradients between these stages of one host through shared memory,
    compute runs shorter than ``[runtime] inline_ms`` on the event loop);
    ``thread_ratio_vs_torch_*``: ours with ``inline_ms = 0``, every compute handed to the
    compute thread (the default before 2026-11-26); ``plaintext_ratio_vs_torch_*``: ours
    with ``[security] curve = false`` and ``host_shm = false``, plaintext through the
    sockets as gloo is. ``torch_retained_*``: torch's samples/s with each of its processes
    keeping freed memory as our daemons do (``[runtime] retain_freed_mib``,
    :mod:`hetpipe.hostmem`), and ``ratio_vs_torch_retained_*`` ours against that: what of
    our ratio the allocator setting makes. All sides take turns in the same run.
(b) On a copy of the repository's heterogeneous ``cluster.toml`` (same devices, caps and
    speeds; ports 0): the job with no split (the head profiles it and the synchronous planner
    picks cuts, devices and their order) against one virtual worker over every device in file
    order with the layers split evenly, both ``1f1b`` with M = 4. Measured iteration time: the
    median interval between the ends of consecutive iterations at stage 0, after the first
    fifth. ``measured_speedup_vs_naive`` (target >= 1.3) and ``iteration_prediction_error``
    = |measured - predicted| / measured of the planned job (target <= 0.10). Host CPU use
    during each job is reported: the emulated devices share this host's cores, and the plan
    prices the job's own processes only, so a run during which other processes used more
    than ``--quiet`` cores is run again (at most ``--attempts`` runs; the least disturbed is
    kept, its ``outside_cores`` reported). ``profile_compute_ratio``: the planned job's
    slowest stage's compute per microbatch as the plan predicted it from the profile, over
    the same measured in the job (1.0 where the host ran at the profile's speed): the part
    of the error the host's drift since the profile explains.
(e) Zero bubble on the default heterogeneous cluster (the copy of (b)): the job with no split
    planned as ``zb-h1``, as ``zb-h2`` and as ``1f1b`` (the planner picks cuts, devices and
    their order for each), M = ``--zb-m``, interleaved ``--repeats`` times. The planned best
    zero-bubble schedule is the zb kind whose plan predicts the shorter iteration;
    ``zero_bubble_speedup_measured`` (target >= 1.15) is planned 1f1b's measured iteration
    time (as in (b)) over that kind's, ``zero_bubble_speedup_predicted`` the same of the
    predictions. Per stage, the bubble share of the iteration, measured (1 - the stage's
    forward, backward and step spans over the steady window at stage 0, as in (b)) against
    predicted (1 - M x the stage's predicted compute per microbatch over the predicted
    iteration time).
(f) Two stages per device (``--parts f``): two devices (processes) hold the four stages of (a),
    interleaved (``gpu0, gpu1, gpu0, gpu1``: each device's worker runs both of its stages,
    ``train.several_stages``) or as a V (``gpu0, gpu1, gpu1, gpu0``), against
    ``torch.distributed.pipelining``'s ``ScheduleInterleaved1F1B`` (ours: ``interleaved-1f1b``,
    the same device-level order), ``ScheduleInterleavedZeroBubble`` (ours: ``zb-h1``,
    interleaved: each stage its own zb-h1 order, the device running whichever of its stages'
    actions is ready first) and ``ScheduleZBVZeroBubble`` (ours: ``zbv``, the same device-level
    order on the V) over gloo, with the same model, split, microbatches and placement,
    measured as in (a), and torch again with each process keeping freed memory as our daemons
    do. ``ratio_vs_torch_interleaved_1f1b``, ``ratio_vs_torch_interleaved_zero_bubble``,
    ``ratio_vs_torch_zbv_zero_bubble`` (target >= 1.0 each) and ``..._retained``.
(c) ``--optimality N``: the search against exhaustive enumeration on N random small
    instances (<= 6 devices of <= 3 types, random bandwidth matrix, <= 10 layers, M <= 4):
    ``optimality_gap_mean`` and ``optimality_gap_max`` (target <= 0.05); and the planning time
    for 200 layers on 32 devices (``plan_200x32_s``, target < 10).
(d) Microbatch orders over a real slow link (network namespaces, ``hetpipe.netns``; only
    with ``--parts d``, it needs root): two hosts of one device each, the link between them
    shaped with ``tc`` so that an activation's transfer takes about as long as a stage's
    forward, M = ``--order-m``; the same split run as 1F1B (``warmup_forwards = 0``), with
    the warm-up the planner picks for it (``warmup_forwards = "auto"``) and as gpipe,
    interleaved ``--repeats`` times. Measured iteration time (as in (b)) and predicted per
    order, each stage's most microbatches in flight, and ``order_speedup_vs_1f1b`` (the
    planner's order against 1F1B).

    python scripts/bench_sync.py [--json] [--parts abcef] [--rounds 3] [--optimality 300]
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench import emit_json, machine, parser, print_table
from bench_pipeline import job_dict, run_ours, run_torch
from bench_plan_quality import run_quietly

from hetpipe.config import format_size, load_cluster
from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml
from hetpipe.models import build_model
from hetpipe.netns import Link, NetnsCluster, Network, measure_mbit, netns_cluster_toml, unavailable

REPO = Path(__file__).resolve().parent.parent
M = 4


# part (a)'s sides besides torch: (JSON prefix, run_ours arguments, what it is)
SIDES: dict[str, tuple[str, dict[str, Any], str]] = {
    "ours": ("", {}, "as by default"),
    "thread": ("thread_", {"inline_ms": 0}, "every compute on the compute thread"),
    "plain": ("plaintext_", {"curve": False, "host_shm": False}, "plaintext through sockets"),
}


def alternated(sides: dict[str, Any], args: Any) -> dict[str, list[dict[str, Any]]]:
    """Each side's runs, ``--rounds`` of them, the sides taking turns and each round starting
    one side later (a host whose speed drifts over minutes favours no side)."""
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    order = list(sides)
    for r in range(args.rounds):
        for side in order[r % len(order) :] + order[: r % len(order)]:
            runs[side].append(sides[side]())
    return runs


def part_a(args: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sides: dict[str, Any] = {
        "torch": lambda job: run_torch(job, args.warmup),
        "torch_retained": lambda job: run_torch(job, args.warmup, retain_freed=True),
    }
    for side, (_prefix, kwargs, _what) in SIDES.items():
        sides[side] = lambda job, kw=kwargs: run_ours(job, args.warmup, 1, **kw)
    for kind in ("gpipe", "1f1b"):
        job = job_dict(args.model, args.microbatch, args.minibatches, kind)
        runs = alternated({k: lambda run=run, job=job: run(job) for k, run in sides.items()}, args)
        med = {k: sorted(v, key=lambda x: x["samples_per_s"])[len(v) // 2] for k, v in runs.items()}
        torch_sps = med["torch"]["samples_per_s"]
        out[kind] = {
            "torch_samples_per_s": torch_sps,
            "torch_retained_samples_per_s": med["torch_retained"]["samples_per_s"],
            "ratio_vs_torch_retained": med["ours"]["samples_per_s"]
            / med["torch_retained"]["samples_per_s"],
            "torch_cpu_ms_per_sample": med["torch"]["cpu_ms_per_sample"],
            "all_runs": {k: [x["samples_per_s"] for x in v] for k, v in runs.items()},
        }
        for side in SIDES:
            out[kind][side] = {
                "samples_per_s": med[side]["samples_per_s"],
                "ratio": med[side]["samples_per_s"] / torch_sps,
                "cpu_ms_per_sample": med[side]["cpu_ms_per_sample"],
            }
    print(
        f"(a) 4 unslowed CPU stages, {args.model}, microbatch {args.microbatch}, M = {M}, "
        f"{args.minibatches} microbatches, median of {args.rounds} alternated runs; ours "
        + ", ".join(f"{side}: {what}" for side, (_p, _k, what) in SIDES.items())
        + "; CPU ms per sample counts every process, start-up included"
    )
    print_table(
        [
            "schedule",
            "torch samples/s",
            "torch CPU ms",
            "torch retained samples/s",
            "ours / torch retained",
            *[f"{side} {col}" for side in SIDES for col in ("samples/s", "ratio", "CPU ms")],
        ],
        [
            [
                k,
                v["torch_samples_per_s"],
                v["torch_cpu_ms_per_sample"],
                v["torch_retained_samples_per_s"],
                v["ratio_vs_torch_retained"],
                *[
                    v[side][col]
                    for side in SIDES
                    for col in ("samples_per_s", "ratio", "cpu_ms_per_sample")
                ],
            ]
            for k, v in out.items()
        ],
    )
    return out


# part (f): (JSON name, torch's schedule, our schedule, our stages' devices, torch's ranks)
CHUNKED: list[tuple[str, str, str, list[str], list[int]]] = [
    (
        "interleaved_1f1b",
        "interleaved-1f1b",
        "interleaved-1f1b",
        ["gpu0", "gpu1", "gpu0", "gpu1"],
        [0, 1, 0, 1],
    ),
    (
        "interleaved_zero_bubble",
        "interleaved-zero-bubble",
        "zb-h1",
        ["gpu0", "gpu1", "gpu0", "gpu1"],
        [0, 1, 0, 1],
    ),
    ("zbv_zero_bubble", "zbv-zero-bubble", "zbv", ["gpu0", "gpu1", "gpu1", "gpu0"], [0, 1, 1, 0]),
]


def part_f(args: Any) -> dict[str, Any]:
    """Two stages per device, ours against torch's multi-stage schedules (module text)."""
    out: dict[str, Any] = {}
    for name, torch_kind, ours_kind, devices, placement in CHUNKED:
        job = job_dict(args.model, args.microbatch, args.minibatches, ours_kind)
        job["vw"][0]["devices"] = devices
        job["train"]["several_stages"] = True
        sides: dict[str, Any] = {
            "ours": lambda job=job: run_ours(job, args.warmup, 1),
            "torch": lambda job=job, pl=placement, k=torch_kind: run_torch(
                job, args.warmup, placement=pl, kind=k
            ),
            "torch_retained": lambda job=job, pl=placement, k=torch_kind: run_torch(
                job, args.warmup, retain_freed=True, placement=pl, kind=k
            ),
        }
        runs = {k: [x["samples_per_s"] for x in v] for k, v in alternated(sides, args).items()}
        med = {k: statistics.median(v) for k, v in runs.items()}
        out[name] = {
            "ours_samples_per_s": med["ours"],
            "torch_samples_per_s": med["torch"],
            "torch_retained_samples_per_s": med["torch_retained"],
            "ratio": med["ours"] / med["torch"],
            "ratio_retained": med["ours"] / med["torch_retained"],
            "ours_schedule": ours_kind,
            "devices": devices,
            "all_runs": runs,
        }
    print(
        f"(f) 2 devices x 2 stages of {args.model}, microbatch {args.microbatch}, M = {M}, "
        f"{args.minibatches} microbatches, median of {args.rounds} alternated runs"
    )
    print_table(
        ["torch schedule", "ours", "ours samples/s", "torch", "ratio", "torch retained", "ratio"],
        [
            [
                k,
                f"{v['ours_schedule']} on {','.join(v['devices'])}",
                v["ours_samples_per_s"],
                v["torch_samples_per_s"],
                v["ratio"],
                v["torch_retained_samples_per_s"],
                v["ratio_retained"],
            ]
            for k, v in out.items()
        ],
    )
    return out


def _iterations(info: dict[str, Any], m: int = M) -> tuple[float, list[float]]:
    """Median time between the ends of consecutive iterations at stage 0 (first fifth out)."""
    data = json.loads(Path(info["stages_path"]).read_text())
    r = data["vw0/stage0"]
    fields = r["stats"]["record_fields"]
    rows = [dict(zip(fields, row, strict=True)) for row in r["records"]]
    ends = [row["t_bwd"] for row in rows if row["p"] % m == m - 1]
    gaps = [b - a for a, b in itertools.pairwise(ends)][len(ends) // 5 :]
    return statistics.median(gaps), gaps


def _cpu_busy() -> float:
    with open("/proc/stat") as fh:
        vals = [float(x) for x in fh.readline().split()[1:]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def _compute_per_microbatch(info: dict[str, Any]) -> dict[str, list[float]]:
    """Per stage, the compute (forward and backward, padded) of a microbatch: measured, and
    as the plan predicted it from the profile. The two differ where the host ran at another
    speed than when the profile was taken (the emulated devices share its cores); the rest
    of the iteration's error is the runtime's model."""
    pred = [s["time_s"] for v in (info.get("predicted") or {}).get("vws", []) for s in v["stages"]]
    done = [(s["forward_s"] or 0.0) + (s["backward_s"] or 0.0) for s in info["stages"]]
    counts = [s["done"] or 1 for s in info["stages"]]
    return {
        "compute_s": [d / n for d, n in zip(done, counts, strict=True)],
        "predicted_compute_s": pred,
    }


def part_b(args: Any) -> dict[str, Any]:
    source = load_cluster(args.cluster)
    devices = [
        DeviceDef(d.name, d.type, format_size(d.memory), d.speed, d.device) for d in source.devices
    ]
    names = [d.name for d in devices]
    n_layers = len(build_model("cnn", {"width": args.width}))
    even = [n_layers // len(names) + (i < n_layers % len(names)) for i in range(len(names))]

    def job(name: str, split: list[str] | None, minibatches: int) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": name,
            "model": {"name": "cnn", "args": {"width": args.width}},
            "data": {"name": "digits"},
            "optimizer": {"name": "sgd", "lr": 0.03, "momentum": 0.9},
            "train": {
                "minibatch": args.microbatch,
                "nm": M,
                "seed": 0,
                "schedule": "1f1b",
                "minibatches": minibatches,
            },
        }
        if split:
            d["vw"] = [{"devices": split, "layers": even}]
        else:
            d["train"]["vws"] = 1
        return d

    results: dict[str, list[dict[str, Any]]] = {"planned": [], "naive": []}
    with tempfile.TemporaryDirectory(prefix="hetpipe-bench-sync-") as tmp:
        root = Path(tmp)
        path = root / "cluster.toml"
        path.write_text(cluster_toml(devices, shards=len(source.ps)))
        with LocalCluster(path, root / "run", timeout=120) as cluster:
            warm = cluster.submit(job("warmup", names, 2 * M), timeout=600)
            if warm.get("state") != "done":
                raise RuntimeError(f"warm-up job: {warm.get('error')}")
            for r in range(args.repeats):
                for name, split in (("planned", None), ("naive", names)):
                    busy0, t0 = _cpu_busy(), time.perf_counter()
                    info = run_quietly(
                        cluster,
                        job(f"{name}-{r}", split, args.iterations * M),
                        args.quiet,
                        args.attempts,
                    )
                    wall = time.perf_counter() - t0
                    med, _gaps = _iterations(info)
                    pred = info.get("predicted") or {}
                    results[name].append(
                        {
                            "iteration_s": med,
                            "predicted_iteration_s": pred.get("iteration_s"),
                            **_compute_per_microbatch(info),
                            "devices": [
                                s["device"] for v in pred.get("vws", []) for s in v["stages"]
                            ],
                            "layers": [
                                s["layers"] for v in pred.get("vws", []) for s in v["stages"]
                            ],
                            "host_cpu_cores_busy": (_cpu_busy() - busy0) / wall,
                            "outside_cores": info["outside_cores"],
                            "accuracy": info.get("test_accuracy"),
                        }
                    )
                    print(
                        f"  {name} run {r + 1}: iteration {med * 1e3:.1f} ms "
                        f"(predicted {(pred.get('iteration_s') or 0) * 1e3:.1f} ms), "
                        f"host {results[name][-1]['host_cpu_cores_busy']:.2f} cores busy, "
                        f"{info['outside_cores']:.2f} by other processes",
                        flush=True,
                    )
    planned = sorted(results["planned"], key=lambda x: x["iteration_s"])[args.repeats // 2]
    naive = sorted(results["naive"], key=lambda x: x["iteration_s"])[args.repeats // 2]
    speedup = naive["iteration_s"] / planned["iteration_s"]
    error = abs(planned["iteration_s"] - planned["predicted_iteration_s"]) / planned["iteration_s"]
    # how far the profile was from the host's speed during the job: the bottleneck stage's
    # compute, predicted over measured (1.0: the profile matched the host)
    slowest = max(range(len(planned["compute_s"])), key=lambda i: planned["compute_s"][i])
    profile_ratio = (
        planned["predicted_compute_s"][slowest] / planned["compute_s"][slowest]
        if planned["predicted_compute_s"]
        else None
    )
    print(
        f"(b) default cluster, cnn width {args.width}, 1f1b, M = {M}, minibatch "
        f"{args.microbatch}: planned {planned['devices']} {planned['layers']} vs naive "
        f"{naive['devices']} {even}"
    )
    print_table(
        ["job", "iteration ms", "predicted ms", "host cores busy", "by others"],
        [
            [
                k,
                x["iteration_s"] * 1e3,
                (x["predicted_iteration_s"] or 0) * 1e3,
                x["host_cpu_cores_busy"],
                x["outside_cores"],
            ]
            for k, x in (("planned", planned), ("naive", naive))
        ],
    )
    print(f"measured speedup vs naive {speedup:.2f}x; iteration prediction error {error:.1%}")
    if profile_ratio is not None:
        print(
            f"planned job's slowest stage: compute per microbatch predicted / measured "
            f"{profile_ratio:.3f} (the profile against the host's speed during the job)"
        )
    return {
        "planned": planned,
        "naive": naive,
        "runs": results,
        "measured_speedup_vs_naive": speedup,
        "iteration_prediction_error": error,
        "profile_compute_ratio": profile_ratio,
    }


def _bubble_shares(info: dict[str, Any], m: int) -> tuple[list[float], list[float]]:
    """Per stage of the planned job: the bubble share of an iteration measured over the
    steady window (the iterations after the first fifth, timed at stage 0) and predicted
    from the plan (1 - M x compute per microbatch / iteration time)."""
    data = json.loads(Path(info["stages_path"]).read_text())
    r0 = data["vw0/stage0"]
    fields = r0["stats"]["record_fields"]
    rows = [dict(zip(fields, row, strict=True)) for row in r0["records"]]
    ends = [row["t_bwd"] for row in rows if row["p"] % m == m - 1]
    lo, hi = ends[len(ends) // 5], ends[-1]
    measured = []
    for where in sorted(data, key=lambda w: int(w.split("stage")[1])):
        busy = sum(
            max(0.0, min(t1, hi) - max(t0, lo))
            for kind, t0, t1, *_ in data[where]["stats"]["spans"]
            if kind in ("forward", "backward", "step")
        )
        measured.append(1.0 - busy / (hi - lo))
    pred = info.get("predicted") or {}
    it = pred.get("iteration_s") or 0.0
    predicted = [
        1.0 - m * st["time_s"] / it if it else float("nan")
        for v in pred.get("vws", [])
        for st in v["stages"]
    ]
    return measured, predicted


ZB_ARMS = ("1f1b", "zb-h1", "zb-h2")


def part_e(args: Any) -> dict[str, Any]:
    source = load_cluster(args.cluster)
    devices = [
        DeviceDef(d.name, d.type, format_size(d.memory), d.speed, d.device) for d in source.devices
    ]
    m = args.zb_m

    def job(name: str, kind: str) -> dict[str, Any]:
        return {
            "name": name,
            "model": {"name": "cnn", "args": {"width": args.width}},
            "data": {"name": "digits"},
            "optimizer": {"name": "sgd", "lr": 0.03, "momentum": 0.9},
            "train": {
                "minibatch": args.microbatch,
                "nm": m,
                "seed": 0,
                "schedule": kind,
                "minibatches": args.zb_iterations * m,
                "vws": 1,
            },
        }

    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ZB_ARMS}
    with tempfile.TemporaryDirectory(prefix="hetpipe-bench-zb-") as tmp:
        root = Path(tmp)
        path = root / "cluster.toml"
        path.write_text(cluster_toml(devices, shards=len(source.ps)))
        with LocalCluster(path, root / "run", timeout=120) as cluster:
            warm = cluster.submit(job("warmup", "1f1b"), timeout=900)
            if warm.get("state") != "done":
                raise RuntimeError(f"warm-up job: {warm.get('error')}")
            for r in range(args.repeats):
                for kind in ZB_ARMS:
                    info = run_quietly(cluster, job(f"{kind}-{r}", kind), args.quiet, args.attempts)
                    if info.get("state") != "done":
                        raise RuntimeError(f"{kind}: {info.get('error')}")
                    med, _gaps = _iterations(info, m)
                    pred = info.get("predicted") or {}
                    measured, predicted = _bubble_shares(info, m)
                    runs[kind].append(
                        {
                            "iteration_s": med,
                            "predicted_iteration_s": pred.get("iteration_s"),
                            "devices": [
                                s["device"] for v in pred.get("vws", []) for s in v["stages"]
                            ],
                            "layers": [
                                s["layers"] for v in pred.get("vws", []) for s in v["stages"]
                            ],
                            "bubble_measured": measured,
                            "bubble_predicted": predicted,
                            "outside_cores": info["outside_cores"],
                        }
                    )
                    print(
                        f"  {kind} run {r + 1}: iteration {med * 1e3:.1f} ms (predicted "
                        f"{(pred.get('iteration_s') or 0) * 1e3:.1f} ms) on "
                        f"{runs[kind][-1]['devices']}, bubbles "
                        + " ".join(f"{x:.0%}" for x in measured)
                        + f", {info['outside_cores']:.2f} cores by other processes",
                        flush=True,
                    )
    med = {k: sorted(v, key=lambda x: x["iteration_s"])[len(v) // 2] for k, v in runs.items()}
    best = min(("zb-h1", "zb-h2"), key=lambda k: med[k]["predicted_iteration_s"] or math.inf)
    speedup = med["1f1b"]["iteration_s"] / med[best]["iteration_s"]
    predicted = (med["1f1b"]["predicted_iteration_s"] or 0.0) / (
        med[best]["predicted_iteration_s"] or math.inf
    )
    print(
        f"(e) default cluster, cnn width {args.width}, M = {m}, minibatch {args.microbatch}: "
        f"planned {best} against planned 1f1b"
    )
    print_table(
        ["schedule", "iteration ms", "predicted ms", "devices", "bubble measured", "predicted"],
        [
            [
                k,
                x["iteration_s"] * 1e3,
                (x["predicted_iteration_s"] or 0) * 1e3,
                str(x["devices"]),
                " ".join(f"{b:.0%}" for b in x["bubble_measured"]),
                " ".join(f"{b:.0%}" for b in x["bubble_predicted"]),
            ]
            for k, x in med.items()
        ],
    )
    verdict = "met" if speedup >= 1.15 else "MISSED"
    print(
        f"zero-bubble speedup vs planned 1f1b: measured {speedup:.2f}x (target >= 1.15: "
        f"{verdict}), predicted {predicted:.2f}x"
    )
    return {
        "m": m,
        "best": best,
        "median": med,
        "runs": runs,
        "zero_bubble_speedup_measured": speedup,
        "zero_bubble_speedup_predicted": predicted,
        "target_met": speedup >= 1.15,
    }


def part_c(args: Any) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "tests"))
    from test_planner_sync import instance

    from hetpipe.planner.syncsearch import exhaustive, plan_sync

    rng = random.Random(args.seed)
    gaps, t_plan, t_exh = [], 0.0, 0.0
    while len(gaps) < args.optimality:
        model = instance(rng, rng.randint(2, 6), rng.randint(2, 10), rng.randint(1, 4))
        t0 = time.perf_counter()
        opt = exhaustive(model)
        t1 = time.perf_counter()
        got = plan_sync(model, budget_s=2.0)
        t_plan += time.perf_counter() - t1
        t_exh += t1 - t0
        if opt is not None:
            gaps.append(got.iteration_s / opt.iteration_s - 1 if got else float("inf"))
    big = instance(random.Random(1), 32, 200, 4, caps=False)
    t0 = time.perf_counter()
    plan_sync(big, budget_s=6.0)
    t_big = time.perf_counter() - t0
    out = {
        "instances": len(gaps),
        "optimality_gap_mean": statistics.fmean(gaps),
        "optimality_gap_max": max(gaps),
        "plan_s_mean": t_plan / len(gaps),
        "exhaustive_s_mean": t_exh / len(gaps),
        "plan_200x32_s": t_big,
    }
    print(
        f"(c) {len(gaps)} random instances: gap to the exhaustive optimum mean "
        f"{out['optimality_gap_mean']:.2%}, max {out['optimality_gap_max']:.2%}; planning "
        f"{out['plan_s_mean'] * 1e3:.0f} ms each (exhaustive {out['exhaustive_s_mean']:.2f} s);"
        f" 200 layers on 32 devices planned in {t_big:.1f} s"
    )
    return out


ORDER_HIDDEN = [512] * 6  # (d): a stage's forward and its activation's transfer comparable


def part_d(args: Any) -> dict[str, Any]:
    why = unavailable()
    if why:
        print(f"(d) skipped: {why}")
        return {"skipped": why}
    m = args.order_m
    hosts = {h: [DeviceDef(f"{h}0", "fast", "1GiB", args.order_speed)] for h in ("a", "b")}
    n_layers = len(build_model("mlp", {"hidden": ORDER_HIDDEN}))

    def job(name: str, kind: str, warmup: int | str, iterations: int) -> dict[str, Any]:
        return {
            "name": name,
            "model": {"name": "mlp", "args": {"hidden": ORDER_HIDDEN}},
            "data": {"name": "digits"},
            "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
            "train": {
                "minibatch": args.order_microbatch,
                "nm": m,
                "seed": 0,
                "schedule": kind,
                "minibatches": iterations * m,
                **({"warmup_forwards": warmup} if kind == "1f1b" else {}),
            },
            "vw": [{"devices": ["a0", "b0"], "layers": [n_layers // 2, n_layers - n_layers // 2]}],
        }

    arms = (("1f1b", "1f1b", 0), ("planned", "1f1b", "auto"), ("gpipe", "gpipe", 0))
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a, _k, _w in arms}
    with (
        tempfile.TemporaryDirectory(prefix="hetpipe-bench-order-") as tmp,
        Network(list(hosts), [Link("a", "b", mbit=args.order_mbit)]) as net,
    ):
        root = Path(tmp)
        rate = measure_mbit(net, "a", "b", 2_000_000)
        path = root / "cluster.toml"
        path.write_text(netns_cluster_toml(net, hosts, shards=["a"], lost_after_s=30.0))
        with NetnsCluster(net, path, root / "run", timeout=120) as cluster:
            warm = cluster.submit(job("warm-up", "1f1b", 0, 2), timeout=600)
            if warm.get("state") != "done":
                raise RuntimeError(f"warm-up job: {warm.get('error')}")
            for r in range(args.repeats):
                for arm, kind, warmup in arms:
                    busy0, t0 = _cpu_busy(), time.perf_counter()
                    info = cluster.submit(
                        job(f"{arm}-{r}", kind, warmup, args.order_iterations), timeout=900
                    )
                    if info.get("state") != "done":
                        raise RuntimeError(f"{arm}: {info.get('error')}")
                    med, _gaps = _iterations(info, m)
                    pred = info.get("predicted") or {}
                    stages = json.loads(Path(info["stages_path"]).read_text())
                    runs[arm].append(
                        {
                            "iteration_s": med,
                            "predicted_iteration_s": pred.get("iteration_s"),
                            "warmup": pred.get("warmup", 0),
                            "peak_in_flight": [
                                st["stats"]["peak_in_flight"] for _w, st in sorted(stages.items())
                            ],
                            "host_cpu_cores_busy": (_cpu_busy() - busy0)
                            / (time.perf_counter() - t0),
                        }
                    )
                    x = runs[arm][-1]
                    print(
                        f"  {arm} run {r + 1}: warm-up +{x['warmup']}, iteration "
                        f"{med * 1e3:.1f} ms (predicted "
                        f"{(x['predicted_iteration_s'] or 0) * 1e3:.1f} ms), in flight "
                        f"{x['peak_in_flight']}, host {x['host_cpu_cores_busy']:.2f} cores "
                        "busy",
                        flush=True,
                    )
    med = {a: sorted(v, key=lambda x: x["iteration_s"])[len(v) // 2] for a, v in runs.items()}
    speedup = med["1f1b"]["iteration_s"] / med["planned"]["iteration_s"]
    print(
        f"(d) orders over a {args.order_mbit:g} Mbit/s link (payload measured {rate:.0f}), "
        f"mlp {ORDER_HIDDEN}, microbatch {args.order_microbatch}, M = {m}:"
    )
    print_table(
        ["order", "warm-up", "iteration ms", "predicted ms", "in flight", "host busy"],
        [
            [
                a,
                x["warmup"],
                x["iteration_s"] * 1e3,
                (x["predicted_iteration_s"] or 0) * 1e3,
                str(x["peak_in_flight"]),
                x["host_cpu_cores_busy"],
            ]
            for a, x in med.items()
        ],
    )
    print(f"planner's order vs 1F1B: {speedup:.2f}x")
    return {
        "link_mbit": args.order_mbit,
        "measured_payload_mbit": rate,
        "m": m,
        "median": med,
        "runs": runs,
        "order_speedup_vs_1f1b": speedup,
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--parts", default="abcef", help="which parts to run (a, b, c, d, e, f)")
    ap.add_argument("--model", choices=("cnn", "mlp"), default="cnn", help="(a) model")
    ap.add_argument("--microbatch", type=int, default=32)
    ap.add_argument("--minibatches", type=int, default=400, help="(a) microbatches per side")
    ap.add_argument("--warmup", type=int, default=40, help="(a) microbatches not counted")
    ap.add_argument("--rounds", type=int, default=3, help="(a) runs per side (median)")
    ap.add_argument("--cluster", default=str(REPO / "cluster.toml"), help="(b) cluster file")
    ap.add_argument("--width", type=int, default=32, help="(b) cnn width")
    ap.add_argument("--iterations", type=int, default=60, help="(b) iterations per job")
    ap.add_argument("--repeats", type=int, default=3, help="(b) runs per job (median)")
    ap.add_argument(
        "--quiet",
        type=float,
        default=0.3,
        help="(b) a run during which other processes used more cores is run again",
    )
    ap.add_argument(
        "--attempts",
        type=int,
        default=4,
        help="(b) runs per measurement at most (the least disturbed one is kept)",
    )
    ap.add_argument("--zb-m", type=int, default=M, help="(e) microbatches per iteration")
    ap.add_argument("--zb-iterations", type=int, default=40, help="(e) iterations per job")
    ap.add_argument("--optimality", type=int, default=300, help="(c) random instances")
    ap.add_argument("--seed", type=int, default=0, help="(c) instance seed")
    ap.add_argument("--order-m", type=int, default=8, help="(d) microbatches per iteration")
    ap.add_argument("--order-mbit", type=float, default=200.0, help="(d) the link's rate")
    ap.add_argument("--order-speed", type=float, default=0.25, help="(d) the devices' speed")
    ap.add_argument("--order-microbatch", type=int, default=128, help="(d) samples each")
    ap.add_argument("--order-iterations", type=int, default=30, help="(d) per job")
    args = ap.parse_args()
    if args.minibatches % M or args.warmup % M:
        ap.error(f"--minibatches and --warmup must be multiples of M = {M}")
    out: dict[str, Any] = {"bench": "sync", "machine": machine()}
    if "a" in args.parts:
        a = part_a(args)
        out.update(
            {
                f"{prefix}ratio_vs_torch_{kind}": a[kind][side]["ratio"]
                for side, (prefix, _kw, _what) in SIDES.items()
                for kind in a
            }
        )
        out.update(
            {f"ratio_vs_torch_retained_{kind}": a[kind]["ratio_vs_torch_retained"] for kind in a}
        )
        out["vs_torch"] = a
    if "b" in args.parts:
        b = part_b(args)
        out.update(
            measured_speedup_vs_naive=b["measured_speedup_vs_naive"],
            iteration_prediction_error=b["iteration_prediction_error"],
            profile_compute_ratio=b["profile_compute_ratio"],
            plan_quality=b,
        )
    if "c" in args.parts:
        c = part_c(args)
        out.update(
            optimality_gap_mean=c["optimality_gap_mean"],
            optimality_gap_max=c["optimality_gap_max"],
            plan_200x32_s=c["plan_200x32_s"],
            optimality=c,
        )
    if "e" in args.parts:
        e = part_e(args)
        out.update(
            zero_bubble_speedup_measured=e["zero_bubble_speedup_measured"],
            zero_bubble_speedup_predicted=e["zero_bubble_speedup_predicted"],
            zero_bubble_bubbles={
                k: {"measured": x["bubble_measured"], "predicted": x["bubble_predicted"]}
                for k, x in e["median"].items()
            },
            zero_bubble=e,
        )
    if "f" in args.parts:
        f = part_f(args)
        for name, v in f.items():
            out[f"ratio_vs_torch_{name}"] = v["ratio"]
            out[f"ratio_vs_torch_retained_{name}"] = v["ratio_retained"]
        out["two_stages_per_device"] = f
    if "d" in args.parts:
        d = part_d(args)
        out.update(order_speedup_vs_1f1b=d.get("order_speedup_vs_1f1b"), orders=d)
    if args.json:
        emit_json(out)


if __name__ == "__main__":
    sys.exit(main())
