"""How long the planner takes: make_plan(policy="auto") on synthetic models and clusters.

Models of 50, 100 and 200 layers (synthetic profiles, fixed seed) on clusters of 4, 8 and 16
devices of 4 types (speeds 1.0, 0.7, 0.5, 0.25; memory 16, 12, 8, 4 GiB), nodes of 4 devices
each holding one device of every type, 100 Gb/s inside a node and 10 Gb/s between nodes.
Each case is planned 3 times from scratch (no cache survives between runs); the median is
reported.

    python scripts/bench_planner.py [--json]

With ``--json`` the last line is one JSON object with every figure and ``seconds_200x16``.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    args = ap.parse_args()
    results: dict[str, dict] = {}
    print(
        f"make_plan(policy='auto') on {platform.processor() or platform.machine()}, "
        f"median of {RUNS} runs"
    )
    print(
        f"{'layers':>7}{'devices':>9}{'seconds':>10}{'VWs':>5}{'samples/s':>12}"
        f"{'formations':>12}{'orders':>8}{'DPs':>6}  formation"
    )
    for n_layers in LAYERS:
        prof = synthetic_profile(
            n_layers,
            {t: s for t, (s, _) in TYPES.items()},
            n_layers,
            minibatch=32,
            param_bytes=(1 << 20, 16 << 20),
            out_bytes=(1 << 20, 8 << 20),
        )
        for n_dev in DEVICES:
            c = cluster(n_dev)
            times = []
            plan = None
            for _ in range(RUNS):
                t0 = time.perf_counter()
                plan = make_plan(c, prof, minibatch=32, staleness=0, optimizer_state_factor=1)
                times.append(time.perf_counter() - t0)
            assert plan is not None
            med = statistics.median(times)
            d = plan.details
            results[f"{n_layers}x{n_dev}"] = {
                "seconds": med,
                "runs": times,
                "vws": len(plan.vws),
                "samples_per_s": plan.samples_per_s,
                "policy": plan.policy,
                "formations_evaluated": d.get("formations_evaluated"),
                "formations_considered": d.get("formations_considered"),
                "orders_evaluated": d.get("orders_evaluated"),
                "dp_runs": d.get("dp_runs"),
                "dp_steps": d.get("dp_steps"),
            }
            print(
                f"{n_layers:>7}{n_dev:>9}{med:>10.3f}{len(plan.vws):>5}"
                f"{plan.samples_per_s:>12.1f}"
                f"{d.get('formations_evaluated')!s:>7}/{d.get('formations_considered')!s:<4}"
                f"{d.get('orders_evaluated')!s:>8}{d.get('dp_runs')!s:>6}  "
                f"{plan.policy}: {d.get('formation')}"
            )
    summary = {
        "bench": "planner",
        "cases": results,
        "seconds_200x16": results["200x16"]["seconds"],
        "target_seconds_200x16": 5.0,
    }
    print(f"200 layers x 16 devices: {summary['seconds_200x16']:.3f}s (target < 5s)")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
