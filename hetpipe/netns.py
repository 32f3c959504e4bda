"""Several hosts on one machine: Linux network namespaces joined by a bridge, links shaped.

A cluster of several ``[[node]]`` hosts needs links that really differ before a link-aware
plan can be checked against a measured run. :class:`Network` makes one network namespace
per host, each with its own address on a private /24, joined to a bridge in the creating
namespace by a veth pair; inside a host its devices talk over that host's loopback. A
:class:`Link` shapes the traffic between two hosts with ``tc`` on both hosts' egress: an
HTB class capped at the link's rate (and a ``netem`` delay under it where asked) selected
by the peer's address, so the rest of the host's traffic keeps full speed. A host's NIC
(``nic_mbit``) caps everything it sends to the other hosts together, as one network card
does: a link's class takes the traffic to its peer, the NIC's class the rest.
:class:`NetnsCluster` writes a cluster file whose nodes are those hosts and whose
``[[network.link]]`` overrides say exactly what was shaped, and starts the daemons inside
the namespaces (``ip netns exec``); the creating namespace reaches every host through the
bridge's address, so a client there talks to the head as on a real network.

Everything made is undone on exit, also when start-up fails halfway, on SIGTERM and at
interpreter exit (``weakref.finalize``). Names carry the creating process's id, so runs
side by side never collide, and a later run removes what a killed one (pid gone) left.
Where namespaces cannot be made (not root, no ``ip``), :func:`unavailable` says why.

    with Network(["a", "b"], [Link("a", "b", mbit=20)]) as net:
        net.run("a", ["python", "-c", "..."])
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetpipe import launch
from hetpipe.localcluster import DeviceDef, LocalCluster

__all__ = [
    "Link",
    "NetnsCluster",
    "NetnsError",
    "Network",
    "enter",
    "measure_mbit",
    "netns_cluster_toml",
    "sweep_stale",
    "unavailable",
]

PREFIX = "hetpipe"  # namespace names: hetpipe-<pid>-<token>-<host>; link aliases: hetpipe-<pid>
_NS_RE = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-")
_ALIAS_RE = re.compile(rf"^{PREFIX}-(\d+)$")
_HOST_RE = re.compile(r"^[a-z][a-z0-9]{0,15}$")
_UNSHAPED = "100gbit"  # the class every unshaped packet takes (far above what a veth does)


class NetnsError(RuntimeError):
    """A namespace, link or shaping step failed; the text names the command and its error."""


@dataclass(frozen=True)
class Link:
    """Traffic between hosts ``a`` and ``b`` (both directions) capped at ``mbit`` megabits
    per second, each way delayed by ``delay_ms`` (needs the kernel's netem qdisc)."""

    a: str
    b: str
    mbit: float
    delay_ms: float = 0.0

    @property
    def gbps(self) -> float:
        return self.mbit / 1000.0


def _ip() -> str | None:
    return shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip") if os.access(p, os.X_OK)), None
    )


def _tc() -> str | None:
    return shutil.which("tc") or next(
        (p for p in ("/usr/sbin/tc", "/sbin/tc") if os.access(p, os.X_OK)), None
    )


def unavailable(*, shaping: bool = True) -> str | None:
    """Why namespaces (and, with ``shaping``, tc) cannot be used here; None when they can.

    Tries one namespace for real: being root is not enough inside some containers.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root or with CAP_NET_ADMIN+CAP_SYS_ADMIN)"
    ip = _ip()
    if ip is None:
        return "the `ip` command (iproute2) is not installed"
    if shaping and _tc() is None:
        return "the `tc` command (iproute2) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-probe"
    made = subprocess.run([ip, "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    subprocess.run([ip, "netns", "del", probe], capture_output=True)
    return None


def sweep_stale() -> list[str]:
    """Remove namespaces, bridges and veths a killed run left (their creator's pid is gone);
    return their names. Those of live runs are never touched."""
    ip = _ip()
    if ip is None:
        return []
    removed = []
    listed = subprocess.run([ip, "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_RE.match(name)
        if m and not launch.pid_alive(int(m[1])):
            subprocess.run([ip, "netns", "del", name], capture_output=True)
            removed.append(name)
    out = subprocess.run([ip, "-j", "link", "show"], capture_output=True, text=True).stdout
    with contextlib.suppress(ValueError):
        for link in json.loads(out or "[]"):
            m = _ALIAS_RE.match(link.get("ifalias", ""))
            if m and not launch.pid_alive(int(m[1])):
                subprocess.run([ip, "link", "del", link["ifname"]], capture_output=True)
                removed.append(link["ifname"])
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 that no address or route of this namespace uses."""
    ip = _ip()
    assert ip is not None
    used: list[ipaddress.IPv4Network] = []
    for what in (["-4", "-j", "addr", "show"], ["-4", "-j", "route", "show"]):
        out = subprocess.run([ip, *what], capture_output=True, text=True).stdout
        with contextlib.suppress(ValueError):
            for entry in json.loads(out or "[]"):
                for a in entry.get("addr_info", []):
                    used.append(
                        ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False)
                    )
                dst = entry.get("dst")
                if dst and dst != "default":
                    used.append(
                        ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False)
                    )
    for _ in range(100):
        net = ipaddress.ip_network(
            f"10.{secrets.randbelow(200) + 50}.{secrets.randbelow(254) + 1}.0/24"
        )
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsError("no free 10.x.y.0/24 subnet for the hosts")


class Network:
    """Hosts as network namespaces on one bridge, with shaped links; a context manager.

    ``hosts`` are short names (lowercase letters and digits, at most 16); each gets the
    namespace :meth:`namespace` and the address :meth:`address`. ``links`` shape traffic
    between two hosts; ``nic_mbit`` caps what a host sends to all other hosts together
    (traffic of one of its links takes the link's class instead); everything else runs at
    the bridge's full speed.
    """

    def __init__(
        self,
        hosts: Sequence[str],
        links: Iterable[Link] = (),
        nic_mbit: Mapping[str, float] | None = None,
    ) -> None:
        self.hosts = tuple(hosts)
        self.links = tuple(links)
        self.nic_mbit = dict(nic_mbit or {})
        if not self.hosts:
            raise ValueError("a network needs at least one host")
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError(f"host names repeat: {', '.join(self.hosts)}")
        if len(self.hosts) > 200:
            raise ValueError(f"at most 200 hosts, got {len(self.hosts)}")
        for h in self.hosts:
            if not _HOST_RE.match(h):
                raise ValueError(
                    f"host name {h!r}: lowercase letters and digits, "
                    "starting with a letter, at most 16"
                )
        pairs = set()
        for link in self.links:
            for end in (link.a, link.b):
                if end not in self.hosts:
                    raise ValueError(f"link {link.a}-{link.b}: unknown host {end!r}")
            if link.a == link.b:
                raise ValueError(f"link {link.a}-{link.b}: a link joins two different hosts")
            if not link.mbit > 0 or not link.delay_ms >= 0:
                raise ValueError(
                    f"link {link.a}-{link.b}: mbit must be > 0 and delay_ms "
                    f">= 0, got {link.mbit}, {link.delay_ms}"
                )
            pair = frozenset((link.a, link.b))
            if pair in pairs:
                raise ValueError(f"link {link.a}-{link.b} is given twice")
            pairs.add(pair)
        for h, mbit in self.nic_mbit.items():
            if h not in self.hosts:
                raise ValueError(f"NIC of unknown host {h!r}")
            if not mbit > 0:
                raise ValueError(f"NIC of {h}: mbit must be > 0, got {mbit}")
        self.token = secrets.token_hex(3)
        self.subnet: ipaddress.IPv4Network | None = None
        self.bridge = f"hpb{self.token}"
        # what was made, in order; undone in reverse by _undo (the finalizer)
        self._made: list[tuple[str, str]] = []
        self._finalizer = weakref.finalize(self, _undo, self._made)
        self._old_term: Any = None
        self._rooted: set[str] = set()  # hosts whose eth0 has the HTB root

    # ------------------------------------------------------------------ names

    def namespace(self, host: str) -> str:
        return f"{PREFIX}-{os.getpid()}-{self.token}-{host}"

    def address(self, host: str) -> str:
        """The host's IPv4 address (on its ``eth0``)."""
        assert self.subnet is not None, "the network is not started"
        return str(self.subnet.network_address + 2 + self.hosts.index(host))

    @property
    def gateway(self) -> str:
        """The bridge's address: how the creating namespace reaches every host."""
        assert self.subnet is not None, "the network is not started"
        return str(self.subnet.network_address + 1)

    def exec_argv(self, host: str) -> list[str]:
        """The prefix that runs a command inside ``host``'s namespace."""
        return [_ip() or "ip", "netns", "exec", self.namespace(host)]

    # ------------------------------------------------------------------ running

    def run(self, host: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` (``subprocess.run`` arguments pass through)."""
        return subprocess.run([*self.exec_argv(host), *argv], **kw)

    def popen(self, host: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``host``; ``ip netns exec`` execs it, so the pid is its own."""
        return subprocess.Popen([*self.exec_argv(host), *argv], **kw)

    def namespaces(self) -> list[str]:
        """This network's namespaces that exist now (empty once closed)."""
        return [n for kind, n in self._made if kind == "netns"]

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Network:
        try:
            self._trap_term()
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Network:
        why = unavailable(shaping=bool(self.links or self.nic_mbit))
        if why is not None:
            raise NetnsError(f"cannot make network namespaces: {why}")
        sweep_stale()
        self.subnet = _free_subnet()
        alias = f"{PREFIX}-{os.getpid()}"
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        self._ip("link", "set", self.bridge, "alias", alias)
        self._ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts):
            ns, veth = self.namespace(host), f"hpv{self.token}{i}"
            self._ip("netns", "add", ns)
            self._made.append(("netns", ns))
            self._ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            self._made.append(("link", veth))
            self._ip("link", "set", veth, "alias", alias)
            self._ip("link", "set", f"{veth}p", "netns", ns)
            self._ip("-n", ns, "link", "set", f"{veth}p", "name", "eth0")
            self._ip(
                "-n",
                ns,
                "addr",
                "add",
                f"{self.address(host)}/{self.subnet.prefixlen}",
                "dev",
                "eth0",
            )
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            self._ip("link", "set", veth, "master", self.bridge)
            self._ip("link", "set", veth, "up")
        for k, link in enumerate(self.links):
            self._shape(link.a, link.b, link, k)
            self._shape(link.b, link.a, link, k)
        for host, mbit in self.nic_mbit.items():
            self._shape_nic(host, mbit)
        return self

    def close(self) -> None:
        """Undo everything made (idempotent); restore the SIGTERM handler."""
        self._finalizer()
        if self._old_term is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def _trap_term(self) -> None:
        """Turn a default SIGTERM into SystemExit, so ``with`` blocks unwind and clean up."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_term = signal.signal(signal.SIGTERM, _exit_on_term)

    # ------------------------------------------------------------------ shaping

    def _shape(self, src: str, dst: str, link: Link, k: int) -> None:
        """Cap ``src``'s egress to ``dst`` (HTB class 1:<k+10>, netem under it for delay)."""
        ns = self.namespace(src)
        tc = ["-n", ns]
        self._root(src)
        cls = f"1:{k + 10:x}"
        self._class(ns, cls, link.mbit)
        if link.delay_ms > 0:
            self._tc(
                *tc,
                "qdisc",
                "add",
                "dev",
                "eth0",
                "parent",
                cls,
                "handle",
                f"{k + 10:x}:",
                "netem",
                "delay",
                f"{link.delay_ms}ms",
                "limit",
                "100000",
                hint="link delay needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM)",
            )
        self._filter(ns, "1", f"{self.address(dst)}/32", cls)

    def _shape_nic(self, host: str, mbit: float) -> None:
        """Cap what ``host`` sends to the network's other hosts, all together (class 1:2,
        below the links' filters so a link's traffic keeps its own class)."""
        ns = self.namespace(host)
        self._root(host)
        self._class(ns, "1:2", mbit)
        assert self.subnet is not None
        self._filter(ns, "2", str(self.subnet), "1:2")

    def _root(self, host: str) -> None:
        """The HTB root on ``host``'s eth0 once, its default class unshaped."""
        tc = ["-n", self.namespace(host)]
        if host not in self._rooted:
            self._tc(
                *tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1"
            )
            self._tc(
                *tc,
                "class",
                "add",
                "dev",
                "eth0",
                "parent",
                "1:",
                "classid",
                "1:1",
                "htb",
                "rate",
                _UNSHAPED,
                "quantum",
                "60000",
            )
            self._rooted.add(host)

    def _class(self, ns: str, cls: str, mbit: float) -> None:
        """An HTB class ``cls`` under the root, capped at ``mbit``."""
        rate = f"{mbit * 1000:.0f}kbit"
        self._tc(
            "-n",
            ns,
            "class",
            "add",
            "dev",
            "eth0",
            "parent",
            "1:",
            "classid",
            cls,
            "htb",
            "rate",
            rate,
            "ceil",
            rate,
            "quantum",
            "1514",
        )

    def _filter(self, ns: str, prio: str, dst: str, cls: str) -> None:
        """Send eth0's packets to ``dst`` (an address or a subnet) into class ``cls``."""
        self._tc(
            "-n",
            ns,
            "filter",
            "add",
            "dev",
            "eth0",
            "protocol",
            "ip",
            "parent",
            "1:",
            "prio",
            prio,
            "u32",
            "match",
            "ip",
            "dst",
            dst,
            "flowid",
            cls,
        )

    def _ip(self, *args: str) -> None:
        _check([_ip() or "ip", *args])

    def _tc(self, *args: str, hint: str = "") -> None:
        if args[:1] == ("-n",):  # tc has no -n: run it inside the namespace
            _check([_ip() or "ip", "netns", "exec", args[1], _tc() or "tc", *args[2:]], hint)
        else:
            _check([_tc() or "tc", *args], hint)


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _check(argv: list[str], hint: str = "") -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        err = done.stderr.strip().splitlines()
        raise NetnsError(
            f"`{' '.join(argv)}` failed: {err[-1] if err else done.returncode}"
            + (f" ({hint})" if hint else "")
        )


def _undo(made: list[tuple[str, str]]) -> None:
    """Delete what was made, last first; a veth goes before its namespace (deleting a
    namespace frees its devices only later, asynchronously)."""
    ip = _ip() or "ip"
    for kind, name in reversed(made):
        if kind == "link":
            subprocess.run([ip, "link", "del", name], capture_output=True)
        elif kind == "netns":
            subprocess.run([ip, "netns", "del", name], capture_output=True)
    made.clear()


_CLONE_NEWNET = 0x40000000  # <sched.h>; Python's os.setns only from 3.12


def enter(namespace: str) -> None:
    """Move the calling thread, and the threads and sockets it makes afterwards, into the
    network namespace ``namespace`` (a :meth:`Network.namespace`): how a process started
    by :mod:`multiprocessing` (a benchmark's baseline rank) runs on a shaped host. Call it
    first, before any socket or thread is made."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    path = Path("/var/run/netns") / namespace
    if not path.exists():
        raise NetnsError(f"cannot enter network namespace {namespace}: it does not exist")
    with path.open("rb") as f:
        if libc.setns(f.fileno(), _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetnsError(f"cannot enter network namespace {namespace}: {os.strerror(err)}")


# ---------------------------------------------------------------------- measuring a link

_SINK = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
while c.recv(1 << 20):
    pass
c.sendall(b"k"); c.close()
"""
_SOURCE = """
import socket, sys, time
n = int(sys.argv[3]); buf = bytes(1 << 16)
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=120)
t0 = time.perf_counter()
while n > 0:
    s.sendall(buf[:min(n, len(buf))]); n -= len(buf)
s.shutdown(socket.SHUT_WR); s.recv(1)
print(time.perf_counter() - t0)
"""


def measure_mbit(net: Network, src: str, dst: str, nbytes: int, timeout: float = 120.0) -> float:
    """Megabits per second of payload one TCP stream carries from host ``src`` to ``dst``
    (``nbytes`` sent, timed until the receiver has them all)."""
    sink = net.popen(
        dst, [sys.executable, "-c", _SINK, net.address(dst)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert sink.stdout is not None
        port = sink.stdout.readline().strip()
        if not port:
            raise NetnsError(f"the receiver in {dst} did not start")
        done = net.run(
            src,
            [sys.executable, "-c", _SOURCE, net.address(dst), port, str(nbytes)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise NetnsError(f"sending {src} -> {dst} failed: {done.stderr.strip()[-200:]}")
        return nbytes * 8 / float(done.stdout) / 1e6
    finally:
        sink.kill()
        sink.wait(timeout=10)


# ---------------------------------------------------------------------- a cluster on it


def netns_cluster_toml(
    net: Network,
    hosts: Mapping[str, Sequence[DeviceDef]],
    *,
    shards: Sequence[str],
    intra_gbps: float = 10.0,
    inter_gbps: float = 10.0,
    heartbeat_s: float = 0.5,
    lost_after_s: float = 3.0,
    curve: bool = True,
) -> str:
    """A cluster file with one ``[[node]]`` per host (its namespace address) and, for every
    device pair across a shaped link, a ``[[network.link]]`` at that link's rate.

    ``shards`` names the host of each PS shard (the first is the head). ``intra_gbps`` and
    ``inter_gbps`` are what the planner assumes for unshaped links (loopback inside a host,
    the bridge between hosts). Every port is 0 (chosen when the daemon binds).
    """
    for h in (*hosts, *shards):
        if h not in net.hosts:
            raise ValueError(f"unknown host {h!r} (hosts: {', '.join(net.hosts)})")
    addrs = ", ".join(f'"{net.address(h)}:0"' for h in shards)
    lines = [
        "[ps]",
        f"shards = [{addrs}]",
        "",
        "[network]",
        f"intra_node_gbps = {intra_gbps}",
        f"inter_node_gbps = {inter_gbps}",
        "",
    ]
    for link in net.links:
        for da in hosts.get(link.a, ()):
            for db in hosts.get(link.b, ()):
                lines += [
                    "[[network.link]]",
                    f'a = "{da.name}"',
                    f'b = "{db.name}"',
                    f"gbps = {link.gbps}",
                    "",
                ]
    lines += [
        "[runtime]",
        f"heartbeat_s = {heartbeat_s}",
        f"lost_after_s = {lost_after_s}",
        "",
        "[security]",
        f"curve = {'true' if curve else 'false'}",
        "",
    ]
    for host, devices in hosts.items():
        lines += ["[[node]]", f'name = "{host}"', f'host = "{net.address(host)}"', ""]
        for d in devices:
            lines += [
                "[[node.device]]",
                f'name = "{d.name}"',
                f'device = "{d.device}"',
                f'type = "{d.type}"',
                f'memory = "{d.memory}"',
                f"speed = {d.speed}",
                "port = 0",
                "",
            ]
    return "\n".join(lines)


class NetnsCluster(LocalCluster):
    """A :class:`LocalCluster` whose daemons run inside the hosts of a :class:`Network`.

    Each shard and worker starts in the namespace whose address its cluster-file host is;
    the client (this process) reaches the head through the bridge.
    """

    def __init__(
        self, net: Network, cluster_path: str | Path, run_dir: str | Path, **kw: Any
    ) -> None:
        self.net = net
        super().__init__(cluster_path, run_dir, **kw)
        self._host_of = {net.address(h): h for h in net.hosts}
        for where in [s.host for s in self.cluster.ps] + [d.host for d in self.cluster.devices]:
            if where not in self._host_of:
                raise NetnsError(
                    f"{cluster_path}: host {where} is not an address of the "
                    f"network's hosts ({', '.join(self._host_of)})"
                )

    def _daemons(self, head: str | None) -> list[launch.Daemon]:
        out = []
        for d in launch.local_daemons(
            self.cluster,
            self.cluster_path,
            run_dir=self.run_dir,
            head=head,
            local=lambda host: True,
        ):
            if d.name.startswith("ps"):
                host = self.cluster.ps[int(d.name[2:])].host
            else:
                host = self.cluster.device(d.name.removeprefix("worker-")).host
            out.append(launch.Daemon(d.name, (*self.net.exec_argv(self._host_of[host]), *d.argv)))
        return out
