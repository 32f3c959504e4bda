"""HetPipe's own experiment on one host: the paper's 16-GPU testbed emulated, time to accuracy
of hetpipe's formations against Horovod-style data parallelism.

The cluster is ``examples/paper_testbed.toml`` (4 nodes x 4 emulated GPUs: TITAN V, TITAN
RTX, RTX 2060, Quadro P4000; speeds in the ratio of their FP32 throughput; one PS shard per
node), every speed times ``--speed-scale``, every port 0.

Links (``--links``): ``shaped`` (the default where network namespaces can be made,
:mod:`hetpipe.netns`) makes every node a host of its own whose NIC is capped, for
everything it sends to the other nodes together, at the rate that keeps the paper's ratio
of a model's parameter transfer over InfiniBand to a TITAN V's minibatch (``link_ratio``
per model, estimated from the GPUs' and network's figures, see ``MODELS``), scaled to this
host's emulated TITAN V; the cluster file gives the planner that rate. Inside a node the
devices talk over the host's loopback, faster than the paper's PCIe (unshaped). Both sides
cross the same NICs: hetpipe's activations, parameter-server traffic and evaluations, and
DP's all-reduce. ``planner``: each node on its own loopback address, the links only the
planner's figures (PCIe 126, InfiniBand 56 Gbit/s), every byte at loopback speed.

Memory caps keep the file's ratio, in units of 1/10 of what the model needs whole
(the planner's memory model, :func:`hetpipe.core.memory.stage_memory`, at the minibatch), so
TITAN V and TITAN RTX hold the whole model and the whimpy two do not, for each model.

For each model (``paper_vgg19``, ``paper_resnet152``: :mod:`hetpipe.papermodels`, on the
generated image task written as the builtin ``tensors`` data set):

- **hetpipe** under each policy of ``--policies`` (NP, ED, ED-local, HD: ``train.policy``
  with as many virtual workers as nodes, formed, ordered, cut and given Nm by the planner,
  and ``train.schedule = "auto"``: the schedule the planner picks; ED places the parameters
  round-robin, ``train.placement = "default"``, the others on their stages' hosts) and each
  WSP bound of ``--staleness``. The head evaluates the global weights every
  ``--eval-every`` seconds while the job trains; the clock starts when the head starts the
  job (after its planning, and after one untimed warm-up job per formation policy that
  profiles every device type and gives every device it uses its first assignment).
- **DP** (Horovod-style): ``DistributedDataParallel`` over gloo on exactly the devices whose
  cap holds the whole model and its minibatch, each rank padded to its device's emulated
  speed (``bench_convergence.Ddp``: the same ranks, hook and clock as there). Learning rates
  mean the same on both sides: every minibatch contributes ``lr x its gradient`` (DP steps
  ``lr x W`` on averaged gradients).

hetpipe's own learning rate (``--hetpipe-lr``) and the shards' merge rule (``--merge``:
``optimizer.merge``) may differ from DP's. They are the knobs the staleness needs: under
WSP each minibatch's gradient is taken on weights that lack up to ``Nm - 1`` of its virtual
worker's updates and, per other virtual worker, one to two waves of updates (more with D), so
the step that is stable for DP's synchronous trajectory can be too large for hetpipe's
(``scripts/probe_paper_staleness.py`` replays both update rules alone). Every figure is
reported with the learning rate and merge rule it ran under; the matched-lr run (``--lr``
given without ``--hetpipe-lr``: both sides at it) is the one that measures the staleness.

Every figure comes with the host's CPU utilisation over its run (``/proc/stat``: every
process of the host, other users' included) and the share of the host's cores this
benchmark's own processes used. ``speedup_vs_dp_<model>`` = DP's time to target / the best
hetpipe time to target. ``--tiny`` runs the same at a test's size: two nodes of two devices
(TITAN V and RTX 2060), a narrow VGG-19, a lower target, a few hundred minibatches at most.

    python scripts/bench_paper.py [--json] [--models vgg19 resnet152]
        [--policies NP ED ED-local HD] [--staleness 0 4 32] [--tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_convergence
import torch
from _bench import HostCpu, cpu_seconds, emit_json, machine, parser, print_table
from bench_convergence import Ddp, _follow

from hetpipe.config import ClusterConfig, load_cluster

ROOT = Path(__file__).resolve().parent.parent
TESTBED = ROOT / "examples" / "paper_testbed.toml"
WAIT_S = 600.0
WARM_MINIBATCHES = 16  # per VW: long enough that the planner uses the devices it will time
WHOLE_UNITS = 10  # the model needs 10 units whole: 12 (TITAN V) holds it, 8 (P4000) does not
GPU_GB = {"titan-v": 12, "titan-rtx": 24, "rtx-2060": 6, "p4000": 8}  # the paper's memory
POLICIES = {"NP": "np", "ED": "ed", "ED-local": "ed", "HD": "hd"}
PLACEMENT = {"ED": "default"}  # train.placement: the paper's ED is round-robin, the rest local

# model key -> (builtin, args, image side, noise, target accuracy); --tiny overrides
MODELS: dict[str, dict[str, Any]] = {
    "vgg19": {
        "name": "paper_vgg19",
        "args": {},
        "image": 32,
        "noise": 1.5,
        "target": 0.8,
        "lr": 0.005,
        # a quarter of DP's: the stale gradients of 4 VWs x Nm 4 overshoot at DP's step
        "hetpipe_lr": 0.00125,
        # the paper's VGG-19 (143.7 M parameters, 575 MB) over 56 Gbit/s takes 82 ms; a TITAN
        # V's minibatch of 32 (3 x 19.6 G multiply-adds x 2 FLOP x 32 = 3.8 TFLOP at half of
        # its 14.9 TFLOP/s) about 0.5 s: the NIC moves the model's bytes in 0.16 of a minibatch
        "link_ratio": 0.16,
    },
    "resnet152": {
        "name": "paper_resnet152",
        "args": {},
        "image": 8,
        "noise": 1.0,
        "target": 0.6,
        "lr": 0.01,
        "hetpipe_lr": 0.0025,  # a quarter of DP's, as for VGG-19
        # 60.2 M parameters (241 MB) in 34 ms; 3 x 11.3 G x 2 x 32 = 2.2 TFLOP in about 0.29 s
        "link_ratio": 0.12,
    },
}
TINY = {
    "vgg19": {
        "name": "paper_vgg19",
        "args": {"width": 2, "hidden": 128},
        "image": 32,
        "noise": 1.0,
        "target": 0.5,
        "lr": 0.005,
        "link_ratio": 0.16,
    },
    "resnet152": {
        "name": "paper_resnet152",
        "args": {"width": 1},
        "image": 8,
        "noise": 0.5,
        "target": 0.5,
        "lr": 0.01,
        "link_ratio": 0.12,
    },
}


# --------------------------------------------------------------------------- the testbed


def whole_model_bytes(spec: dict[str, Any], minibatch: int) -> tuple[int, int, int, float]:
    """Bytes the whole model needs on one device with one minibatch (the planner's memory
    model: weights, gradients, SGD momentum, activations), its number of elements, its
    parameter bytes and its forward and backward seconds per minibatch on this host."""
    import torch.nn.functional as F

    from hetpipe.core.memory import stage_memory
    from hetpipe.measure import measure_layers
    from hetpipe.models import build_model
    from hetpipe.papermodels import paper_images

    torch.manual_seed(0)
    model = build_model(spec["name"], spec["args"])
    x, y = paper_images(minibatch, spec["image"])
    layers = measure_layers(
        model, x, repeats=3, warmup=1, budget_s=0.2, loss_fn=lambda o: F.cross_entropy(o, y)
    )
    need = stage_memory(layers, 0, 1, 1, 1, x.numel() * x.element_size()).total
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return need, len(model), params, sum(lp.fwd_s + lp.bwd_s for lp in layers)


def nic_mbit(param_bytes: int, compute_s: float, fast_speed: float, ratio: float) -> float:
    """The NIC rate (Mbit/s) at which the model's parameter bytes take ``ratio`` of the
    fastest device's minibatch (``compute_s`` on this host over its emulated speed)."""
    return param_bytes * 8 / (ratio * compute_s / fast_speed) / 1e6


def testbed_nodes(base: ClusterConfig, tiny: bool) -> list[Any]:
    """``base``'s nodes on the testbed (``tiny``: its first and third)."""
    return [base.nodes[0], base.nodes[2]] if tiny else list(base.nodes)


def testbed(
    base: ClusterConfig,
    need: int,
    scale: float,
    tiny: bool,
    hosts: dict[str, str] | None = None,
    inter_gbps: float | None = None,
) -> tuple[str, dict[str, float], dict[str, int]]:
    """The cluster file for one model: ``base``'s nodes (``tiny``: its first and third node,
    two devices each), every port 0, speeds x ``scale``, caps in units of ``need`` / 10;
    ``hosts`` gives each node's address (default its own), ``inter_gbps`` the links between
    nodes (default the file's). Returns the text, each device's speed and each device's cap."""
    unit = need / WHOLE_UNITS
    nodes = testbed_nodes(base, tiny)
    per = 2 if tiny else None
    where = {n.name: (hosts or {}).get(n.name, n.host) for n in nodes}
    shards = ", ".join(f'"{where[n.name]}:0"' for n in nodes)
    lines = [
        "[ps]",
        f"shards = [{shards}]",
        "",
        "[network]",
        f"intra_node_gbps = {base.network.intra_node_gbps}",
        f"inter_node_gbps = {inter_gbps or base.network.inter_node_gbps}",
        "",
        "[runtime]",
        "heartbeat_s = 1.0",
        "lost_after_s = 60.0",  # a loaded host stalls daemons for seconds
        "",
    ]
    speeds, caps = {}, {}
    for n in nodes:
        lines += ["[[node]]", f'name = "{n.name}"', f'host = "{where[n.name]}"', ""]
        for d in n.devices[:per]:
            speeds[d.name] = round(d.speed * scale, 6)
            caps[d.name] = int(GPU_GB[d.type] * unit)
            lines += [
                "[[node.device]]",
                f'name = "{d.name}"',
                'device = "cpu"',
                f'type = "{d.type}"',
                f"memory = {caps[d.name]}",
                f"speed = {speeds[d.name]}",
                "port = 0",
                "",
            ]
    return "\n".join(lines), speeds, caps


# --------------------------------------------------------------------------- hetpipe


def job_dict(args: Any, spec: dict[str, Any], data: dict[str, str], **train: Any) -> dict[str, Any]:
    """A planned job in the job file's shape (``train`` adds or overrides train keys)."""
    return {
        "name": train.pop("name"),
        "model": {"name": spec["name"], "args": dict(spec["args"])},
        "data": {"name": "tensors", "args": dict(data)},
        "optimizer": {
            "name": "sgd",
            "lr": args.hetpipe_lr,
            "momentum": args.momentum,
            "weight_decay": args.weight_decay,
            # only where asked: the key applies to async schedules alone
            **({"merge": args.merge} if args.merge != "sum" else {}),
        },
        "train": {
            "minibatch": args.minibatch,
            "seed": args.seed,
            "schedule": "auto",
            "checkpoint_every": 0,
            **train,
        },
    }


def run_hetpipe(
    local: Any,
    args: Any,
    spec: dict[str, Any],
    data: dict[str, str],
    policy: str,
    d: int,
    param_bytes: int,
) -> dict[str, Any]:
    """One planned job to the target; its time, curve, throughput and CPU figures."""
    job = job_dict(
        args,
        spec,
        data,
        name=f"paper-{policy.lower()}-d{d}",
        policy=POLICIES[policy],
        placement=PLACEMENT.get(policy, "local"),
        vws=len(local.cluster.nodes),
        staleness=d,
        epochs=args.epochs,
        eval_every_s=args.eval_every,
        bn_recalibrate=args.bn_recalibrate,
        in_flight=args.in_flight,
    )
    pids = [p.pid for p in local.procs.values()]
    host = HostCpu().start()
    cpu0, t0 = cpu_seconds(pids), time.perf_counter()
    info = asyncio.run(_follow(local, job, spec["target"], args.max_s))
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(pids) - cpu0
    util = host.stop()
    evals = info.get("evals") or []
    hit = next((e for e in evals if e[2] >= spec["target"]), None)
    predicted = info.get("predicted") or {}
    vws = [
        {
            "devices": [s["device"] for s in v.get("stages", [])],
            "layers": [s["layers"] for s in v.get("stages", [])],
            "nm": v.get("nm"),
        }
        for v in predicted.get("vws", [])
    ]
    out = {
        "seconds": hit[0] if hit else None,
        "minibatches": hit[1] if hit else None,
        "reached": hit is not None,
        "best_accuracy": max((e[2] for e in evals), default=None),
        "curve": [[round(s, 2), n, round(acc, 3)] for s, n, acc in evals],
        "mb_per_s": (info.get("samples_per_s") or 0.0) / args.minibatch,
        "predicted_mb_per_s": (predicted.get("samples_per_s") or 0.0) / args.minibatch,
        "schedule": predicted.get("schedule"),
        "vws": vws,
        "host_utilisation": round(util, 3),
        "own_cpu_share": round(cpu / wall / (os.cpu_count() or 1), 3),
        "state": info.get("state"),
        "error": None if info.get("stopped") else info.get("error"),
        "ps_bytes_per_mb": ps_bytes_per_minibatch(param_bytes, vws),
        "stages": stage_breakdown(info),
    }
    return out


def stage_breakdown(info: dict[str, Any]) -> list[dict[str, Any]]:
    """Per stage, where its time went against the plan: the measured compute per minibatch
    and the shares of its elapsed time (busy, communication, WSP gate, bubble) at the target,
    beside the planner's compute and busy time per minibatch and the slowdown it expected
    from sharing the host. Busy per minibatch = busy share x elapsed / minibatches done."""
    pred_vws = (info.get("predicted") or {}).get("vws") or []
    rows = []
    for st in info.get("stages") or []:
        v, i = st.get("vw"), st.get("stage")
        try:
            p = pred_vws[v]["stages"][i]
        except (IndexError, KeyError, TypeError):
            p = {}
        sh = st.get("shares") or {}
        rows.append(
            {
                "vw": v,
                "stage": i,
                "device": st.get("device"),
                "done": st.get("done"),
                "time_s": st.get("time_s"),
                "predicted_time_s": p.get("time_s"),
                "predicted_busy_s": p.get("busy_s"),
                "predicted_slowdown": p.get("slowdown"),
                "shares": {k: round(float(x), 3) for k, x in sh.items()},
            }
        )
    return rows


def ps_bytes_per_minibatch(param_bytes: int, vws: list[dict[str, Any]]) -> float | None:
    """Bytes every minibatch moves to and from the parameter server under WSP: each VW
    pushes its wave's update of every layer and pulls the global weights back once per wave
    of Nm minibatches, so 2 x the model's parameter bytes per wave, over the VWs' waves."""
    waves = [v["nm"] for v in vws if v.get("nm")]
    if not waves:
        return None
    return 2 * param_bytes * len(waves) / sum(waves)


def run_model(args: Any, key: str, tmp: Path) -> dict[str, Any]:
    """Every policy and D of one model on its testbed, then DP on its devices."""
    from hetpipe.localcluster import LocalCluster
    from hetpipe.netns import NetnsCluster, Network
    from hetpipe.papermodels import write_paper_images

    spec = (TINY if args.tiny else MODELS)[key]
    if args.target is not None:
        spec = {**spec, "target": args.target}
    lr = args.lr or spec["lr"]
    het_lr = args.hetpipe_lr or (None if args.lr else spec.get("hetpipe_lr")) or lr
    args = argparse.Namespace(**{**vars(args), "lr": lr, "hetpipe_lr": het_lr})
    data = write_paper_images(
        tmp / key / "data",
        image=spec["image"],
        noise=spec["noise"],
        n_train=args.n_train,
        n_test=args.n_test,
    )
    need, n_layers, param_bytes, compute_s = whole_model_bytes(spec, args.minibatch)
    base = load_cluster(args.cluster)
    nodes = [n.name for n in testbed_nodes(base, args.tiny)]
    links: dict[str, Any] = {"mode": args.links}
    with contextlib.ExitStack() as stack:
        net = None
        if args.links == "shaped":
            fast = max(d.speed for n in testbed_nodes(base, args.tiny) for d in n.devices)
            ratio = args.link_ratio or spec["link_ratio"]
            mbit = nic_mbit(param_bytes, compute_s, fast * args.speed_scale, ratio)
            net = stack.enter_context(Network(nodes, nic_mbit=dict.fromkeys(nodes, mbit)))
            links.update(nic_mbit=round(mbit, 1), link_ratio=ratio)
        hosts = {h: net.address(h) for h in nodes} if net else None
        text, speeds, caps = testbed(
            base,
            need,
            args.speed_scale,
            args.tiny,
            hosts,
            links["nic_mbit"] / 1000 if net else None,
        )
        path = tmp / key / "cluster.toml"
        path.write_text(text)
        dp_devices = tuple(d for d, cap in caps.items() if cap >= need)
        print(
            f"{key}: {spec['name']} {spec['args']}, {n_layers} elements, needs "
            f"{need / 2**20:.1f} MiB whole; DP on {', '.join(dp_devices)}; links "
            + (f"shaped, every node's NIC {links['nic_mbit']} Mbit/s" if net else "not shaped"),
            flush=True,
        )
        runs: dict[str, Any] = {}
        run_dir = tmp / key / "run"
        local = (
            NetnsCluster(net, path, run_dir, timeout=WAIT_S)
            if net
            else LocalCluster(path, run_dir, timeout=WAIT_S)
        )
        with local:
            # one short job per formation policy, planned as the timed ones are: every
            # device it uses takes its first assignment (imports, connections) untimed, as
            # DP's ranks are up before their clock starts
            for policy in dict.fromkeys(POLICIES[p] for p in args.policies):
                warm = job_dict(
                    args,
                    spec,
                    data,
                    name=f"paper-warmup-{policy}",
                    policy=policy,
                    vws=len(local.cluster.nodes),
                    minibatches=WARM_MINIBATCHES,
                )
                info = local.submit(warm, timeout=WAIT_S)
                if info["state"] != "done":
                    raise RuntimeError(f"hetpipe warm-up job {info['state']}: {info.get('error')}")
            for policy in args.policies:
                for d in args.staleness:
                    name = f"{policy} D={d}"
                    runs[name] = r = run_hetpipe(local, args, spec, data, policy, d, param_bytes)
                    print(
                        f"  hetpipe {name}: "
                        + (f"{r['seconds']:.1f} s" if r["reached"] else "target missed")
                        + f" ({r['minibatches']} minibatches), {r['mb_per_s']:.2f} mb/s "
                        f"(planned {r['predicted_mb_per_s']:.2f}, {r['schedule']}), host "
                        f"{r['host_utilisation']:.2f}, own {r['own_cpu_share']:.2f}",
                        flush=True,
                    )
        node_of = {d.name: n.name for n in local.cluster.nodes for d in n.devices}
        dp_hosts = (
            {d: (net.namespace(node_of[d]), net.address(node_of[d])) for d in dp_devices}
            if net
            else None
        )
        dp = run_dp(args, spec, data, speeds, dp_devices, n_layers, param_bytes, dp_hosts)
    print(
        f"  DP W={len(dp_devices)}: "
        + (f"{dp['seconds']:.1f} s" if dp["reached"] else "target missed")
        + f" ({dp['minibatches']} minibatches), {dp['mb_per_s']:.2f} mb/s, host "
        f"{dp['host_utilisation']:.2f}, own {dp['own_cpu_share']:.2f}",
        flush=True,
    )
    return {
        "model": spec["name"],
        "model_args": spec["args"],
        "lr": args.lr,
        "hetpipe_lr": args.hetpipe_lr,
        "merge": args.merge,
        "layers": n_layers,
        "target": spec["target"],
        "noise": spec["noise"],
        "image": spec["image"],
        "whole_model_bytes": need,
        "compute_ms_per_mb": round(compute_s * 1e3, 2),
        "links": links,
        "param_bytes": param_bytes,
        "caps": caps,
        "speeds": speeds,
        "dp_devices": list(dp_devices),
        "hetpipe": runs,
        "dp": dp,
    }


def run_dp(
    args: Any,
    spec: dict[str, Any],
    data: dict[str, str],
    speeds: dict[str, float],
    devices: tuple[str, ...],
    n_layers: int,
    param_bytes: int,
    hosts: dict[str, tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """DDP over gloo on ``devices``, each rank padded to its speed (``bench_convergence``),
    on its device's host where ``hosts`` names them (namespace, address)."""
    if not devices:
        return {"seconds": None, "minibatches": None, "reached": False, "mb_per_s": 0.0}
    # W: lr means the same per minibatch on both sides; the model's own target
    args = argparse.Namespace(**{**vars(args), "ddp_lr_scale": None, "target": spec["target"]})
    job = {
        "model": spec["name"],
        "model_args": dict(spec["args"]),
        "data": "tensors",
        "data_args": dict(data),
        "n_layers": n_layers,
        "target": spec["target"],
    }
    # a run may take max_s of training plus its evaluations: wait for its ranks that long
    bench_convergence.WAIT_S = max(bench_convergence.WAIT_S, 2 * args.max_s + 120.0)
    ddp = Ddp(args, speeds, math.nan, devices, job, hosts).start()
    try:
        host = HostCpu().start()
        r = ddp.run(args.seed)
        util = host.stop()
    finally:
        ddp.stop()
    return {
        "seconds": r["seconds"],
        "minibatches": r["minibatches"],
        "reached": r["seconds"] is not None,
        "best_accuracy": max((e[2] for e in r["curve"]), default=None),
        "curve": r["curve"],
        "mb_per_s": r["mb_per_s"],
        "host_utilisation": round(util, 3),
        "own_cpu_share": round(r["cpu_cores"] / (os.cpu_count() or 1), 3),
        "world": len(devices),
        # each rank's forward + backward per step on the wall clock (host stalls included)
        "rank_compute_ms": [round(st["compute_ms"], 2) for st in r["stages"]],
        # a ring all-reduce sends and receives 2 (W - 1) / W of the gradients per rank
        "allreduce_bytes_per_mb": 2 * (len(devices) - 1) / len(devices) * param_bytes,
    }


# --------------------------------------------------------------------------- main


def ranking(runs: dict[str, Any]) -> list[str]:
    """Policies (each at its best D) fastest to target first; those that missed it after,
    highest accuracy reached first."""
    best: dict[str, tuple[float, float]] = {}
    for name, r in runs.items():
        policy = name.split(" D=")[0]
        s = r["seconds"] if r["seconds"] is not None else math.inf
        key = (s, -(r.get("best_accuracy") or 0.0))
        best[policy] = min(best.get(policy, key), key)
    return sorted(best, key=lambda p: best[p])


def first_reach(curve: list[list[float]], accuracy: float) -> float | None:
    """Seconds at which a ``[seconds, minibatches, accuracy]`` curve first reaches
    ``accuracy``, None if it never does."""
    return next((s for s, _n, acc in curve if acc >= accuracy), None)


def at_common_accuracy(result: dict[str, Any]) -> dict[str, Any] | None:
    """Where the target was missed: the highest accuracy both the best hetpipe way and DP
    reached, and each side's time to it (a secondary figure, never the target)."""
    runs = [r for r in result["hetpipe"].values() if r.get("curve")]
    dp_curve = result["dp"].get("curve") or []
    if not runs or not dp_curve:
        return None
    dp_best = max(acc for _s, _n, acc in dp_curve)
    best = None
    for r in runs:
        level = min(dp_best, max(acc for _s, _n, acc in r["curve"]))
        het_s = first_reach(r["curve"], level)
        if best is None or level > best[0] or (level == best[0] and het_s < best[1]):
            best = (level, het_s)
    assert best is not None
    level, het_s = best
    dp_s = first_reach(dp_curve, level)
    return {
        "accuracy": level,
        "hetpipe_seconds": het_s,
        "dp_seconds": dp_s,
        "speedup": dp_s / het_s if het_s and dp_s else None,
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """The best hetpipe way, DP's time, the speedup, the ranking and the top utilisation."""
    runs = result["hetpipe"]
    reached = {n: r["seconds"] for n, r in runs.items() if r.get("seconds") is not None}
    best = min(reached, key=lambda n: reached[n]) if reached else None
    dp_s = result["dp"]["seconds"]
    speedup = dp_s / reached[best] if best is not None and dp_s is not None else None
    utils = [r["host_utilisation"] for r in runs.values() if "host_utilisation" in r]
    utils += [result["dp"].get("host_utilisation", 0.0)]
    own = [r["own_cpu_share"] for r in runs.values() if "own_cpu_share" in r]
    own += [result["dp"].get("own_cpu_share", 0.0)]
    return {
        "best": best,
        "hetpipe_seconds_to_target": reached.get(best) if best else None,
        "dp_seconds_to_target": dp_s,
        "speedup_vs_dp": speedup,
        "ranking": ranking(runs),
        "at_common_accuracy": at_common_accuracy(result),
        "host_utilisation_max": max(utils),
        "own_cpu_share_max": max(own),
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument(
        "--policies", nargs="+", choices=list(POLICIES), default=["NP", "ED", "ED-local", "HD"]
    )
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 4, 32], help="WSP D values")
    ap.add_argument("--tiny", action="store_true", help="two nodes of two devices, small models")
    ap.add_argument("--target", type=float, default=None, help="test accuracy (default: per model)")
    ap.add_argument(
        "--speed-scale",
        type=float,
        default=None,
        help="x every device's speed (default 0.05; --tiny 0.25): low enough that the "
        "emulated devices mostly sleep",
    )
    ap.add_argument("--epochs", type=int, default=20, help="cap on data passes, both sides")
    ap.add_argument("--max-s", type=float, default=None, help="cap on seconds per run")
    ap.add_argument(
        "--lr", type=float, default=None, help="per-minibatch learning rate (default: per model)"
    )
    ap.add_argument(
        "--hetpipe-lr",
        type=float,
        default=None,
        help="hetpipe's per-minibatch learning rate (default: the model's own where it has "
        "one and --lr is not given, else --lr: the same as DP's)",
    )
    ap.add_argument(
        "--merge",
        choices=["sum", "mean"],
        default="sum",
        help="hetpipe: how the shards combine the virtual workers' updates (optimizer.merge)",
    )
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--minibatch", type=int, default=32)
    ap.add_argument("--eval-every", type=float, default=2.0, help="seconds between evals")
    ap.add_argument(
        "--bn-recalibrate",
        type=int,
        default=0,
        help="hetpipe: minibatches re-estimating the global weights' batch-norm statistics "
        "before each evaluation (train.bn_recalibrate)",
    )
    ap.add_argument(
        "--in-flight",
        choices=["plan", "nm"],
        default="plan",
        help="hetpipe: what bounds the minibatches an async stage holds (train.in_flight)",
    )
    ap.add_argument("--n-train", type=int, default=8192)
    ap.add_argument("--n-test", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cluster", default=str(TESTBED))
    ap.add_argument(
        "--links",
        choices=["shaped", "planner"],
        default=None,
        help="shaped: every node a network namespace with its NIC capped (default where "
        "namespaces can be made); planner: loopback, the links the planner's figures only",
    )
    ap.add_argument(
        "--link-ratio",
        type=float,
        default=None,
        help="with --links shaped: the model's parameter bytes over a NIC as a share of the "
        "fastest device's minibatch (default: the model's estimate of the paper's)",
    )
    args = ap.parse_args()
    if args.link_ratio is not None and not args.link_ratio > 0:
        ap.error("--link-ratio must be > 0")
    if args.links is None:
        from hetpipe.netns import unavailable

        args.links = "planner" if unavailable() else "shaped"
    if args.speed_scale is None:
        args.speed_scale = 0.25 if args.tiny else 0.05
    if not 0 < args.speed_scale <= 1:
        ap.error("--speed-scale must be in (0, 1]")
    if args.max_s is None:
        args.max_s = 60.0 if args.tiny else 600.0
    torch.set_num_threads(1)
    started = time.perf_counter()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-paper-") as tmp:
        for key in args.models:
            results[key] = run_model(args, key, Path(tmp))
            results[key]["summary"] = summarize(results[key])
    wall = time.perf_counter() - started
    rows = []
    for key, res in results.items():
        for name, r in res["hetpipe"].items():
            rows.append(_row(key, f"hetpipe {name}", r))
        rows.append(_row(key, f"DP W={res['dp'].get('world', 0)}", res["dp"]))
    print_table(["model", "way", "s to target", "minibatches", "mb/s", "host cpu", "own cpu"], rows)
    out: dict[str, Any] = {
        "bench": "paper",
        "machine": machine(),
        "speed_scale": args.speed_scale,
        "tiny": args.tiny,
        "minibatch": args.minibatch,
        "momentum": args.momentum,
        "weight_decay": args.weight_decay,
        "merge": args.merge,
        "links": args.links,
        "eval_every_s": args.eval_every,
        "bn_recalibrate": args.bn_recalibrate,
        "in_flight": args.in_flight,
        "policies": args.policies,
        "staleness": args.staleness,
        "models": results,
        "seconds": round(wall, 1),
    }
    for key, res in results.items():
        s = res["summary"]
        out[f"speedup_vs_dp_{key}"] = s["speedup_vs_dp"]
        out[f"ranking_{key}"] = s["ranking"]
        print(
            f"{key}: speedup_vs_dp {s['speedup_vs_dp'] if s['speedup_vs_dp'] else 'n/a'} "
            f"(best {s['best']}), ranking {' > '.join(s['ranking'])}"
        )
    out["host_utilisation_max"] = max(
        r["summary"]["host_utilisation_max"] for r in results.values()
    )
    out["own_cpu_share_max"] = max(r["summary"]["own_cpu_share_max"] for r in results.values())
    print(
        f"host cpu utilisation max {out['host_utilisation_max']:.2f} (every process of the host), "
        f"this benchmark's own share max {out['own_cpu_share_max']:.2f}; total {wall:.0f} s"
    )
    if args.json:
        emit_json(out)


def _row(key: str, way: str, r: dict[str, Any]) -> list[Any]:
    return [
        key,
        way,
        f"{r['seconds']:.1f}" if r.get("seconds") is not None else "missed",
        r.get("minibatches") if r.get("minibatches") is not None else "-",
        round(r.get("mb_per_s", 0.0), 2),
        r.get("host_utilisation", "-"),
        r.get("own_cpu_share", "-"),
    ]


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
