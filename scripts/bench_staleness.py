"""What staleness costs, and what each train.weights mode buys back: a study on real daemons.

For each task (the builtin ``cnn`` on the bundled digits; a small ``gpt`` on synthetic
Markov-chain tokens) and each pipeline depth k of ``--ks``, one virtual worker of k uniform
emulated devices trains the same number of minibatches (``--minibatches``, so the same
samples) in each arm:

- ``sync``: Nm = 1 (one minibatch in flight: no weight is stale; exactly minibatch SGD);
- ``latest``, ``stash``, ``predict`` (paper variant) and ``predict-consistent``: Nm = k.

It prints, per arm: final test accuracy, seconds to ``--target`` accuracy (from the head's
evaluations every ``--eval-every`` s while training), samples/s, peak memory per stage, the
prediction quality per stage (``predict`` arms), the host's CPU utilisation during the arm
(all its cores, whoever used them: other work on the host counts) and the cores this
benchmark's own daemons used; it writes one PNG of test accuracy against samples for all
arms (``--png``), redrawn after every turn of the arms with the figures so far beside it
(the same name ending ``.json``), so a study cut short keeps the arms it ran.

Each fresh cluster first runs an untimed short job of each task (a fresh worker's first job
pays imports and the model's first passes: the first timed arm would have run at 0.66-0.92
of its later speed). ``--repeats N`` runs the arms N times in turns (stash, predict, ...,
stash, predict, ...); each arm's samples/s and accuracy are then the medians of its N runs
(every run's in the JSON), the rest is its first run's.

**On a GPU** (``--device cuda:N``): all k stages on that one GPU at its own speed (no
padding, no speed scale), as the staleness was first seen: ``--tasks gpt512`` is the GPT of
``bench_gpu.py`` (dim 512, 8 blocks, seq 128) at SGD lr 0.01, momentum 0.9.

**A global speed scale** (``--speed-scale``, default 0.1): every emulated device runs at
that speed, i.e. each forward and backward is padded to (its CPU time) / scale
(:func:`hetpipe.emulate.pad`), so the devices spend most of their time waiting as slower
GPUs would, not computing on this host's few cores: the throughput figures then describe
the pipeline modelled, not the contention of its processes on the host. k stages that are
all busy want k x scale cores for their compute: at k = 8 on 2 cores, 0.25 takes all of
them (measured: utilisation 0.86 with the event loops), 0.1 leaves most idle. The
utilisation printed with each arm says how far that held (near 1.0: the host was saturated
and the throughput figures measure it).

**Settings, chosen on the synchronous arm alone** (before any asynchronous arm ran): one
learning rate for every arm, the one of {0.01, 0.02, 0.05} (SGD, momentum 0.9) at which the
``sync`` arm ended best on both tasks: 0.02 (cnn 0.992 / 0.994 / 0.986, gpt 0.258 / 0.266 /
0.263 after 300 minibatches; gpt at 0.05 after 200); and 200 minibatches per arm, by which
the ``sync`` arm at 0.02 has converged (cnn >= 0.99 from 5.6k samples, gpt at its ceiling
of about 0.26 from 4k). A learning rate at which minibatch SGD itself is unstable measures
nothing about staleness.

    python scripts/bench_staleness.py [--json] [--ks 4 8] [--minibatches 200] [--png out.png]

With ``--json`` the last line is one JSON object with every arm's figures and:
``predict_gap_vs_sync_points`` (sync accuracy minus predict accuracy in percentage points,
the worst over tasks and depths; target <= 0.5), ``predict_minus_stash_points`` (predict
minus stash, the worst; target >= 0) and ``predict_throughput_vs_stash`` (predict samples/s
over stash's, the worst; target >= 0.97).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench import HostCpu, cpu_seconds, emit_json, machine, parser, print_table

from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml

ROOT = Path(__file__).resolve().parent.parent

ARMS: dict[str, dict[str, Any]] = {
    "sync": {"weights": "stash"},  # with Nm = 1
    "latest": {"weights": "latest"},
    "stash": {"weights": "stash"},
    "predict": {"weights": "predict", "predict_variant": "paper"},
    "predict-consistent": {"weights": "predict", "predict_variant": "consistent"},
}

TASKS: dict[str, dict[str, Any]] = {
    # 16 layers; momentum 0.9 is where stale weights hurt (and what prediction follows)
    "cnn": {
        "model": {"name": "cnn", "args": {}},
        "data": {"name": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9, "weight_decay": 1e-4},
        "minibatch": 32,
        "target": 0.9,
    },
    # 1 + 8 + 2 = 11 layers; next-token accuracy (4 equally likely successors: 0.25 at best)
    "gpt": {
        "model": {
            "name": "gpt",
            "args": {"vocab": 64, "seq": 32, "dim": 64, "heads": 4, "blocks": 8},
        },
        "data": {
            "name": "synthetic",
            "args": {"kind": "tokens", "seq": 32, "vocab": 64, "n_train": 4096, "n_test": 512},
        },
        "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9},
        "minibatch": 32,
        "target": 0.2,
    },
    # the GPT of bench_gpu.py (25.5 M parameters), at the settings the staleness was first
    # seen with on one GPU (SGD lr 0.01, momentum 0.9): for --device cuda:N
    "gpt512": {
        "model": {
            "name": "gpt",
            "args": {"vocab": 256, "seq": 128, "dim": 512, "heads": 8, "blocks": 8},
        },
        "data": {
            "name": "synthetic",
            "args": {"kind": "tokens", "seq": 128, "vocab": 256, "n_train": 4096, "n_test": 256},
        },
        "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "minibatch": 32,
        "target": 0.2,
    },
}
N_LAYERS = {"cnn": 16, "gpt": 11, "gpt512": 11}


def even_split(n_layers: int, k: int) -> list[int]:
    """Layers per stage, as even as it goes (the devices are uniform)."""
    base, extra = divmod(n_layers, k)
    return [base + (i < extra) for i in range(k)]


def job(task: str, arm: str, k: int, args: Any) -> dict[str, Any]:
    t = TASKS[task]
    optimizer = {**t["optimizer"], **({"lr": args.lr[task]} if task in args.lr else {})}
    nm = 1 if arm == "sync" else k
    train = {
        "minibatch": t["minibatch"],
        "nm": nm,
        "minibatches": args.minibatches,
        "seed": args.seed,
        "eval_every_s": args.eval_every,
        "hang_after_s": 120.0,
        **ARMS[arm],
    }
    if task == "cnn" and args.bn_recalibrate:
        train["bn_recalibrate"] = args.bn_recalibrate
    return {
        "name": f"{task}-k{k}-{arm}",
        "model": t["model"],
        "data": t["data"],
        "optimizer": optimizer,
        "train": train,
        "vw": [{"devices": [f"gpu{i}" for i in range(k)], "layers": even_split(N_LAYERS[task], k)}],
    }


def repeat(kept: dict[str, Any], again: dict[str, Any]) -> None:
    """Add a repeated arm's figures to the first run's record: its ``samples_per_s`` and
    ``accuracy`` become the medians over the turns (the turns alternate the arms: a drift of
    the host's speed falls on all of them; an asynchronous arm's accuracy depends on when
    each gradient lands, so one turn may be far from the others), every turn's kept in
    ``samples_per_s_runs`` and ``accuracy_runs``; curve and memory stay the first run's."""
    for key in ("samples_per_s", "accuracy"):
        runs = kept.setdefault(f"{key}_runs", [kept[key]])
        runs.append(again[key])
        kept[key] = statistics.median(runs)
    kept["host_cpu"] = max(kept["host_cpu"], again["host_cpu"])
    kept["own_cores"] = max(kept["own_cores"], again["own_cores"])


def warm_up(cluster: LocalCluster, task: str, k: int, args: Any) -> None:
    """An untimed short job of ``task`` before its timed arms: a fresh worker's first job
    pays imports, the data and the model's first passes, which would fall on whichever arm
    ran first (measured: ``stash`` first on a fresh cluster ran at 0.66-0.92 of its speed
    as a later arm)."""
    spec = job(task, "stash", k, args)
    spec["name"] += "-warm-up"
    spec["train"] = {
        **{key: v for key, v in spec["train"].items() if key != "eval_every_s"},
        "minibatches": 4 * k,
    }
    info = cluster.submit(spec, timeout=args.max_s)
    if info.get("state") != "done":
        raise SystemExit(f"{task} k={k} warm-up: {info.get('state')}: {info.get('error')}")


def run_arm(cluster: LocalCluster, task: str, arm: str, k: int, args: Any) -> dict[str, Any]:
    cpu = HostCpu().start()
    pids = [p.pid for p in cluster.procs.values()]
    own0, t0 = cpu_seconds(pids), time.perf_counter()
    info = cluster.submit(job(task, arm, k, args), timeout=args.max_s)
    wall = time.perf_counter() - t0
    util, own = cpu.stop(), (cpu_seconds(pids) - own0) / wall
    if info.get("state") != "done":
        raise SystemExit(f"{task} k={k} {arm}: {info.get('state')}: {info.get('error')}")
    mb = TASKS[task]["minibatch"]
    curve = [(n * mb, acc) for _s, n, acc in info.get("evals", [])]
    reached = next(
        (s for s, _n, acc in info.get("evals", []) if acc >= TASKS[task]["target"]), None
    )
    stages = json.loads(Path(info["stages_path"]).read_text())
    return {
        "task": task,
        "k": k,
        "arm": arm,
        "nm": 1 if arm == "sync" else k,
        "lr": args.lr.get(task, TASKS[task]["optimizer"]["lr"]),
        "accuracy": info["test_accuracy"],
        "accuracy_trained_bn": info.get("test_accuracy_trained_bn"),
        "seconds_to_target": reached,
        "samples_per_s": info["samples_per_s"],
        "samples": info["minibatches"] * mb,
        "peak_bytes": [stages[w]["stats"]["peak_bytes"] for w in sorted(stages)],
        "prediction_quality": [
            stages[w]["stats"].get("prediction_quality") for w in sorted(stages)
        ],
        # per stage, its padded forward and backward per minibatch: against 1000 / the
        # arm's minibatches/s, how busy the bottleneck was and what it computed
        "compute_ms": [
            1e3 * (st["forward_s"] + st["backward_s"]) / max(1, st["forwards"])
            for st in (stages[w]["stats"] for w in sorted(stages))
        ],
        # per stage, the share of its time it waited for an input (its schedule's bubbles)
        "bubble": [stages[w]["stats"]["shares"].get("bubble") for w in sorted(stages)],
        "host_cpu": util,
        "own_cores": own,
        "wall_s": wall,
        "curve": curve,
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["task"], r["k"]) for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (task, k) in zip(axes[0], panels, strict=True):
        for r in results:
            if (r["task"], r["k"]) == (task, k) and r["curve"]:
                xs, ys = zip(*r["curve"], strict=True)
                ax.plot(xs, ys, marker=".", label=r["arm"])
        ax.set_title(f"{task}, k = {k}, Nm = k (sync: 1)")
        ax.set_xlabel("samples")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def headline(results: list[dict[str, Any]]) -> dict[str, float | None]:
    """The three figures with targets, worst over tasks and depths, for ``predict`` (the
    default variant, ``paper``), and the same three for ``predict-consistent`` (keys ending
    ``_consistent``)."""
    out: dict[str, float | None] = {}
    for name, suffix in (("predict", ""), ("predict-consistent", "_consistent")):
        gaps, vs_stash, speed = [], [], []
        for task, k in sorted({(r["task"], r["k"]) for r in results}):
            arm = {r["arm"]: r for r in results if (r["task"], r["k"]) == (task, k)}
            if name not in arm:
                continue
            p = arm[name]
            if "sync" in arm:
                gaps.append(100 * (arm["sync"]["accuracy"] - p["accuracy"]))
            if "stash" in arm:
                vs_stash.append(100 * (p["accuracy"] - arm["stash"]["accuracy"]))
                speed.append(p["samples_per_s"] / arm["stash"]["samples_per_s"])
        out[f"predict_gap_vs_sync_points{suffix}"] = max(gaps) if gaps else None
        out[f"predict_minus_stash_points{suffix}"] = min(vs_stash) if vs_stash else None
        out[f"predict_throughput_vs_stash{suffix}"] = min(speed) if speed else None
    return out


def lr_overrides(ap: Any, items: list[str]) -> dict[str, float]:
    """``TASK=LR`` pairs of ``--lr``, checked (a bad one is a one-line usage error)."""
    out = {}
    for item in items:
        task, _, lr = item.partition("=")
        try:
            value = float(lr)
        except ValueError:
            value = -1.0
        if task not in TASKS or not value > 0:
            ap.error(
                f"--lr: expected TASK=LR with TASK in {', '.join(TASKS)} and LR > 0, got {item!r}"
            )
        out[task] = value
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tasks", nargs="+", default=["cnn", "gpt"], choices=list(TASKS))
    ap.add_argument("--ks", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--minibatches", type=int, default=200, help="per arm (same samples)")
    ap.add_argument(
        "--speed-scale",
        type=float,
        default=0.1,
        help="every emulated device's speed (global scale; see the docs)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="where every stage computes: emulated devices on the host's cores "
        "at --speed-scale (cpu), or all k stages on one GPU at its own speed "
        "(cuda:N; e.g. --tasks gpt512)",
    )
    ap.add_argument("--eval-every", type=float, default=3.0)
    ap.add_argument(
        "--bn-recalibrate",
        type=int,
        default=16,
        help="cnn: batch-norm minibatches re-estimated before the evaluations",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--lr",
        nargs="+",
        default=[],
        metavar="TASK=LR",
        help="a task's learning rate instead of its default (e.g. gpt=0.02)",
    )
    ap.add_argument("--max-s", type=float, default=900.0, help="per arm")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="turns of every arm, alternated; samples/s and accuracy are the medians",
    )
    ap.add_argument("--png", type=Path, default=Path("bench_staleness.png"))
    ap.add_argument(
        "--merge",
        type=Path,
        default=None,
        metavar="JSON",
        help="keep the arms this run does not repeat (arm, task and depth) "
        "from this earlier run's JSON (same settings): re-run some, report and "
        "plot all",
    )
    args = ap.parse_args()
    args.lr = lr_overrides(ap, args.lr)
    if args.device != "cpu" and not args.device.startswith("cuda:"):
        ap.error(f"--device: expected cpu or cuda:N, got {args.device!r}")
    if args.repeats < 1:
        ap.error(f"--repeats: expected at least 1, got {args.repeats}")
    # a stop (SIGTERM) unwinds like an error: the clusters' daemons are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        import matplotlib  # noqa: F401  (checked now: the plot comes after every arm ran)
    except ImportError:
        ap.error("the plot needs matplotlib: pip install -e '.[plot]'")

    # --merge: the earlier run's arms (same settings) that this run does not repeat (another
    # arm, task or depth) are kept as measured
    results = (
        [
            r
            for r in json.loads(args.merge.read_text())["arms"]
            if not (r["arm"] in args.arms and r["task"] in args.tasks and r["k"] in args.ks)
        ]
        if args.merge
        else []
    )
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.ks:
            root = Path(tmp) / f"k{k}"
            root.mkdir()
            devices = [
                DeviceDef(f"gpu{i}", "fast", "256MiB", args.speed_scale)
                if args.device == "cpu"
                else DeviceDef(f"gpu{i}", "gpu", "16GiB", 1.0, args.device)
                for i in range(k)
            ]
            (root / "cluster.toml").write_text(cluster_toml(devices, shards=1))
            with LocalCluster(root / "cluster.toml", root / "run", timeout=120) as cluster:
                for task in args.tasks:
                    warm_up(cluster, task, k, args)
                    first: dict[str, dict[str, Any]] = {}
                    for turn in range(args.repeats):
                        for arm in args.arms:
                            r = run_arm(cluster, task, arm, k, args)
                            print(
                                f"{task} k={k} {arm} (turn {turn + 1}): accuracy "
                                f"{r['accuracy']:.3f} samples/s {r['samples_per_s']:.1f} "
                                f"host cpu {r['host_cpu']:.2f} (own {r['own_cores']:.2f} "
                                "cores)",
                                flush=True,
                            )
                            if turn == 0:
                                first[arm] = r
                                results.append(r)
                            else:
                                repeat(first[arm], r)
                        # the arms so far, kept as they come: a long study cut short keeps them
                        plot(results, args.png)
                        args.png.with_suffix(".json").write_text(
                            json.dumps(summary(results, args), indent=1) + "\n"
                        )
    order = list(ARMS)
    results.sort(key=lambda r: (r["k"], list(TASKS).index(r["task"]), order.index(r["arm"])))
    rows = [
        [
            r["task"],
            r["k"],
            r["arm"],
            r["nm"],
            r["accuracy"],
            r["accuracy_trained_bn"] if r["accuracy_trained_bn"] is not None else "-",
            r["seconds_to_target"] if r["seconds_to_target"] is not None else "-",
            r["samples_per_s"],
            max(r["peak_bytes"]) / 2**20,
            " ".join(f"{q:.2f}" for q in r["prediction_quality"] if q is not None) or "-",
            r["host_cpu"],
            r["own_cores"],
        ]
        for r in results
    ]
    print_table(
        [
            "task",
            "k",
            "arm",
            "Nm",
            "accuracy",
            "acc (trained bn)",
            "s to target",
            "samples/s",
            "peak MiB",
            "pred. quality",
            "host cpu",
            "own cores",
        ],
        rows,
    )
    figures = headline(results)
    for key, v in figures.items():
        print(f"{key}: {'n/a' if v is None else f'{v:.3f}'}")
    print(
        f"host cpu utilisation: max {max(r['host_cpu'] for r in results):.2f} of "
        f"{os.cpu_count()} cores, whoever used them; this benchmark's daemons: max "
        f"{max(r['own_cores'] for r in results):.2f} cores ("
        + (f"speed scale {args.speed_scale})" if args.device == "cpu" else f"{args.device})")
    )
    print(f"plot: {args.png} (figures beside it: {args.png.with_suffix('.json')})")
    if args.json:
        emit_json(summary(results, args))


def summary(results: list[dict[str, Any]], args: Any) -> dict[str, Any]:
    """The JSON object of ``--json``: the headline figures, the settings and every arm."""
    return {
        **headline(results),
        "device": args.device,
        "speed_scale": args.speed_scale if args.device == "cpu" else None,
        "host_cpu_max": max(r["host_cpu"] for r in results),
        "own_cores_max": max(r["own_cores"] for r in results),
        "minibatches": args.minibatches,
        "arms": results,
        "machine": machine(),
        "png": str(args.png),
    }


if __name__ == "__main__":
    main()
