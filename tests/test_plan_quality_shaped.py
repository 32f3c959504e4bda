"""Local against default parameter placement on a real shaped link (network namespaces):
the run and the planner's prediction rank them the same way.

Needs root and iproute2; skipped with the reason where namespaces cannot be made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hetpipe.localcluster import DeviceDef
from hetpipe.models import build_model
from hetpipe.netns import Link, NetnsCluster, Network, netns_cluster_toml, unavailable

WHY = unavailable()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(WHY is not None, reason=f"no network namespaces: {WHY}"),
]

HIDDEN = [512] * 4  # ~1 MiB of parameters per hidden layer: the pushes and pulls weigh


def job(placement: str) -> dict[str, Any]:
    """Two VWs a0 > b0 and a1 > b1 (ED), the same split, state placed by ``placement``."""
    n = len(build_model("mlp", {"hidden": HIDDEN}))
    return {
        "name": placement,
        "model": {"name": "mlp", "args": {"hidden": HIDDEN}},
        "data": {"name": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.01},
        "train": {
            "minibatch": 32,
            "minibatches": 64,
            "staleness": 0,
            "seed": 0,
            "placement": placement,
        },
        "vw": [{"devices": [f"a{v}", f"b{v}"], "layers": [n // 2, n - n // 2]} for v in range(2)],
    }


def test_local_placement_beats_default_on_a_shaped_link(tmp_path: Path) -> None:
    hosts = {h: [DeviceDef(f"{h}{i}", "fast", "1GiB", 0.1) for i in range(2)] for h in "ab"}
    with Network(list(hosts), [Link("a", "b", mbit=40)]) as net:
        path = tmp_path / "cluster.toml"
        path.write_text(netns_cluster_toml(net, hosts, shards=["a", "b"], lost_after_s=30.0))
        with NetnsCluster(net, path, tmp_path / "run", timeout=120) as c:
            got = {pl: c.submit(job(pl), timeout=600) for pl in ("local", "default")}
    for pl, info in got.items():
        assert info["state"] == "done", (pl, info.get("error"))
    rate = {pl: sum(v["samples_per_s"] for v in info["vws"]) for pl, info in got.items()}
    predicted = {pl: info["predicted"]["samples_per_s"] for pl, info in got.items()}
    assert rate["local"] > rate["default"], rate
    assert predicted["local"] > predicted["default"], predicted
