"""The namespace harness: shaped links near their rate, a job across two hosts, nothing left.

Needs root and iproute2; skipped with the reason where namespaces cannot be made.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import job
from helpers import job_toml

from hetpipe.config import load_cluster
from hetpipe.localcluster import DeviceDef
from hetpipe.netns import (
    Link,
    NetnsCluster,
    NetnsError,
    Network,
    enter,
    measure_mbit,
    netns_cluster_toml,
    sweep_stale,
    unavailable,
)

WHY = unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no network namespaces: {WHY}")


def leftovers(token: str) -> list[str]:
    """Namespaces and links of this machine whose name carries ``token``."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = json.loads(
        subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True).stdout or "[]"
    )
    return [line.split()[0] for line in ns.splitlines() if token in line] + [
        ln["ifname"] for ln in links if token in ln["ifname"]
    ]


def test_shaped_link_near_its_rate_and_unshaped_much_faster() -> None:
    with Network(["a", "b", "c"], [Link("a", "b", mbit=20)]) as net:
        ab = measure_mbit(net, "a", "b", 2_500_000)
        ba = measure_mbit(net, "b", "a", 2_500_000)
        ac = measure_mbit(net, "a", "c", 50_000_000)
    # payload rate: the cap counts Ethernet, IP and TCP headers too (~4.5 % at MTU 1500)
    assert 0.8 * 20 <= ab <= 1.02 * 20, ab
    assert 0.8 * 20 <= ba <= 1.02 * 20, ba
    assert ac > 10 * 20, ac


def test_nic_caps_a_hosts_sends_together_and_a_link_keeps_its_own_class() -> None:
    with Network(["a", "b", "c", "d"], [Link("a", "d", mbit=60)], nic_mbit={"a": 20}) as net:
        alone = measure_mbit(net, "a", "b", 2_500_000)
        rates: dict[str, float] = {}
        both = [
            threading.Thread(
                target=lambda h=h: rates.__setitem__(h, measure_mbit(net, "a", h, 2_500_000))
            )
            for h in ("b", "c")
        ]
        t0 = time.perf_counter()
        for t in both:
            t.start()
        for t in both:
            t.join(timeout=120)
        together_s = time.perf_counter() - t0
        linked = measure_mbit(net, "a", "d", 5_000_000)
        back = measure_mbit(net, "b", "a", 20_000_000)
    assert 0.8 * 20 <= alone <= 1.02 * 20, alone
    # two streams share the one NIC: 2 x 2.5 MB at 20 Mbit/s takes at least 2 s
    assert together_s >= 2 * 2_500_000 * 8 / 20e6 * 0.95, (together_s, rates)
    assert 0.8 * 60 <= linked <= 1.02 * 60, linked
    assert back > 5 * 20, back  # only a's sends are capped


def test_enter_moves_a_process_onto_its_host() -> None:
    with Network(["a", "b"]) as net:
        code = (
            "import socket, sys; from hetpipe.netns import enter; enter(sys.argv[1]); "
            "s = socket.socket(); s.bind((sys.argv[2], 0)); print('bound')"
        )
        inside = subprocess.run(
            [sys.executable, "-c", code, net.namespace("a"), net.address("a")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        # outside the namespace the host's address is not this machine's
        outside = subprocess.run(
            [sys.executable, "-c", code.replace("enter(sys.argv[1]); ", ""), "x", net.address("a")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert inside.stdout.strip() == "bound", inside.stderr
    assert "Cannot assign requested address" in outside.stderr
    with pytest.raises(
        NetnsError, match="cannot enter network namespace hetpipe-0-none-x: it does not exist"
    ):
        enter("hetpipe-0-none-x")


CONNECT = """
import socket, sys, time
t0 = time.perf_counter()
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30).close()
print(time.perf_counter() - t0)
"""


def test_delay_is_shaped_or_refused_clearly() -> None:
    """A link delay needs netem: where the kernel has it a connection's handshake takes the
    round trip; where it has not, the start fails with that reason and leaves nothing."""
    net = Network(["a", "b"], [Link("a", "b", mbit=100, delay_ms=25)])
    try:
        with net:
            sink = net.popen(
                "b",
                [
                    sys.executable,
                    "-c",
                    "import socket, sys\n"
                    "s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)\n"
                    "print(s.getsockname()[1], flush=True); s.accept()",
                    net.address("b"),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert sink.stdout is not None
                port = sink.stdout.readline().strip()
                done = net.run(
                    "a",
                    [sys.executable, "-c", CONNECT, net.address("b"), port],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
            finally:
                sink.kill()
                sink.wait(timeout=10)
            assert float(done.stdout) >= 2 * 0.025 * 0.9, done.stdout  # SYN out, SYN-ACK back
    except NetnsError as exc:
        assert "netem" in str(exc), exc
        assert leftovers(net.token) == []
        pytest.skip(f"this kernel cannot delay a link: {exc}")
    assert leftovers(net.token) == []


def test_job_runs_across_two_hosts(tmp_path: Path) -> None:
    hosts = {"a": [DeviceDef("d0", memory="256MiB")], "b": [DeviceDef("d1", memory="256MiB")]}
    with Network(list(hosts), [Link("a", "b", mbit=50)]) as net:
        path = tmp_path / "cluster.toml"
        path.write_text(netns_cluster_toml(net, hosts, shards=["a", "b"]))
        cluster = load_cluster(path)
        assert cluster.network.gbps(cluster.device("d0"), cluster.device("d1")) == 0.05
        assert {n.host for n in cluster.nodes} == {net.address("a"), net.address("b")}
        with NetnsCluster(net, path, tmp_path / "run", timeout=60) as c:
            workers = {w["device"]: w["address"] for w in c.status()["workers"]}
            assert workers["d0"].startswith(f"tcp://{net.address('a')}:")
            assert workers["d1"].startswith(f"tcp://{net.address('b')}:")
            info = c.submit(
                job("across", split=[(["d0", "d1"], [3, 3])], minibatches=20), timeout=240
            )
        assert info["state"] == "done", info.get("error")
        assert [s["device"] for s in info["stages"]] == ["d0", "d1"]
        token = net.token
    assert leftovers(token) == []


def test_two_vws_over_two_hosts_driven_from_a_third(tmp_path: Path) -> None:
    """Two virtual workers, each with a stage on host a and one on host b, train to the
    usual accuracy; the CLI on a third host (no daemons of its own, the cluster file and the
    client key only) submits, sees every worker, and cancels a second job."""
    hosts = {
        "a": [DeviceDef("d0", memory="256MiB"), DeviceDef("d1", memory="256MiB")],
        "b": [DeviceDef("d2", memory="256MiB"), DeviceDef("d3", memory="256MiB")],
    }
    with Network(["a", "b", "c"], [Link("a", "b", mbit=200)]) as net:
        path = tmp_path / "cluster.toml"
        path.write_text(netns_cluster_toml(net, hosts, shards=["a", "b"]))
        run = tmp_path / "run"
        CLI = (sys.executable, "-m", "hetpipe.cli")

        head = ""  # the head's address, bound when the cluster starts

        def cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
            return net.run(
                "c",
                [*CLI, "--cluster", str(path), "--run-dir", str(run), "--head", head, *argv],
                capture_output=True,
                text=True,
                timeout=timeout,
            )

        with NetnsCluster(net, path, run, timeout=60) as c:
            head = c.head
            split = [(["d0", "d2"], [3, 3]), (["d1", "d3"], [3, 3])]
            two = tmp_path / "two.toml"
            spec = job("two-hosts", split=split, nm=2, epochs=6)
            # synchronous: the weights do not depend on how the host schedules the workers
            # (an async run's staleness does, and a loaded host lowered its accuracy)
            spec["train"]["schedule"] = "1f1b"
            del spec["train"]["staleness"]
            two.write_text(job_toml(spec))
            done = cli("submit", str(two), "--json", timeout=300)
            assert done.returncode == 0, done.stderr
            info = json.loads(done.stdout.strip().splitlines()[-1])
            assert info["status"] == "done", info
            assert info["test_accuracy"] >= 0.9, info
            long = tmp_path / "long.toml"
            long.write_text(job_toml(job("long", split=split[:1], minibatches=100_000)))
            sent = cli("submit", str(long))
            assert sent.returncode == 0, sent.stderr
            seen = json.loads(cli("status", "--json").stdout)
            assert {w["device"] for w in seen["workers"]} == {"d0", "d1", "d2", "d3"}
            long_id = sent.stdout.strip()
            stopped = cli("cancel", long_id)
            assert stopped.returncode == 0, stopped.stderr
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                jobs = {j["id"]: j for j in json.loads(cli("jobs", "--json").stdout)}
                if jobs.get(long_id, {}).get("state") == "cancelled":
                    break
                time.sleep(0.5)
            assert jobs[long_id]["state"] == "cancelled", jobs.get(long_id)
        token = net.token
    assert leftovers(token) == []


def test_nothing_left_after_a_failure_inside() -> None:
    with pytest.raises(RuntimeError, match="induced"), Network(["a", "b"]) as net:
        token = net.token
        assert len(leftovers(token)) == 5  # 2 namespaces, bridge, 2 veths
        raise RuntimeError("induced")
    assert leftovers(token) == []


def test_nothing_left_when_start_fails_halfway(monkeypatch: pytest.MonkeyPatch) -> None:
    net = Network(["a", "b", "c"], [Link("a", "b", mbit=10)])
    real = Network._ip
    calls = []

    def failing(self: Network, *args: str) -> None:
        calls.append(args)
        if args[:2] == ("netns", "add") and args[2].endswith("-c"):
            raise NetnsError("induced: third namespace")
        real(self, *args)

    monkeypatch.setattr(Network, "_ip", failing)
    with pytest.raises(NetnsError, match="induced"), net:
        pass
    assert any(a[:2] == ("netns", "add") for a in calls)
    assert leftovers(net.token) == []


OWNER = """
import sys, time
from hetpipe.netns import Network
with Network(["a", "b"]) as net:
    print(net.token, flush=True)
    time.sleep(120)
"""


def _owner() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.stdout is not None
    token = proc.stdout.readline().strip()
    assert token, "the owner process did not make its network"
    assert leftovers(token)
    return proc, token


def test_sigterm_cleans_up() -> None:
    proc, token = _owner()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert leftovers(token) == []


def test_a_killed_run_is_swept_by_the_next() -> None:
    proc, token = _owner()
    proc.kill()
    proc.wait(timeout=30)
    assert leftovers(token)  # SIGKILL leaves it behind ...
    sweep_stale()  # (another run's sweep may have been first: the owner's pid is gone)
    deadline = time.monotonic() + 10
    while leftovers(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(token) == []  # ... and the next run's sweep removes it


def test_bad_input_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown host 'x'"):
        Network(["a", "b"], [Link("a", "x", mbit=1)])
    with pytest.raises(ValueError, match="host name 'A-1'"):
        Network(["A-1"])
    with pytest.raises(ValueError, match="given twice"):
        Network(["a", "b"], [Link("a", "b", mbit=1), Link("b", "a", mbit=2)])
    with pytest.raises(ValueError, match="NIC of unknown host 'x'"):
        Network(["a"], nic_mbit={"x": 1})
    with pytest.raises(ValueError, match="NIC of a: mbit must be > 0"):
        Network(["a"], nic_mbit={"a": 0})
