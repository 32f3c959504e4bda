"""A job trains with ``[security] data_path = "mac"``: real daemons on loopback.

Activations, gradients and parameter-server traffic go on the daemons' plain data ports,
tagged and checked (hetpipe.framemac); the job must train as it does under Curve, and no
daemon may have refused a message of its own cluster.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import UNIFORM, job

from hetpipe.localcluster import LocalCluster, cluster_toml

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def mac_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("mac-e2e")
    path = root / "cluster.toml"
    text = cluster_toml(UNIFORM[:3], shards=2)
    path.write_text(text.replace("[security]\n", '[security]\ndata_path = "mac"\n', 1))
    with LocalCluster(path, root / "run", timeout=60) as c:
        assert c.cluster.security.curve and c.cluster.security.data_path == "mac"
        yield c


def test_a_pipelined_job_trains_over_the_mac_data_path(mac_cluster: LocalCluster) -> None:
    c = mac_cluster
    spec = job("mac", split=[(["gpu0", "gpu1", "gpu2"], [2, 2, 2])], nm=2, minibatches=40)
    info = c.submit(spec)
    assert info["state"] == "done", info.get("error")
    assert info["minibatches"] == 40
    logs = "".join(p.read_text(errors="replace") for p in Path(c.run_dir).rglob("*.log"))
    assert "data message refused" not in logs and "session key refused" not in logs
