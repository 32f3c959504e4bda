"""``scripts/bench_paper.py``: the paper's testbed, its models, and the benchmark at a tiny size.

The pure parts (the testbed file, the ranking) are checked without processes; one test runs
the whole benchmark at ``--tiny`` (two nodes of two emulated devices, a narrow VGG-19, a few
hundred minibatches at most) and checks what its JSON reports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import load_script

from hetpipe.config import load_cluster
from hetpipe.models import build_model
from hetpipe.netns import unavailable
from hetpipe.papermodels import paper_images, write_paper_images

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_paper")


def test_the_testbed_file_is_the_papers_cluster() -> None:
    cluster = load_cluster(ROOT / "examples" / "paper_testbed.toml")
    assert len(cluster.nodes) == 4 and len(cluster.ps) == 4
    assert [len(n.devices) for n in cluster.nodes] == [4, 4, 4, 4]
    assert len({n.host for n in cluster.nodes}) == 4  # placement sees four hosts
    types = [{d.type for d in n.devices} for n in cluster.nodes]
    assert all(len(t) == 1 for t in types)  # one GPU type per node
    speed = {d.type: d.speed for d in cluster.devices}
    memory = {d.type: d.memory for d in cluster.devices}
    # FP32 throughput's ratio: TITAN RTX > TITAN V > RTX 2060 > Quadro P4000
    assert speed["titan-rtx"] > speed["titan-v"] > speed["rtx-2060"] > speed["p4000"]
    assert speed["titan-v"] / speed["p4000"] == pytest.approx(14.9 / 5.3, rel=0.01)
    # memory's ratio 24 : 12 : 8 : 6
    assert memory["titan-rtx"] / memory["rtx-2060"] == pytest.approx(4.0, rel=0.01)
    assert memory["titan-v"] / memory["p4000"] == pytest.approx(1.5, rel=0.01)
    # PCIe inside a node faster than InfiniBand between nodes, the paper's ratio
    net = cluster.network
    assert net.intra_node_gbps / net.inter_node_gbps == pytest.approx(126 / 56)


def test_testbed_caps_let_only_the_large_gpus_hold_the_whole_model(bench: ModuleType) -> None:
    base = load_cluster(ROOT / "examples" / "paper_testbed.toml")
    need = 10 << 20
    text, speeds, caps = bench.testbed(base, need, 0.1, tiny=False)
    assert len(caps) == 16 and "port = 0" in text
    holds = {d for d, cap in caps.items() if cap >= need}
    assert holds == {d.name for d in base.devices if d.type in ("titan-v", "titan-rtx")}
    assert speeds["r0"] == pytest.approx(0.1) and speeds["q0"] == pytest.approx(0.0325)
    _, _, tiny = bench.testbed(base, need, 0.1, tiny=True)
    assert sorted(tiny) == ["g0", "g1", "v0", "v1"]


def test_shaped_testbed_puts_nodes_on_their_hosts_at_the_nic_rate(
    bench: ModuleType, tmp_path: Path
) -> None:
    base = load_cluster(ROOT / "examples" / "paper_testbed.toml")
    hosts = {f"node{i}": f"10.9.0.{i + 2}" for i in range(4)}
    text, _, _ = bench.testbed(base, 10 << 20, 0.1, False, hosts, 0.25)
    path = tmp_path / "c.toml"
    path.write_text(text)
    shaped = load_cluster(path)
    assert {n.name: n.host for n in shaped.nodes} == hosts
    assert sorted(s.host for s in shaped.ps) == sorted(hosts.values())
    assert shaped.network.inter_node_gbps == pytest.approx(0.25)
    # 4 MB of parameters in 0.16 of a 0.4 s minibatch (0.02 s of CPU at speed 0.05)
    assert bench.nic_mbit(4_000_000, 0.02, 0.05, 0.16) == pytest.approx(500.0)


def test_ranking_puts_missed_targets_last(bench: ModuleType) -> None:
    runs = {
        "NP D=0": {"seconds": None, "best_accuracy": 0.7},
        "NP D=4": {"seconds": 30.0},
        "ED-local D=4": {"seconds": 20.0},
        "HD D=4": {"seconds": None, "best_accuracy": 0.6},
        "HD D=0": {"seconds": None, "best_accuracy": 0.5},
    }
    assert bench.ranking(runs) == ["ED-local", "NP", "HD"]
    missed = {"NP D=4": runs["HD D=0"], "HD D=4": runs["HD D=4"]}
    assert bench.ranking(missed) == ["HD", "NP"]  # the higher accuracy reached first


def test_common_accuracy_compares_where_both_sides_got(bench: ModuleType) -> None:
    result = {
        "hetpipe": {
            "ED-local D=4": {"curve": [[10, 100, 0.3], [20, 200, 0.6], [30, 300, 0.7]]},
            "NP D=4": {"curve": [[10, 100, 0.5], [20, 200, 0.6]]},
        },
        "dp": {"curve": [[15, 100, 0.4], [40, 300, 0.65]]},
    }
    got = bench.at_common_accuracy(result)
    assert got == {"accuracy": 0.65, "hetpipe_seconds": 30, "dp_seconds": 40, "speedup": 40 / 30}


def test_paper_models_keep_the_papers_shapes() -> None:
    vgg = build_model("paper_vgg19")
    convs = [m for m in vgg if isinstance(m, torch.nn.Conv2d)]
    fcs = [m for m in vgg if isinstance(m, torch.nn.Linear)]
    assert len(convs) == 16 and len(fcs) == 3
    assert sum(isinstance(m, torch.nn.MaxPool2d) for m in vgg) == 5
    total = sum(p.numel() for p in vgg.parameters())
    assert sum(p.numel() for m in fcs for p in m.parameters()) > 0.8 * total
    from hetpipe.models import Bottleneck

    resnet = build_model("paper_resnet152")
    assert sum(isinstance(m, Bottleneck) for m in resnet) == 3 + 8 + 36 + 3
    x, y = paper_images(4, 8)
    assert tuple(resnet(x).shape) == (4, 10) and y.dtype == torch.int64


def test_paper_images_are_one_task_across_splits(tmp_path: Path) -> None:
    a, ya = paper_images(64, 32, seed=1)
    b, yb = paper_images(64, 32, seed=1)
    assert torch.equal(a, b) and torch.equal(ya, yb)
    args = write_paper_images(tmp_path, image=32, n_train=16, n_test=8)
    assert set(args) == {"path", "val_path"}
    from hetpipe.data import load_data

    source = load_data("tensors", args)
    assert source.val is not None and len(source.val) == 8


def test_hetpipe_learning_rate_and_merge_go_into_its_job(bench: ModuleType) -> None:
    """``--hetpipe-lr`` and ``--merge`` set hetpipe's optimizer only; the default merge (sum)
    leaves the key out, so a synchronous schedule the planner picks still accepts the job."""
    from hetpipe.job import JobSpec

    data = {"path": "train.npz"}
    args = argparse.Namespace(
        lr=0.005,
        hetpipe_lr=0.00125,
        momentum=0.9,
        weight_decay=1e-4,
        merge="mean",
        minibatch=32,
        seed=0,
    )
    job = bench.job_dict(args, bench.MODELS["vgg19"], data, name="j", policy="ed", epochs=1)
    spec = JobSpec.from_dict(job, source="j")
    assert spec.optimizer.lr == 0.00125 and spec.optimizer.merge == "mean"
    args.merge = "sum"
    job = bench.job_dict(args, bench.MODELS["vgg19"], data, name="j", policy="np", epochs=1)
    assert "merge" not in job["optimizer"]
    assert JobSpec.from_dict(job, source="j").optimizer.merge == "sum"


@pytest.fixture(scope="module")
def probe() -> ModuleType:
    return load_script("probe_paper_staleness")


def test_probe_sgd_step_is_torchs(probe: ModuleType) -> None:
    """The replay's out-of-place step is torch.optim.SGD's (L2 decay, momentum)."""
    torch.manual_seed(0)
    w = torch.randn(5, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9, weight_decay=0.01)
    params, mom = {"w": w.detach().clone()}, {}
    for _ in range(3):
        g = torch.randn(5)
        w.grad = g.clone()
        opt.step()
        deltas = probe.sgd(params, {"w": g}, mom, 0.1, 0.9, 0.01)
        params = {"w": params["w"] + deltas["w"]}
        assert torch.allclose(params["w"], w.detach(), atol=1e-6)


def test_probe_one_virtual_worker_of_depth_one_is_one_dp_rank(probe: ModuleType) -> None:
    """Both replays reduce to plain SGD: WSP with one VW and Nm = 1 and DP with one rank
    reach the same accuracies on the same minibatches."""

    def run(way: str) -> list[list[float]]:
        task = probe.Task("resnet152", 0, 64, 32)
        a = argparse.Namespace(
            way=way,
            world=1,
            dp_lr_scale=None,
            vws=1,
            nm=1,
            merge="sum",
            pull_alone=False,
            lr=0.01,
            momentum=0.9,
            weight_decay=1e-4,
            minibatch=8,
            target=2.0,
            max_mb=4,
            eval_every=2,
            progress=False,
        )
        return (probe.run_dp if way == "dp" else probe.run_wsp)(task, a)["curve"]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the probe runs: one thread, no spinning peers on a busy host
    try:
        dp, wsp = run("dp"), run("wsp")
    finally:
        torch.set_num_threads(threads)
    assert [n for n, _ in dp] == [n for n, _ in wsp] == [2, 4]
    assert [acc for _, acc in dp] == pytest.approx([acc for _, acc in wsp])


@pytest.mark.timeout(400)
def test_tiny_benchmark_reports_every_figure() -> None:
    """The benchmark end to end at its tiny size: hetpipe (ED-local, D = 4) on two nodes of
    two devices against DP on the two that hold the model."""
    cmd = [sys.executable, str(SCRIPTS / "bench_paper.py"), "--tiny", "--json"]
    cmd += ["--models", "vgg19", "--policies", "ED-local", "--staleness", "4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=380, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("speedup_vs_dp_vgg19", "ranking_vgg19", "host_utilisation_max", "models"):
        assert key in out
    assert math.isfinite(out["host_utilisation_max"]) and 0 <= out["host_utilisation_max"] <= 1
    res = out["models"]["vgg19"]
    run = res["hetpipe"]["ED-local D=4"]
    assert math.isfinite(run["mb_per_s"]) and run["mb_per_s"] > 0
    assert run["predicted_mb_per_s"] > 0
    assert math.isfinite(run["host_utilisation"]) and math.isfinite(run["own_cpu_share"])
    # reached its target, or says it did not (and how far it got)
    if run["reached"]:
        assert run["seconds"] > 0 and run["minibatches"] > 0
    else:
        assert run["seconds"] is None and run["best_accuracy"] is not None
    # each stage's measured compute and time shares beside the plan's figures
    planned = {(v, i) for v, vw in enumerate(run["vws"]) for i in range(len(vw["devices"]))}
    assert {(s["vw"], s["stage"]) for s in run["stages"]} == planned
    for s in run["stages"]:
        assert s["time_s"] > 0 and s["predicted_time_s"] > 0 and s["predicted_busy_s"] > 0
        assert set(s["shares"]) == {"busy", "comm", "gate", "bubble"}
        assert 0.0 < s["shares"]["busy"] <= 1.0 and sum(s["shares"].values()) <= 1.05
    assert out["ranking_vgg19"] == ["ED-local"]
    # DP used exactly the devices whose cap holds the whole model: the two TITAN Vs
    assert res["dp_devices"] == ["v0", "v1"]
    assert all(res["caps"][d] >= res["whole_model_bytes"] for d in res["dp_devices"])
    assert all(res["caps"][d] < res["whole_model_bytes"] for d in ("g0", "g1"))
    assert res["dp"]["world"] == 2 and res["dp"]["mb_per_s"] > 0
    # every node its own shaped host where namespaces can be made, loopback otherwise
    assert res["links"]["mode"] == ("planner" if unavailable() else "shaped")
    if res["links"]["mode"] == "shaped":
        assert res["links"]["nic_mbit"] > 0
    if out["speedup_vs_dp_vgg19"] is not None:
        assert math.isfinite(out["speedup_vs_dp_vgg19"]) and out["speedup_vs_dp_vgg19"] > 0
