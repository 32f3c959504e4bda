"""cluster.toml loading: the repository's file, every rejection, sizes and the helpers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import edited, one_line_error

from hetpipe.config import (
    ClusterConfig,
    ConfigError,
    RuntimeSpec,
    format_size,
    load_cluster,
    parse_size,
)

ROOT = Path(__file__).resolve().parent.parent

BASE = """\
[ps]
shards = ["127.0.0.1:7100", "127.0.0.1:7101"]

[network]
intra_node_gbps = 100.0
inter_node_gbps = 10.0

[[node]]
name = "node0"
host = "127.0.0.1"

[[node.device]]
name = "gpu0"
device = "cpu"
type = "fast"
memory = "64MiB"
port = 7200

[[node.device]]
name = "gpu1"
device = "cpu"
type = "slow"
memory = "32MiB"
speed = 0.5
port = 7201
"""

SECOND_NODE = """
[[node]]
name = "node1"
host = "10.0.0.2"

[[node.device]]
name = "gpu2"
device = "cuda:0"
type = "fast"
memory = "2GiB"
port = 7200
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def edit(old: str, new: str) -> str:
    """BASE with one exact edit (``old == ""`` appends ``new``)."""
    return edited(BASE, old, new)


def rejected(path: Path, key: str, problem: str) -> str:
    """Load must fail with ONE line naming the file, the key and the problem."""
    return one_line_error(load_cluster, ConfigError, path, key, problem)


# (id, old, new, key, problem)
CASES = [
    ("toml-syntax", "port = 7201", "port = ", "line 25, column 8", "invalid TOML"),
    ("unknown-top", "", "[extra]\nx = 1\n", "extra", "allowed: network, node, ps, runtime"),
    ("unknown-ps", "[ps]\n", "[ps]\nhead = 0\n", "ps.head", "unknown key (allowed: shards)"),
    (
        "unknown-network",
        "inter_node_gbps = 10.0",
        "inter_node_gbps = 10.0\nlatency = 1",
        "network.latency",
        "allowed: inter_node_gbps, intra_node_gbps, link",
    ),
    ("unknown-runtime", "", "[runtime]\nretries = 3\n", "runtime.retries", "unknown key"),
    ("unknown-node", 'name = "node0"', 'name = "node0"\nrack = 2', "node[0].rack", "unknown key"),
    (
        "unknown-device",
        "port = 7200",
        'port = 7200\ncolour = "red"',
        "node[0].device[0].colour",
        "unknown key (allowed: device, host_gbps, memory, name, port, speed, type)",
    ),
    (
        "unknown-link",
        "",
        '[[network.link]]\na = "gpu0"\nb = "gpu1"\ngbps = 5\nlatency = 1\n',
        "network.link[0].latency",
        "unknown key (allowed: a, b, gbps)",
    ),
    ("type-port", "port = 7200", 'port = "7200"', "node[0].device[0].port", "expected an integer"),
    (
        "type-speed-bool",
        "speed = 0.5",
        "speed = true",
        "node[0].device[1].speed",
        "expected a number, got boolean",
    ),
    ("type-port-bool", "port = 7200", "port = true", "node[0].device[0].port", "got boolean"),
    (
        "type-memory-bool",
        'memory = "64MiB"',
        "memory = true",
        "node[0].device[0].memory",
        "expected a size",
    ),
    (
        "type-gbps",
        "intra_node_gbps = 100.0",
        'intra_node_gbps = "fast"',
        "network.intra_node_gbps",
        "expected a number, got string",
    ),
    (
        "type-shards",
        'shards = ["127.0.0.1:7100", "127.0.0.1:7101"]',
        'shards = "127.0.0.1:7100"',
        "ps.shards",
        "expected an array",
    ),
    ("missing-type", 'type = "fast"\n', "", "node[0].device[0].type", "missing required key"),
    ("missing-host", 'host = "127.0.0.1"\n', "", "node[0].host", "missing required key"),
    ("missing-memory", 'memory = "64MiB"\n', "", "node[0].device[0].memory", "missing required"),
    ("missing-device", 'device = "cpu"\n', "", "node[0].device[0].device", "missing required"),
    (
        "empty-shards",
        'shards = ["127.0.0.1:7100", "127.0.0.1:7101"]',
        "shards = []",
        "ps.shards",
        "missing: shard 0 is the head",
    ),
    (
        "no-ps",
        '[ps]\nshards = ["127.0.0.1:7100", "127.0.0.1:7101"]\n',
        "",
        "ps.shards",
        "missing: shard 0 is the head",
    ),
    (
        "shard-no-port",
        '"127.0.0.1:7101"]',
        '"127.0.0.1"]',
        "ps.shards[1]",
        "malformed address '127.0.0.1' (use host:port",
    ),
    ("shard-bad-port", '"127.0.0.1:7101"]', '"127.0.0.1:ps"]', "ps.shards[1]", "malformed address"),
    ("shard-not-string", '"127.0.0.1:7101"]', "7101]", "ps.shards[1]", "expected a string"),
    (
        "duplicate-device",
        'name = "gpu1"',
        'name = "gpu0"',
        "node[0].device[1].name",
        "duplicate device name 'gpu0' (first at node[0].device[0])",
    ),
    (
        "duplicate-port",
        "port = 7201",
        "port = 7200",
        "node[0].device[1].port",
        "port 7200 on 127.0.0.1 is already used by device gpu0",
    ),
    (
        "port-of-shard",
        "port = 7201",
        "port = 7101",
        "node[0].device[1].port",
        "already used by ps shard 1",
    ),
    (
        "duplicate-shard-port",
        '"127.0.0.1:7101"]',
        '"127.0.0.1:7100"]',
        "ps.shards[1]",
        "already used by ps shard 0",
    ),
    (
        "bad-size",
        'memory = "32MiB"',
        'memory = "2GB?"',
        "node[0].device[1].memory",
        "cannot parse size '2GB?' (use e.g. 512MiB, 2GiB)",
    ),
    (
        "bad-size-unit",
        'memory = "32MiB"',
        'memory = "32MiBs"',
        "node[0].device[1].memory",
        "cannot parse size",
    ),
    ("speed-zero", "speed = 0.5", "speed = 0", "node[0].device[1].speed", "must be > 0"),
    ("speed-negative", "speed = 0.5", "speed = -1.0", "node[0].device[1].speed", "must be > 0"),
    ("speed-inf", "speed = 0.5", "speed = inf", "node[0].device[1].speed", "finite"),
    (
        "host-gbps-zero",
        "speed = 0.5",
        "speed = 0.5\nhost_gbps = 0",
        "node[0].device[1].host_gbps",
        "must be > 0",
    ),
    (
        "host-gbps-text",
        "speed = 0.5",
        'speed = 0.5\nhost_gbps = "fast"',
        "node[0].device[1].host_gbps",
        "number",
    ),
    ("memory-zero", 'memory = "32MiB"', 'memory = "0B"', "node[0].device[1].memory", "must be > 0"),
    ("memory-negative", 'memory = "32MiB"', "memory = -5", "node[0].device[1].memory", ">= 0"),
    (
        "device-string",
        'device = "cpu"',
        'device = "gpu"',
        "node[0].device[0].device",
        "expected 'cpu' or 'cuda:N', got 'gpu'",
    ),
    (
        "device-cuda",
        'device = "cpu"',
        'device = "cuda:x"',
        "node[0].device[0].device",
        "expected 'cpu' or 'cuda:N'",
    ),
    (
        "node-no-devices",
        "",
        '[[node]]\nname = "node1"\nhost = "10.0.0.2"\n',
        "node[1].device",
        "node has no devices",
    ),
    ("no-nodes", BASE[BASE.index("[[node]]") :], "", "node", "missing: add at least one [[node]]"),
    (
        "duplicate-node",
        "",
        SECOND_NODE.replace('"node1"', '"node0"'),
        "node[1].name",
        "duplicate node name 'node0' (first at node[0])",
    ),
    ("bad-node-name", 'name = "node0"', 'name = "node 0"', "node[0].name", "bad node name"),
    ("port-range", "port = 7201", "port = 70000", "node[0].device[1].port", "out of range"),
    ("port-negative", "port = 7201", "port = -1", "node[0].device[1].port", "out of range"),
    ("shard-port-range", '"127.0.0.1:7101"]', '"127.0.0.1:99999"]', "ps.shards[1]", "out of range"),
    (
        "gbps-zero",
        "intra_node_gbps = 100.0",
        "intra_node_gbps = 0",
        "network.intra_node_gbps",
        "must be > 0",
    ),
    (
        "gbps-negative",
        "inter_node_gbps = 10.0",
        "inter_node_gbps = -1.0",
        "network.inter_node_gbps",
        "must be > 0",
    ),
    (
        "link-gbps",
        "",
        '[[network.link]]\na = "gpu0"\nb = "gpu1"\ngbps = 0\n',
        "network.link[0].gbps",
        "must be > 0",
    ),
    (
        "link-unknown",
        "",
        '[[network.link]]\na = "gpu0"\nb = "gpu9"\ngbps = 5\n',
        "network.link[0].b",
        "unknown device 'gpu9' (known: gpu0, gpu1)",
    ),
    (
        "link-self",
        "",
        '[[network.link]]\na = "gpu0"\nb = "gpu0"\ngbps = 5\n',
        "network.link[0].b",
        "two different devices",
    ),
    (
        "link-missing-gbps",
        "",
        '[[network.link]]\na = "gpu0"\nb = "gpu1"\n',
        "network.link[0].gbps",
        "missing required key",
    ),
    (
        "runtime-lost",
        "",
        "[runtime]\nheartbeat_s = 2.0\nlost_after_s = 1.0\n",
        "runtime.lost_after_s",
        "must exceed heartbeat_s",
    ),
    ("runtime-hwm", "", "[runtime]\nhwm = 0\n", "runtime.hwm", "must be >= 1"),
    ("runtime-inline", "", "[runtime]\ninline_ms = -1\n", "runtime.inline_ms", "must be >= 0"),
    (
        "runtime-retain",
        "",
        "[runtime]\nretain_freed_mib = -1\n",
        "runtime.retain_freed_mib",
        "must be >= 0",
    ),
    # glibc takes the threshold as an int of bytes
    (
        "runtime-retain-big",
        "",
        "[runtime]\nretain_freed_mib = 4096\n",
        "runtime.retain_freed_mib",
        "must be <= 2047",
    ),
    # a compute on the event loop may hold it at most a quarter of a heartbeat
    (
        "runtime-inline-long",
        "",
        "[runtime]\ninline_ms = 300\n",
        "runtime.inline_ms",
        "must be <= 250",
    ),
    (
        "runtime-frame",
        "",
        '[runtime]\nmax_frame_bytes = "lots"\n',
        "runtime.max_frame_bytes",
        "cannot parse size 'lots'",
    ),
    ("runtime-heartbeat", "", "[runtime]\nheartbeat_s = 0\n", "runtime.heartbeat_s", "must be > 0"),
    # values the loader used to pass and a daemon then failed on, far from the file
    (
        "node-host-port",
        'host = "127.0.0.1"',
        'host = "127.0.0.1:7000"',
        "node[0].host",
        "has a port; give the host alone",
    ),
    (
        "node-host-junk",
        'host = "127.0.0.1"',
        'host = "tcp://x"',
        "node[0].host",
        "is not a host name or IP address",
    ),
    (
        "shard-host-junk",
        '"127.0.0.1:7101"',
        '"a/b:7101"',
        "ps.shards[1]",
        "is not a host name or IP address",
    ),
    ("runtime-hwm-huge", "", "[runtime]\nhwm = 99999999999\n", "runtime.hwm", "must be <= 1048576"),
    (
        "runtime-heartbeat-tiny",
        "",
        "[runtime]\nheartbeat_s = 1e-9\n",
        "runtime.heartbeat_s",
        "must be >= 0.05",
    ),
    (
        "runtime-lost-huge",
        "",
        "[runtime]\nlost_after_s = 1e12\n",
        "runtime.lost_after_s",
        "must be <= 86400",
    ),
    (
        "runtime-frame-tiny",
        "",
        "[runtime]\nmax_frame_bytes = 10\n",
        "runtime.max_frame_bytes",
        "must be >= 1.0MiB",
    ),
    (
        "runtime-frame-huge",
        "",
        '[runtime]\nmax_frame_bytes = "99999TiB"\n',
        "runtime.max_frame_bytes",
        "too large",
    ),
    (
        "runtime-int-64",
        "",
        "[runtime]\nhwm = 99999999999999999999\n",
        "runtime.hwm",
        "out of range (must fit in 64 bits)",
    ),
    (
        "runtime-log-tiny",
        "",
        "[runtime]\nlog_max_bytes = 100\n",
        "runtime.log_max_bytes",
        "must be >= 64.0KiB",
    ),
    ("runtime-log-keep", "", "[runtime]\nlog_keep = -1\n", "runtime.log_keep", "must be >= 0"),
    ("runtime-jobs-kept", "", "[runtime]\njobs_kept = 0\n", "runtime.jobs_kept", "must be >= 1"),
    (
        "device-speed-tiny",
        "speed = 0.5",
        "speed = 1e-9",
        "node[0].device[1].speed",
        "must be >= 0.001",
    ),
    (
        "device-memory-huge",
        'memory = "32MiB"',
        "memory = 99999999999999999999",
        "node[0].device[1].memory",
        "is too large (at most 1024.0TiB)",
    ),
]


@pytest.mark.parametrize(
    ("old", "new", "key", "problem"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_rejects(tmp_path: Path, old: str, new: str, key: str, problem: str) -> None:
    rejected(write(tmp_path, edit(old, new)), key, problem)


def test_rejects_node_not_tables(tmp_path: Path) -> None:
    text = "node = 3\n" + BASE[: BASE.index("[[node]]")]
    rejected(write(tmp_path, text), "node", "expected an array of tables ([[node]]), got integer")


def test_rejects_device_not_table(tmp_path: Path) -> None:
    text = BASE[: BASE.index("[[node.device]]")].replace('name = "node0"', 'device = ["gpu0"]')
    text = text.replace('host = "127.0.0.1"', 'host = "127.0.0.1"\nname = "node0"')
    rejected(write(tmp_path, text), "node[0].device[0]", "expected a table, got string")


def test_base_loads(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, BASE))
    assert [d.name for d in cluster.devices] == ["gpu0", "gpu1"]
    assert cluster.device("gpu0").speed == 1.0  # default
    assert cluster.runtime == RuntimeSpec()  # [runtime] is optional


def test_missing_file(tmp_path: Path) -> None:
    rejected(tmp_path / "nope.toml", "file", "cannot read (No such file or directory)")


def test_unreadable_file(tmp_path: Path) -> None:
    rejected(tmp_path, "file", "cannot read")  # a directory


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_bytes(b'name = "\xff"\n')
    rejected(path, "file", "not UTF-8")


def test_port_zero_never_duplicates(tmp_path: Path) -> None:
    text = edit("port = 7200", "port = 0").replace("port = 7201", "port = 0")
    text = text.replace('"127.0.0.1:7101"', '"127.0.0.1:0"')
    cluster = load_cluster(write(tmp_path, text))
    assert [d.port for d in cluster.devices] == [0, 0]
    assert cluster.ps[1].port == 0


def test_same_port_on_other_host_is_fine(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, edit("", SECOND_NODE)))  # gpu2 also uses 7200
    assert cluster.device("gpu2").port == cluster.device("gpu0").port == 7200
    assert cluster.device("gpu2").host == "10.0.0.2"


def test_repository_cluster_toml() -> None:
    cluster = load_cluster(ROOT / "cluster.toml")
    assert len(cluster.devices) == 4
    assert cluster.types == ("fast", "medium", "whimpy")
    assert len(cluster.ps) == 2
    assert cluster.head.address == "tcp://127.0.0.1:7100"
    assert [s.index for s in cluster.ps] == [0, 1]
    assert all(d.device == "cpu" and d.host == "127.0.0.1" for d in cluster.devices)
    assert [d.speed for d in cluster.devices] == [1.0, 0.5, 0.5, 0.25]
    assert cluster.device("gpu0").memory == 64 << 20


def test_helpers(tmp_path: Path) -> None:
    link = '[[network.link]]\na = "gpu2"\nb = "gpu0"\ngbps = 25\n'
    cluster: ClusterConfig = load_cluster(write(tmp_path, edit("", SECOND_NODE + link)))
    gpu0, gpu1, gpu2 = (cluster.device(n) for n in ("gpu0", "gpu1", "gpu2"))
    assert gpu0.node == "node0" and gpu2.node == "node1"
    assert gpu2.device == "cuda:0" and gpu2.memory == 2 << 30
    net = cluster.network
    assert net.gbps(gpu0, gpu1) == 100.0  # same node
    assert net.gbps(gpu1, gpu2) == 10.0  # across nodes
    assert net.gbps(gpu0, gpu2) == net.gbps(gpu2, gpu0) == 25.0  # override, either direction
    assert net.gbps(gpu0, gpu0) == math.inf
    assert net.bytes_per_s(gpu0, gpu1) == 100e9 / 8
    assert cluster.types == ("fast", "slow")
    assert [n.name for n in cluster.nodes] == ["node0", "node1"]
    with pytest.raises(ConfigError) as info:
        cluster.device("gpu9")
    assert (
        str(info.value)
        == f"{cluster.path}: device: unknown device 'gpu9' (known: gpu0, gpu1, gpu2)"
    )


def test_runtime_section(tmp_path: Path) -> None:
    runtime = '[runtime]\nheartbeat_s = 0.5\nlost_after_s = 2\nmax_frame_bytes = "64MiB"\n'
    runtime += 'hwm = 8\nrun_dir = "/tmp/hp"\n'
    cluster = load_cluster(write(tmp_path, edit("", runtime)))
    assert cluster.runtime == RuntimeSpec(0.5, 2.0, 64 << 20, 8, "/tmp/hp")


def test_inline_default_fits_a_short_heartbeat(tmp_path: Path) -> None:
    """The default ``inline_ms`` shrinks to a quarter of a short heartbeat, not refused."""
    cluster = load_cluster(write(tmp_path, edit("", "[runtime]\nheartbeat_s = 0.05\n")))
    assert cluster.runtime.inline_ms == 12
    assert load_cluster(write(tmp_path, edit("", ""))).runtime.inline_ms == 20


def test_ipv6_shard(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, edit('"127.0.0.1:7101"', '"[::1]:7101"')))
    assert cluster.ps[1].host == "::1"
    assert cluster.ps[1].address == "tcp://[::1]:7101"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1024, 1024),
        (0, 0),
        ("1024", 1024),
        ("12B", 12),
        ("64KiB", 64 * 1024),
        ("512MiB", 512 << 20),
        ("2GiB", 2 << 30),
        ("1TiB", 1 << 40),
        ("1.5GiB", 3 << 29),
        ("1.5GB", 1_500_000_000),
        ("2KB", 2000),
        ("3MB", 3_000_000),
        ("1TB", 10**12),
        ("2 gib", 2 << 30),
        ("2 MIB", 2 << 20),
        (" 7 kb ", 7000),
        ("0.1KB", 100),
        (".5KiB", 512),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["2GB?", "", "GiB", "1.2.3MiB", "2 G", "-1MiB", "1e3", -1, True])
def test_parse_size_rejects(text: str | int) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (2147483648, "2.0GiB"),
        (512, "512B"),
        (1536, "1.5KiB"),
        (3 << 20, "3.0MiB"),
        (1 << 40, "1.0TiB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text
    assert abs(parse_size(text) - n) <= n * 0.05
