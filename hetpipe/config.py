"""The cluster file (cluster.toml): parameter-server shards, network, nodes and their devices.

Loaded once with ``tomllib`` into frozen dataclasses and validated on load, so that every later
consumer (planner, daemons, CLI) can trust it. Every rejection is ONE line
``"<file>: <key path>: <problem>"`` so a user can fix the file without reading a traceback.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from hetpipe._toml import MISSING, Table, read_toml
from hetpipe.core.units import format_size
from hetpipe.hostmem import MAX_RETAIN_MIB
from hetpipe.security import SecuritySpec

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "DeviceSpec",
    "LinkSpec",
    "NetworkSpec",
    "NodeSpec",
    "RuntimeSpec",
    "ShardSpec",
    "check_address",
    "format_size",
    "load_cluster",
    "parse_size",
]

GiB = 1 << 30
_UNITS = {"": 1, "b": 1}
_UNITS.update({u + "b": 1000 ** (i + 1) for i, u in enumerate("kmgt")})
_UNITS.update({u + "ib": 1024 ** (i + 1) for i, u in enumerate("kmgt")})
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_DEVICE = re.compile(r"cpu|cuda:\d+")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_ADDRESS = re.compile(r"(\[[^\]]+\]|[^:\[\]\s]+):(\d+)")
_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")
_HOST_PORT = re.compile(r"[^:\s]+:\d*")
_TCP = re.compile(r"tcp://(\[[^\]]+\]|[^:/\[\]\s]+):(\d+)")

MAX_SIZE = 1 << 50  # 1 PiB: beyond any device or frame, and far inside a 64-bit integer
MAX_HWM = 1 << 20  # ZeroMQ queues this many messages per peer at most (shards use 16x)
MIN_HEARTBEAT_S = 0.05  # below this, heartbeats alone would keep every daemon busy
MAX_DURATION_S = 86400.0
MIN_LOG_BYTES = 64 << 10
MIN_FRAME_BYTES = 1 << 20


class ConfigError(ValueError):
    """A bad cluster file; ``str(e)`` is one line ``"<file>: <key>: <problem>"``."""


def parse_size(text: str | int) -> int:
    """Bytes from ``1024``, ``"1024"``, ``"64KiB"``, ``"1.5GB"`` (KB..TB: 1000s; KiB..TiB: 1024s).

    Raises ValueError naming the problem only; callers add the file and key.
    """
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ValueError(f"expected a size (integer or string), got {type(text).__name__}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    m = _SIZE.fullmatch(text)
    if m is None or m[2].lower() not in _UNITS:
        raise ValueError(f"cannot parse size {text!r} (use e.g. 512MiB, 2GiB)")
    return int((Decimal(m[1]) * _UNITS[m[2].lower()]).to_integral_value())


def check_host(text: str) -> str | None:
    """The problem with a host name or IP address, or None: a host carries no port."""
    try:
        ipaddress.ip_address(text.strip("[]"))
        return None
    except ValueError:
        pass
    if _HOST_PORT.fullmatch(text):
        return f"{text!r} has a port; give the host alone (ports are set per shard and per device)"
    if len(text) > 253 or not _HOSTNAME.fullmatch(text):
        return f"{text!r} is not a host name or IP address"
    return None


def check_address(text: str) -> str:
    """A daemon address ``tcp://host:port`` (port 1-65535); ValueError says what is wrong.

    Checked before any socket is made: ZeroMQ's own answer to a bad endpoint is a bare
    "Invalid argument" from deep inside a connect.
    """
    m = _TCP.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not an address tcp://host:port")
    problem = check_host(m[1])
    if problem is not None:
        raise ValueError(problem)
    if not 1 <= int(m[2]) <= 65535:
        raise ValueError(f"{text!r}: port {int(m[2])} out of range (1-65535)")
    return text.strip()


@dataclass(frozen=True)
class DeviceSpec:
    """One GPU, or one CPU-emulated device (``speed`` pads compute; ``memory`` is a hard cap)."""

    name: str
    device: str
    type: str
    memory: int
    speed: float
    port: int
    node: str
    host: str
    # host <-> device copy bandwidth (swapped activations, hetpipe.planner.memory); on an
    # emulated device the copy time is charged at this rate. Default: PCIe 3.0 x16 as
    # pinned copies reach it in practice (~12 GB/s)
    host_gbps: float = 96.0


@dataclass(frozen=True)
class NodeSpec:
    name: str
    host: str
    devices: tuple[DeviceSpec, ...]


@dataclass(frozen=True)
class LinkSpec:
    """Bandwidth override between two devices (either direction)."""

    a: str
    b: str
    gbps: float


@dataclass(frozen=True)
class NetworkSpec:
    """Bandwidths the planner prices boundary transfers with."""

    intra_node_gbps: float
    inter_node_gbps: float
    links: tuple[LinkSpec, ...] = ()

    def gbps(self, a: DeviceSpec, b: DeviceSpec) -> float:
        """Link override if any, else intra/inter by node; a device to itself is free (inf)."""
        if a.name == b.name:
            return math.inf
        for link in self.links:
            if {link.a, link.b} == {a.name, b.name}:
                return link.gbps
        return self.intra_node_gbps if a.node == b.node else self.inter_node_gbps

    def bytes_per_s(self, a: DeviceSpec, b: DeviceSpec) -> float:
        return self.gbps(a, b) * 1e9 / 8


@dataclass(frozen=True)
class ShardSpec:
    index: int
    host: str
    port: int

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


@dataclass(frozen=True)
class RuntimeSpec:
    """Daemon timings and limits; defaults suit one host."""

    heartbeat_s: float = 1.0
    lost_after_s: float = 5.0
    max_frame_bytes: int = GiB
    hwm: int = 64
    run_dir: str = ".hetpipe"
    log_max_bytes: int = 16 << 20  # a daemon's log rotates past this size
    log_keep: int = 3  # rotated logs kept (name.log.1 .. name.log.N)
    jobs_kept: int = 20  # finished jobs the head keeps in memory; older ones live on disk
    cuda_ipc: bool = True  # stages on GPUs of one host pass tensors device to device
    host_shm: bool = True  # stages of one host pass host tensors through shared memory
    # a stage's compute runs shorter than this run on its event loop (hetpipe.computethread)
    inline_ms: int = 20
    # freed memory a daemon's C allocator keeps per heap for the next minibatch's tensors
    # (hetpipe.hostmem; 0: the allocator's own behaviour)
    retain_freed_mib: int = 256


@dataclass(frozen=True)
class ClusterConfig:
    path: str
    ps: tuple[ShardSpec, ...]
    network: NetworkSpec
    nodes: tuple[NodeSpec, ...]
    runtime: RuntimeSpec
    security: SecuritySpec = field(default_factory=SecuritySpec)

    @property
    def devices(self) -> tuple[DeviceSpec, ...]:
        """All devices, in file order."""
        return tuple(d for node in self.nodes for d in node.devices)

    def device(self, name: str) -> DeviceSpec:
        for d in self.devices:
            if d.name == name:
                return d
        known = ", ".join(d.name for d in self.devices)
        raise ConfigError(f"{self.path}: device: unknown device {name!r} (known: {known})")

    @property
    def head(self) -> ShardSpec:
        """Shard 0, which also accepts jobs, plans and watches workers."""
        return self.ps[0]

    @property
    def types(self) -> tuple[str, ...]:
        """Distinct device types, in file order."""
        return tuple(dict.fromkeys(d.type for d in self.devices))


def load_cluster(path: str | os.PathLike[str]) -> ClusterConfig:
    """Read and validate a cluster file; raises ConfigError (one line) on any problem."""
    data, source = read_toml(path, ConfigError)
    root = Table(
        data, source, ConfigError, allowed=("ps", "network", "runtime", "node", "security")
    )
    ports: dict[tuple[str, int], str] = {}  # (host, port) -> who uses it; port 0 is never kept
    shards = _shards(root.table("ps", ("shards",)), ports)
    nodes = _nodes(root, ports)
    names = {d.name for node in nodes for d in node.devices}
    return ClusterConfig(
        source, shards, _network(root, names), nodes, _runtime(root), _security(root, source)
    )


def _claim(t: Table, key: str, host: str, port: int, who: str, ports: dict) -> None:
    if not 0 <= port <= 65535:
        t.fail(key, f"port {port} out of range (0-65535; 0 = ephemeral)")
    if port and (host, port) in ports:
        t.fail(key, f"port {port} on {host} is already used by {ports[host, port]}")
    if port:
        ports[host, port] = who


def _shards(ps: Table, ports: dict) -> tuple[ShardSpec, ...]:
    addresses = ps.array("shards", "string", default=[])
    if not addresses:
        ps.fail("shards", "missing: shard 0 is the head")
    shards = []
    for i, text in enumerate(addresses):
        m = _ADDRESS.fullmatch(text.strip())
        if m is None:
            ps.fail(
                f"shards[{i}]", f"malformed address {text!r} (use host:port, e.g. 127.0.0.1:7100)"
            )
        host, port = m[1].strip("[]"), int(m[2])
        problem = check_host(host)
        if problem is not None:
            ps.fail(f"shards[{i}]", problem)
        _claim(ps, f"shards[{i}]", host, port, f"ps shard {i}", ports)
        shards.append(ShardSpec(i, host, port))
    return tuple(shards)


def _name(t: Table, key: str, what: str, seen: dict[str, str]) -> str:
    name = t.text(key)
    if not _NAME.fullmatch(name):
        t.fail(key, f"bad {what} name {name!r} (letters, digits, '_', '.', '-')")
    if name in seen:
        t.fail(key, f"duplicate {what} name {name!r} (first at {seen[name]})")
    seen[name] = t.key
    return name


def _nodes(root: Table, ports: dict) -> tuple[NodeSpec, ...]:
    node_keys, device_keys = ("name", "host", "device"), ("name", "device", "type", "memory")
    device_keys += ("speed", "port", "host_gbps")
    node_names: dict[str, str] = {}
    device_names: dict[str, str] = {}
    nodes = []
    for nt in root.tables("node", node_keys):
        node, host = _name(nt, "name", "node", node_names), nt.text("host")
        problem = check_host(host)
        if problem is not None:
            nt.fail("host", problem)
        devices = []
        for dt in nt.tables("device", device_keys):
            name = _name(dt, "name", "device", device_names)
            device = dt.text("device")
            if not _DEVICE.fullmatch(device):
                dt.fail("device", f"expected 'cpu' or 'cuda:N', got {device!r}")
            kind = dt.text("type")
            if not _NAME.fullmatch(kind):
                dt.fail("type", f"bad device type {kind!r} (letters, digits, '_', '.', '-')")
            memory = _size(dt, "memory")
            if memory <= 0:
                dt.fail("memory", f"must be > 0, got {dt.raw('memory')!r}")
            speed = dt.positive("speed", 1.0, low=0.001)
            host_gbps = dt.positive("host_gbps", DeviceSpec.host_gbps)
            port = dt.integer("port", 0)
            _claim(dt, "port", host, port, f"device {name}", ports)
            devices.append(
                DeviceSpec(name, device, kind, memory, speed, port, node, host, host_gbps)
            )
        if not devices:
            nt.fail("device", "node has no devices (add [[node.device]] tables)")
        nodes.append(NodeSpec(node, host, tuple(devices)))
    if not nodes:
        root.fail("node", "missing: add at least one [[node]] with [[node.device]] tables")
    return tuple(nodes)


def _size(t: Table, key: str, default: object = MISSING) -> int:
    value = t.raw(key, default)
    try:
        size = parse_size(value)
    except ValueError as e:
        t.fail(key, str(e))
    if size > MAX_SIZE:
        t.fail(key, f"{value!r} is too large (at most {format_size(MAX_SIZE)})")
    return size


def _network(root: Table, devices: set[str]) -> NetworkSpec:
    net = root.table("network", ("intra_node_gbps", "inter_node_gbps", "link"))
    intra, inter = net.positive("intra_node_gbps", 100.0), net.positive("inter_node_gbps", 10.0)
    links: list[LinkSpec] = []
    for lt in net.tables("link", ("a", "b", "gbps")):
        a, b = lt.text("a"), lt.text("b")
        for key, name in (("a", a), ("b", b)):
            if name not in devices:
                lt.fail(key, f"unknown device {name!r} (known: {', '.join(sorted(devices))})")
        if a == b:
            lt.fail("b", f"a link needs two different devices, got {a!r} twice")
        if any({x.a, x.b} == {a, b} for x in links):
            lt.fail("b", f"duplicate link between {a!r} and {b!r}")
        links.append(LinkSpec(a, b, lt.positive("gbps")))
    return NetworkSpec(intra, inter, tuple(links))


def _runtime(root: Table) -> RuntimeSpec:
    d = RuntimeSpec()
    keys = (
        "heartbeat_s",
        "lost_after_s",
        "max_frame_bytes",
        "hwm",
        "run_dir",
        "log_max_bytes",
        "log_keep",
        "jobs_kept",
        "cuda_ipc",
        "host_shm",
        "inline_ms",
        "retain_freed_mib",
    )
    rt = root.table("runtime", keys)
    heartbeat = rt.positive("heartbeat_s", d.heartbeat_s, low=MIN_HEARTBEAT_S, high=MAX_DURATION_S)
    lost = rt.positive("lost_after_s", d.lost_after_s, high=MAX_DURATION_S)
    if lost <= heartbeat:
        rt.fail("lost_after_s", f"must exceed heartbeat_s ({heartbeat}), got {lost}")
    frame = _size(rt, "max_frame_bytes", d.max_frame_bytes)
    if frame < MIN_FRAME_BYTES:  # also the limit on headers, which carry job specs and stats
        rt.fail("max_frame_bytes", f"must be >= {format_size(MIN_FRAME_BYTES)}, got {frame}")
    hwm = rt.at_least("hwm", 1, d.hwm, high=MAX_HWM)  # bounded queues give back-pressure
    beat_ms = int(heartbeat * 1e3) // 4  # the longest a compute may hold the event loop
    log_max = _size(rt, "log_max_bytes", d.log_max_bytes)
    if log_max < MIN_LOG_BYTES:
        rt.fail("log_max_bytes", f"must be >= {format_size(MIN_LOG_BYTES)}, got {log_max}")
    return RuntimeSpec(
        heartbeat,
        lost,
        frame,
        hwm,
        rt.text("run_dir", d.run_dir),
        log_max,
        rt.at_least("log_keep", 0, d.log_keep, high=100),
        rt.at_least("jobs_kept", 1, d.jobs_kept, high=100_000),
        rt.flag("cuda_ipc", d.cuda_ipc),
        rt.flag("host_shm", d.host_shm),
        # the event loop serves nothing else meanwhile: heartbeats must still go out
        rt.at_least("inline_ms", 0, min(d.inline_ms, beat_ms), high=beat_ms),
        rt.at_least("retain_freed_mib", 0, d.retain_freed_mib, high=MAX_RETAIN_MIB),
    )


# -- [security] (trust: keys, Curve on/off, code loading; see hetpipe.security) ---------------


def _security(root: Table, source: str) -> SecuritySpec:
    d = SecuritySpec()
    st = root.table("security", ("curve", "keys", "allowed_modules"))
    curve = st.raw("curve", d.curve)
    if not isinstance(curve, bool):
        st.fail("curve", f"expected true or false, got {curve!r}")
    keys = Path(st.text("keys", d.keys)).expanduser()
    if not keys.is_absolute():
        keys = Path(source).resolve().parent / keys
    modules = tuple(st.array("allowed_modules", "string", default=[]))
    for i, m in enumerate(modules):
        if not _MODULE.fullmatch(m):
            st.fail(f"allowed_modules[{i}]", f"not a module name: {m!r} (e.g. mypkg.models)")
    return SecuritySpec(curve, str(keys), modules)
