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
from typing import Any

from hetpipe._toml import DECLARED, MISSING, Table, read_toml
from hetpipe.core import keys
from hetpipe.core.keys import CLUSTER
from hetpipe.core.units import format_size
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
# each key's default, bounds and choices are declared in hetpipe.core.keys.CLUSTER
_d = CLUSTER.default


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
    # host <-> device copy bandwidth (swapped activations, hetpipe.core.memory); on an
    # emulated device the copy time is charged at this rate. Default: PCIe 3.0 x16 as
    # pinned copies reach it in practice (~12 GB/s)
    host_gbps: float = CLUSTER.default("node.device.host_gbps")


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

    # each field is the key of its name, declared (default, meaning) in hetpipe.core.keys
    heartbeat_s: float = _d("runtime.heartbeat_s")
    lost_after_s: float = _d("runtime.lost_after_s")
    max_frame_bytes: int = parse_size(_d("runtime.max_frame_bytes"))
    hwm: int = _d("runtime.hwm")
    run_dir: str = _d("runtime.run_dir")
    log_max_bytes: int = parse_size(_d("runtime.log_max_bytes"))
    log_keep: int = _d("runtime.log_keep")
    jobs_kept: int = _d("runtime.jobs_kept")
    cuda_ipc: bool = _d("runtime.cuda_ipc")
    host_shm: bool = _d("runtime.host_shm")
    inline_ms: int = _d("runtime.inline_ms")  # hetpipe.computethread
    retain_freed_mib: int = _d("runtime.retain_freed_mib")  # hetpipe.hostmem
    records_every: int = _d("runtime.records_every")  # hetpipe.pipeline.RecordsOut
    records_max_bytes: int = parse_size(_d("runtime.records_max_bytes"))  # hetpipe.rotation
    metrics_max_bytes: int = parse_size(_d("runtime.metrics_max_bytes"))  # hetpipe.rotation
    job_dir_max_bytes: int = parse_size(_d("runtime.job_dir_max_bytes"))  # hetpipe.jobdir


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
    root = Table(data, source, ConfigError, allowed=CLUSTER.allowed(""))
    ports: dict[tuple[str, int], str] = {}  # (host, port) -> who uses it; port 0 is never kept
    shards = _shards(root.table("ps", CLUSTER.allowed("ps")), ports)
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
    addresses = _read(ps, "shards", [])
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


def _key(t: Table, name: str) -> keys.Key:
    """The declaration of key ``name`` of table ``t`` (``node[0].device[1]``: node.device)."""
    section = re.sub(r"\[\d+\]", "", t.key)
    return CLUSTER[f"{section}.{name}" if section else name]


def _read(t: Table, name: str, default: object = DECLARED) -> Any:
    """Key ``name`` of table ``t`` as :data:`hetpipe.core.keys.CLUSTER` declares it."""
    return t.read(_key(t, name), default)


def _name(t: Table, key: str, what: str, seen: dict[str, str]) -> str:
    name = _read(t, key)
    if not _NAME.fullmatch(name):
        t.fail(key, f"bad {what} name {name!r} (letters, digits, '_', '.', '-')")
    if name in seen:
        t.fail(key, f"duplicate {what} name {name!r} (first at {seen[name]})")
    seen[name] = t.key
    return name


def _nodes(root: Table, ports: dict) -> tuple[NodeSpec, ...]:
    node_names: dict[str, str] = {}
    device_names: dict[str, str] = {}
    nodes = []
    for nt in root.tables("node", CLUSTER.allowed("node")):
        node, host = _name(nt, "name", "node", node_names), _read(nt, "host")
        problem = check_host(host)
        if problem is not None:
            nt.fail("host", problem)
        devices = []
        for dt in nt.tables("device", CLUSTER.allowed("node.device")):
            name = _name(dt, "name", "device", device_names)
            device = _read(dt, "device")
            if not _DEVICE.fullmatch(device):
                dt.fail("device", f"expected 'cpu' or 'cuda:N', got {device!r}")
            kind = _read(dt, "type")
            if not _NAME.fullmatch(kind):
                dt.fail("type", f"bad device type {kind!r} (letters, digits, '_', '.', '-')")
            memory = _size(dt, "memory")
            speed = _read(dt, "speed")
            host_gbps = _read(dt, "host_gbps")
            port = dt.integer("port", CLUSTER.default("node.device.port"))  # _claim: range
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


def _size(t: Table, name: str) -> int:
    """A size key (bytes, or a text such as "2GiB") within its declared bounds."""
    key = _key(t, name)
    value = t.raw(name, MISSING if key.required else key.default)
    try:
        size = parse_size(value)
    except ValueError as e:
        t.fail(name, str(e))
    if size > MAX_SIZE:
        t.fail(name, f"{value!r} is too large (at most {format_size(MAX_SIZE)})")
    if key.above is not None and size <= key.above:
        t.fail(name, f"must be > {key.above}, got {value!r}")
    least = parse_size(key.low) if key.low is not None else None
    if least is not None and size < least:
        t.fail(name, f"must be >= {format_size(least)}, got {size}")
    return size


def _network(root: Table, devices: set[str]) -> NetworkSpec:
    net = root.table("network", CLUSTER.allowed("network"))
    intra, inter = _read(net, "intra_node_gbps"), _read(net, "inter_node_gbps")
    links: list[LinkSpec] = []
    for lt in net.tables("link", CLUSTER.allowed("network.link")):
        a, b = _read(lt, "a"), _read(lt, "b")
        for key, name in (("a", a), ("b", b)):
            if name not in devices:
                lt.fail(key, f"unknown device {name!r} (known: {', '.join(sorted(devices))})")
        if a == b:
            lt.fail("b", f"a link needs two different devices, got {a!r} twice")
        if any({x.a, x.b} == {a, b} for x in links):
            lt.fail("b", f"duplicate link between {a!r} and {b!r}")
        links.append(LinkSpec(a, b, _read(lt, "gbps")))
    return NetworkSpec(intra, inter, tuple(links))


def _runtime(root: Table) -> RuntimeSpec:
    d = RuntimeSpec()
    rt = root.table("runtime", CLUSTER.allowed("runtime"))
    heartbeat = _read(rt, "heartbeat_s")
    lost = _read(rt, "lost_after_s")
    if lost <= heartbeat:
        rt.fail("lost_after_s", f"must exceed heartbeat_s ({heartbeat}), got {lost}")
    frame = _size(rt, "max_frame_bytes")
    hwm = _read(rt, "hwm")  # bounded queues give back-pressure
    beat_ms = int(heartbeat * 1e3) // 4  # the longest a compute may hold the event loop
    log_max = _size(rt, "log_max_bytes")
    inline_ms = _read(rt, "inline_ms", min(d.inline_ms, beat_ms))
    # the event loop serves nothing else meanwhile: heartbeats must still go out
    if inline_ms > beat_ms:
        rt.fail("inline_ms", f"must be <= {beat_ms}, got {inline_ms}")
    return RuntimeSpec(
        heartbeat,
        lost,
        frame,
        hwm,
        _read(rt, "run_dir"),
        log_max,
        _read(rt, "log_keep"),
        _read(rt, "jobs_kept"),
        _read(rt, "cuda_ipc"),
        _read(rt, "host_shm"),
        inline_ms,
        _read(rt, "retain_freed_mib"),
        _read(rt, "records_every"),
        _size(rt, "records_max_bytes"),
        _size(rt, "metrics_max_bytes"),
        _size(rt, "job_dir_max_bytes"),
    )


# -- [security] (trust: keys, Curve on/off, code loading; see hetpipe.security) ---------------


def _security(root: Table, source: str) -> SecuritySpec:
    st = root.table("security", CLUSTER.allowed("security"))
    curve = st.raw("curve", CLUSTER.default("security.curve"))
    if not isinstance(curve, bool):
        st.fail("curve", f"expected true or false, got {curve!r}")
    folder = Path(_read(st, "keys")).expanduser()
    if not folder.is_absolute():
        folder = Path(source).resolve().parent / folder
    modules = tuple(_read(st, "allowed_modules"))
    for i, m in enumerate(modules):
        if not _MODULE.fullmatch(m):
            st.fail(f"allowed_modules[{i}]", f"not a module name: {m!r} (e.g. mypkg.models)")
    ship = st.raw("ship_code", CLUSTER.default("security.ship_code"))
    if not isinstance(ship, bool):
        st.fail("ship_code", f"expected true or false, got {ship!r}")
    if ship and not curve:
        # shipped code runs on every host: only an authenticated client may send it
        st.fail(
            "ship_code",
            "needs curve = true: without keys anyone who reaches the head "
            "could run code on every host",
        )
    return SecuritySpec(curve, str(folder), modules, ship, _read(st, "data_path"))
