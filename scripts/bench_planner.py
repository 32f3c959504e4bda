"""How long the planner takes: make_plan(policy="auto") on synthetic models and clusters.

Models of 50, 100 and 200 layers (synthetic profiles, fixed seed) on clusters of 4, 8 and 16
devices of 4 types (speeds 1.0, 0.7, 0.5, 0.25; memory 16, 12, 8, 4 GiB), nodes of 4 devices
each holding one device of every type, 100 Gb/s inside a node and 10 Gb/s between nodes.
Each case is planned 3 times from scratch (no cache survives between runs); the median is
reported.

The large case, 1000 layers on 64 devices (16 nodes of 4, the same four types on every node,
so the cluster's nodes are alike but each VW mixes types), is timed the same way against its
target of :data:`TARGET_1000X64` seconds.

    python scripts/bench_planner.py [--json] [--only 1000x64 ...] [--runs N] [--skip-large]

With ``--json`` the last line is one JSON object with every figure, ``seconds_200x16`` and
``seconds_1000x64`` (null where skipped).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from hetpipe.config import (
    ClusterConfig,
    DeviceSpec,
    NetworkSpec,
    NodeSpec,
    RuntimeSpec,
    ShardSpec,
)
from hetpipe.planner import make_plan, synthetic_profile

TYPES = {"t1": (1.0, 16), "t2": (0.7, 12), "t3": (0.5, 8), "t4": (0.25, 4)}  # speed, GiB
LAYERS = (50, 100, 200)
DEVICES = (4, 8, 16)
LARGE = ((1000, 64),)  # (layers, devices) timed beside the grid
TARGET_200X16 = 5.0
TARGET_1000X64 = 10.0
RUNS = 3


def cluster(n: int) -> ClusterConfig:
    names = list(TYPES)
    nodes = []
    for j in range(n // 4):
        devs = []
        for i in range(4):
            t = names[i]
            speed, gib = TYPES[t]
            idx = 4 * j + i
            # real GPUs (cuda:i on each node): not emulated devices sharing this host's cores
            devs.append(
                DeviceSpec(
                    f"gpu{idx}", f"cuda:{i}", t, gib << 30, speed, 0, f"node{j}", f"10.0.0.{j}"
                )
            )
        nodes.append(NodeSpec(f"node{j}", f"10.0.0.{j}", tuple(devs)))
    shards = tuple(ShardSpec(j, f"10.0.0.{j}", 7100) for j in range(n // 4))
    return ClusterConfig("<bench>", shards, NetworkSpec(100.0, 10.0), tuple(nodes), RuntimeSpec())


def profile_of(n_layers: int):
    """The synthetic model of ``n_layers`` layers every case of that size plans."""
    return synthetic_profile(
        n_layers,
        {t: s for t, (s, _) in TYPES.items()},
        n_layers,
        minibatch=32,
        param_bytes=(1 << 20, 16 << 20),
        out_bytes=(1 << 20, 8 << 20),
    )


def fingerprint(plan) -> list[list]:
    """What the plan decided, per VW: its devices in order, layers per stage and Nm (equal
    fingerprints before and after a change to the planner's speed mean the same plan)."""
    return [
        [
            [s.layout.devices[0] for s in vw.stages],
            [s.layout.last - s.layout.first for s in vw.stages],
            vw.nm,
        ]
        for vw in plan.vws
    ]


def run_case(n_layers: int, n_dev: int, runs: int, prof=None) -> dict:
    """Plan ``n_layers`` x ``n_dev`` ``runs`` times from scratch; the figures of the case."""
    prof = prof or profile_of(n_layers)
    c = cluster(n_dev)
    times, cpu = [], []
    plan = None
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = make_plan(c, prof, minibatch=32, staleness=0, optimizer_state_factor=1)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    assert plan is not None
    d = plan.details
    return {
        "seconds": statistics.median(times),
        "runs": times,
        # this process's CPU time: on a host shared with other work, steadier than the wall
        "cpu_seconds": statistics.median(cpu),
        "cpu_runs": cpu,
        "vws": len(plan.vws),
        "samples_per_s": plan.samples_per_s,
        "policy": plan.policy,
        "formation": d.get("formation"),
        "formations_evaluated": d.get("formations_evaluated"),
        "formations_considered": d.get("formations_considered"),
        "orders_evaluated": d.get("orders_evaluated"),
        "dp_runs": d.get("dp_runs"),
        "dp_steps": d.get("dp_steps"),
        "plan": fingerprint(plan),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    ap.add_argument("--runs", type=int, default=RUNS, help="runs per case (median reported)")
    ap.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="cases to run, as LAYERSxDEVICES (default: the grid and 1000x64; e.g. 400x32)",
    )
    ap.add_argument("--skip-large", action="store_true", help="leave out the 1000x64 case")
    args = ap.parse_args()
    cases = [(n, k) for n in LAYERS for k in DEVICES]
    if not args.skip_large:
        cases += list(LARGE)
    if args.only:  # any LAYERSxDEVICES (devices a multiple of 4), grid or not
        cases = [(int(a), int(b)) for a, b in (c.split("x") for c in args.only)]
    results: dict[str, dict] = {}
    print(
        f"make_plan(policy='auto') on {platform.processor() or platform.machine()}, "
        f"median of {args.runs} runs"
    )
    print(
        f"{'layers':>7}{'devices':>9}{'seconds':>10}{'cpu s':>9}{'VWs':>5}{'samples/s':>12}"
        f"{'formations':>12}{'orders':>8}{'DPs':>6}  formation"
    )
    profiles: dict[int, object] = {}
    for n_layers, n_dev in cases:
        prof = profiles.setdefault(n_layers, profile_of(n_layers))
        r = results[f"{n_layers}x{n_dev}"] = run_case(n_layers, n_dev, args.runs, prof)
        print(
            f"{n_layers:>7}{n_dev:>9}{r['seconds']:>10.3f}{r['cpu_seconds']:>9.3f}{r['vws']:>5}"
            f"{r['samples_per_s']:>12.1f}"
            f"{r['formations_evaluated']!s:>7}/{r['formations_considered']!s:<4}"
            f"{r['orders_evaluated']!s:>8}{r['dp_runs']!s:>6}  "
            f"{r['policy']}: {r['formation']}",
            flush=True,
        )

    def seconds(case: str) -> float | None:
        return results[case]["seconds"] if case in results else None

    summary = {
        "bench": "planner",
        "runs": args.runs,
        "cases": results,
        "seconds_200x16": seconds("200x16"),
        "target_seconds_200x16": TARGET_200X16,
        "seconds_1000x64": seconds("1000x64"),
        "cpu_seconds_1000x64": results["1000x64"]["cpu_seconds"] if "1000x64" in results else None,
        "target_seconds_1000x64": TARGET_1000X64,
    }
    for case, target in (("200x16", TARGET_200X16), ("1000x64", TARGET_1000X64)):
        s = seconds(case)
        if s is not None:
            verdict = "met" if s < target else "MISSED"
            print(f"{case}: {s:.3f}s (target < {target:g}s: {verdict})")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
