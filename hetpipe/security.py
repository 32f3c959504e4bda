"""Trust: CurveZMQ keys and authentication, who may send what, and which code a job may load.

Why one home: the daemons, the CLI and the tests must agree on key file names, on the user id a
key stands for, and on the code-loading rule, or a check in one place is undone in another.

**Keys.** ``hetpipe keys`` (and ``hetpipe up``/``demo`` on first use) writes the cluster's
CurveZMQ certificates into the ``[security] keys`` directory (0700, every file 0600):

=================  ===========================================================================
``server``         held by every daemon; its sockets that bind serve with it (one cluster key)
``client``         the users' key: the CLI, scripts and tests talking to the head
``ps<i>``          shard ``i``'s own key when it connects (shard 0's is the head's)
``worker-<dev>``   the worker of device ``dev``'s own key when it connects
=================  ===========================================================================

A key's file name is the *user id* ZAP gives the peer: every received message carries it
(``Message.user``), so the daemons decide by who sent a message, not by what it claims.

**Authentication** happens in the handshake: a socket that binds runs as a Curve server, and
one ZAP authenticator per process (per ZeroMQ context) accepts only the public keys of the
keys directory, so a peer without a valid key never gets a message through to a handler. Each
refused peer is logged once, not once per reconnect.

**Authority.** :data:`AUTHORITY` declares, for every message kind, who may send it and which
daemon takes it; :func:`may_send` is the one check the head, the shards and the workers make
on every message they receive. Clients submit, read and cancel jobs; a worker speaks only for
its own device, and about a stage only when the head assigned it that stage (its pushes count
only as the stage's leader; its replicas may pull); a shard only for its own index; only the
head initialises, fetches, cuts and drops a job's shards, and assigns stages. Activations
come only from the previous stage, gradients only from the next, weight gradients only from
the stage's other replicas.

**Code.** A job may name builtin models and data sets; ``package.module:function`` only for
modules listed in ``[security] allowed_modules`` or registered by an installed package as a
``hetpipe.models`` / ``hetpipe.data`` entry point. Anything else is refused before any import.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from importlib import metadata
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from hetpipe import log as logmod
from hetpipe.jobstore import safe_name
from hetpipe.ratelog import excerpt
from hetpipe.wire import Kind

__all__ = [
    "ANYONE",
    "AUTHORITY",
    "CLIENT",
    "CodeError",
    "Curve",
    "Daemon",
    "KeysError",
    "Role",
    "Rule",
    "SecuritySpec",
    "ZapAuthenticator",
    "apply_curve",
    "check_code",
    "check_job_name",
    "ensure_keys",
    "key_names",
    "kinds_to",
    "load_curve",
    "log_refused_handshakes",
    "may_send",
    "missing_keys",
    "module_allowed",
    "shard_user",
    "start_authenticator",
    "worker_user",
]

CLIENT = "client"
SERVER = "server"
MAX_JOB_NAME = 64
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class SecuritySpec:
    """The ``[security]`` table of cluster.toml.

    ``curve = false`` turns authentication and encryption off: every peer that can reach a
    port is then trusted with everything (``status`` and every daemon's log say so).
    ``keys`` is absolute once loaded (a relative path is taken from the cluster file's folder).
    """

    curve: bool = True
    keys: str = ".hetpipe/keys"
    allowed_modules: tuple[str, ...] = ()


class KeysError(RuntimeError):
    """Keys are missing or unreadable; the text says which and how to make them."""


class CodeError(ValueError):
    """A job names code the cluster does not allow; ``str(e)`` is one line."""


# -- user ids --------------------------------------------------------------------------------


def shard_user(index: int) -> str:
    """The user id (key name) of shard ``index``; ``shard_user(0)`` is the head."""
    return f"ps{index}"


def worker_user(device: str) -> str:
    """The user id (key name) of the worker of ``device``."""
    return f"worker-{device}"


def key_names(shards: int, devices: Iterable[str]) -> list[str]:
    """Every key a cluster needs, server first."""
    return [
        SERVER,
        CLIENT,
        *(shard_user(i) for i in range(shards)),
        *(worker_user(d) for d in devices),
    ]


# -- authority: who may send which kind of message -------------------------------------------


class Role(StrEnum):
    """Who may send a kind of message, as the receiver can tell it from the sender's user id.

    The first four are read off the user id and the message itself; the stage roles depend on
    what the receiver knows of the message's (job, vw, stage), which it passes as ``holders``
    to :func:`may_send`.
    """

    CLIENT = "client"  # the users' key (the CLI, scripts, tests)
    HEAD = "head"  # shard 0's key: the head lives in that process
    NAMED_WORKER = "named worker"  # the worker of the device the field ``device`` names
    NAMED_SHARD = "named shard"  # the shard the field ``shard`` names
    STAGE_LEADER = "stage leader"  # the worker whose pushes count for the message's stage
    STAGE_GROUP = "stage group"  # that worker or one of the stage's replicas
    PREVIOUS_STAGE = "previous stage"  # a device of stage - 1 of the receiver's VW
    NEXT_STAGE = "next stage"  # a device of stage + 1 of the receiver's VW
    OTHER_REPLICA = "other replica"  # another device of the receiver's (replicated) stage
    PEER = "peer"  # any keyed peer: a reply, matched to its request by ``rid``
    NOBODY = "nobody"  # never sent: the frame format of tensor files


class Daemon(StrEnum):
    """Which process takes a kind of message (the shard-0 process routes by it)."""

    HEAD = "head"
    SHARD = "shard"
    WORKER = "worker"
    ANY = "any"  # replies go back to whoever asked


@dataclass(frozen=True)
class Rule:
    """One row of :data:`AUTHORITY`: who may send a kind, and which daemon takes it."""

    sender: Role
    to: Daemon


AUTHORITY: Mapping[Kind, Rule] = {
    # to the head: the users' requests
    Kind.SUBMIT: Rule(Role.CLIENT, Daemon.HEAD),
    Kind.CANCEL: Rule(Role.CLIENT, Daemon.HEAD),
    Kind.JOB_STATUS: Rule(Role.CLIENT, Daemon.HEAD),
    Kind.CLUSTER_STATUS: Rule(Role.CLIENT, Daemon.HEAD),
    Kind.TRACE: Rule(Role.CLIENT, Daemon.HEAD),
    Kind.PROFILE: Rule(Role.CLIENT, Daemon.HEAD),
    Kind.PLAN: Rule(Role.CLIENT, Daemon.HEAD),
    # to the head: registration and liveness, each daemon only in its own name
    Kind.HELLO: Rule(Role.NAMED_WORKER, Daemon.HEAD),
    Kind.HEARTBEAT: Rule(Role.NAMED_WORKER, Daemon.HEAD),
    Kind.SHARD_HELLO: Rule(Role.NAMED_SHARD, Daemon.HEAD),
    # to the head: a stage's progress, result, failure and checkpointed state
    Kind.REPORT: Rule(Role.STAGE_GROUP, Daemon.HEAD),
    Kind.STAGE_DONE: Rule(Role.STAGE_GROUP, Daemon.HEAD),
    Kind.STAGE_RECORDS: Rule(Role.STAGE_GROUP, Daemon.HEAD),
    Kind.STAGE_FAILED: Rule(Role.STAGE_GROUP, Daemon.HEAD),
    Kind.STAGE_STATE: Rule(Role.STAGE_GROUP, Daemon.HEAD),
    # to a worker, from the head: registration, stage assignment, profiling, start, abort
    Kind.WELCOME: Rule(Role.HEAD, Daemon.WORKER),
    Kind.ASSIGN: Rule(Role.HEAD, Daemon.WORKER),
    Kind.MEASURE: Rule(Role.HEAD, Daemon.WORKER),
    Kind.START: Rule(Role.HEAD, Daemon.WORKER),
    Kind.ABORT: Rule(Role.HEAD, Daemon.WORKER),
    # to a worker's data port, from its neighbours in the pipeline
    Kind.ACT: Rule(Role.PREVIOUS_STAGE, Daemon.WORKER),
    Kind.GRAD: Rule(Role.NEXT_STAGE, Daemon.WORKER),
    Kind.REPLICA_GRAD: Rule(Role.OTHER_REPLICA, Daemon.WORKER),
    # to a shard: WSP traffic of the stage the head assigned, and the head's own requests
    Kind.PUSH: Rule(Role.STAGE_LEADER, Daemon.SHARD),
    Kind.REDUCE: Rule(Role.STAGE_LEADER, Daemon.SHARD),
    Kind.PULL: Rule(Role.STAGE_GROUP, Daemon.SHARD),
    Kind.SHARD_INIT: Rule(Role.HEAD, Daemon.SHARD),
    Kind.SHARD_FETCH: Rule(Role.HEAD, Daemon.SHARD),
    Kind.SHARD_DROP: Rule(Role.HEAD, Daemon.SHARD),
    Kind.SHARD_CUT: Rule(Role.HEAD, Daemon.SHARD),
    # replies
    Kind.OK: Rule(Role.PEER, Daemon.ANY),
    Kind.ERROR: Rule(Role.PEER, Daemon.ANY),
    Kind.PULLED: Rule(Role.PEER, Daemon.ANY),
    Kind.REDUCED: Rule(Role.PEER, Daemon.ANY),
    Kind.TENSORS: Rule(Role.NOBODY, Daemon.ANY),
}


class _Anyone(Collection[str]):
    """Every user id: what a receiver passes for a stage it keeps no record of."""

    def __contains__(self, _user: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


ANYONE: Collection[str] = _Anyone()
"""For ``holders``: the receiver keeps no record of the message's job (a shard asked about a
job it does not hold); the message goes on to the receiver's own lookup, which refuses it with
an error naming the job."""


def kinds_to(daemon: Daemon) -> frozenset[Kind]:
    """The kinds of message ``daemon`` takes (replies not included)."""
    return frozenset(k for k, rule in AUTHORITY.items() if rule.to == daemon)


def may_send(
    kind: str,
    user: str | None,
    fields: Mapping[str, Any],
    holders: Callable[[Role], Collection[str]] | None = None,
) -> bool:
    """Whether peer ``user`` may send a message of ``kind`` with ``fields`` (see
    :data:`AUTHORITY`): the head, the shards and the workers all decide here.

    ``user`` is the sender's Curve user id; None (security off) trusts every peer.
    ``holders(role)`` gives the user ids that hold a stage role for this message, as the
    receiver knows them (the head's registry, a shard's ``owners``, a worker's task); a role
    it does not give is held by nobody. A kind the table does not declare is refused.
    """
    if user is None:
        return True
    rule = AUTHORITY.get(kind)  # type: ignore[call-overload]
    if rule is None:
        return False
    role = rule.sender
    if role == Role.PEER:
        return True
    if role == Role.NOBODY:
        return False
    if role == Role.CLIENT:
        return user == CLIENT
    if role == Role.HEAD:
        return user == shard_user(0)
    if role == Role.NAMED_WORKER:
        device = fields.get("device")
        return isinstance(device, str) and user == worker_user(device)
    if role == Role.NAMED_SHARD:
        shard = fields.get("shard")
        return isinstance(shard, int) and user == shard_user(shard)
    return holders is not None and user in holders(role)


# -- keys ------------------------------------------------------------------------------------


def ensure_keys(
    keys_dir: str | os.PathLike[str], names: Sequence[str], *, force: bool = False
) -> list[str]:
    """Create the missing key pairs of ``names`` in ``keys_dir``; return the names created.

    Each pair is made in a private temporary folder and renamed into place, so a secret key
    is never readable by others, not even for a moment, and two processes creating keys at
    once never leave half a pair. ``force`` replaces existing pairs (key rotation: every
    daemon and client must then be restarted with the new files).
    """
    root = Path(keys_dir)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.suppress(OSError):
        os.chmod(root, 0o700)
    made = []
    for name in names:
        public, secret = root / f"{name}.key", root / f"{name}.key_secret"
        if public.exists() and secret.exists() and not force:
            continue
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            pub, sec = zmq.auth.create_certificates(str(tmp), name)
            for path in (pub, sec):
                os.chmod(path, 0o600)
            # the secret first: a public file present means its pair is complete
            os.replace(sec, secret)
            os.replace(pub, public)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        made.append(name)
    return made


def missing_keys(
    keys_dir: str | os.PathLike[str], names: Sequence[str], secret: Collection[str]
) -> list[str]:
    """The key files of ``names`` that ``keys_dir`` lacks: every public key, and the secret
    key of each of ``secret`` (the server and this host's own daemons)."""
    root = Path(keys_dir)
    wanted = [f"{n}.key" for n in names] + [f"{n}.key_secret" for n in names if n in secret]
    return [f for f in wanted if not (root / f).is_file()]


@dataclass(frozen=True)
class Curve:
    """What one process needs for CurveZMQ: its own key pair and the cluster's server key.

    ``server_secret`` is set for daemons only (their binding sockets serve with it).
    """

    name: str
    public: bytes
    secret: bytes
    server_public: bytes
    server_secret: bytes | None = None


def _read_pair(root: Path, name: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    path = root / (f"{name}.key_secret" if secret else f"{name}.key")
    if not path.exists():
        raise KeysError(f"missing key {path}: create the cluster's keys with `hetpipe keys`")
    try:
        public, sec = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise KeysError(
            f"unusable key {path} ({type(exc).__name__}): re-create it with `hetpipe keys --force`"
        ) from None
    if secret and sec is None:
        raise KeysError(f"{path} holds no secret key (create the keys with `hetpipe keys`)")
    return public, sec


def load_curve(spec: SecuritySpec, name: str, *, serve: bool) -> Curve | None:
    """The Curve keys of key ``name`` (None when ``curve = false``); ``serve`` for daemons."""
    if not spec.curve:
        return None
    root = Path(spec.keys)
    public, secret = _read_pair(root, name, secret=True)
    server_public, server_secret = _read_pair(root, SERVER, secret=serve)
    assert secret is not None
    return Curve(name, public, secret, server_public, server_secret if serve else None)


def apply_curve(sock: zmq.Socket, curve: Curve | None, *, server: bool) -> None:
    """Set a socket's Curve options (before it binds or connects); None leaves it plain."""
    if curve is None:
        return
    if server:
        if curve.server_secret is None:
            raise KeysError(f"{curve.name} cannot serve: it has no server secret key")
        sock.curve_server = True
        sock.curve_publickey = curve.server_public
        sock.curve_secretkey = curve.server_secret
    else:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret


class ZapAuthenticator(AsyncioAuthenticator):
    """Accepts the keys of one keys directory; their file names become the peers' user ids.

    A refused peer (address and key) is logged once: ZeroMQ reconnects every 100 ms, and a
    log line per attempt would drown the log.
    """

    RELOAD_EVERY_S = 5.0

    def __init__(self, context: zmq.Context, keys_dir: str, who: str) -> None:
        super().__init__(context)
        self.keys_dir = keys_dir
        self.users: dict[bytes, str] = {}
        self._address = ""
        self._refused: set[tuple[str, bytes]] = set()
        self._loaded = 0.0
        self._log = logmod.get("auth").bind(daemon=who)
        self._load()

    def _load(self) -> None:
        """Read the keys directory (again): a device added later gets its key with
        ``hetpipe keys``, and its worker can join without restarting every daemon."""
        users = {}
        for path in sorted(Path(self.keys_dir).glob("*.key")):
            if path.stem == SERVER:
                continue
            with contextlib.suppress(OSError, ValueError):
                public, _ = zmq.auth.load_certificate(str(path))  # z85 text
                users[z85.decode(public)] = path.stem  # ZAP hands over binary keys
        self.users = users
        self._loaded = time.monotonic()

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) > 3:
            self._address = msg[3].decode("utf-8", "replace")
        await super().handle_zap_message(msg)

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        if client_key not in self.users and time.monotonic() - self._loaded > self.RELOAD_EVERY_S:
            self._load()
        if client_key in self.users:
            return True, b"OK"
        peer = (self._address, client_key)
        if peer not in self._refused and len(self._refused) < 10_000:
            self._refused.add(peer)
            self._log.warning(
                "peer refused: its key is not one of this cluster's",
                address=self._address,
                key=z85.encode(client_key).decode(),
            )
        return False, b"Unknown key"

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.users[client_public_key]


_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
SUMMARY_EVERY_S = 60.0


async def log_refused_handshakes(sock: zmq.Socket, who: str) -> None:
    """Log the handshakes a Curve server socket refuses before ZAP is asked.

    A peer without keys, or with another cluster's server key, fails inside libzmq (wrong
    mechanism, or a hello this server cannot open), so neither ZAP nor this process learns its
    address: the first refusal is logged, then at most one line a minute with the count.
    Refusals by key (ZAP) are logged by :class:`ZapAuthenticator`, once per peer.
    """
    log = logmod.get("auth").bind(daemon=who)
    mon = sock.get_monitor_socket(_HANDSHAKE_FAILED)
    count, last = 0, -SUMMARY_EVERY_S
    loop = asyncio.get_running_loop()
    try:
        while True:
            event = parse_monitor_message(await mon.recv_multipart())
            count += 1
            if loop.time() - last >= SUMMARY_EVERY_S:
                log.warning(
                    "handshakes refused: peers without this cluster's keys",
                    count=count,
                    endpoint=event["endpoint"].decode(errors="replace"),
                    error=event["value"],
                )
                count, last = 0, loop.time()
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        mon.close(linger=0)


def start_authenticator(ctx: zmq.Context, spec: SecuritySpec, who: str) -> ZapAuthenticator | None:
    """Start the process's ZAP handler (inside the running event loop); None when off.

    It must run before any Curve server socket of ``ctx`` binds: without a ZAP handler,
    libzmq's Curve server would accept any client key.
    """
    if not spec.curve:
        logmod.get("auth").warning(
            "SECURITY OFF: [security] curve = false; every peer that reaches a port is trusted",
            daemon=who,
        )
        return None
    auth = ZapAuthenticator(ctx, spec.keys, who)
    if not auth.users:
        raise KeysError(f"no client keys in {spec.keys}: create them with `hetpipe keys`")
    auth.start()
    return auth


# -- jobs ------------------------------------------------------------------------------------


def check_job_name(name: Any) -> None:
    """A job name lands in file paths: letters, digits, ``_ . -``; no ``..``; at most 64."""
    if not isinstance(name, str) or not name:
        raise CodeError("job: name: must be a non-empty string")
    if len(name) > MAX_JOB_NAME:
        raise CodeError(f"job: name: longer than {MAX_JOB_NAME} characters ({len(name)})")
    if not safe_name(name):
        raise CodeError(
            f"job: name: {excerpt(name, 80)!r} is not allowed (letters, digits, "
            f"'_', '.', '-'; no '..', path separators or control characters)"
        )


def _entry_point_modules(group: str) -> set[str]:
    try:
        eps = metadata.entry_points(group=group)
    except Exception:  # a broken installed distribution must not open the gate
        return set()
    return {ep.value.split(":", 1)[0].strip() for ep in eps}


def module_allowed(module: str, allowed: Sequence[str], group: str) -> bool:
    """``module`` is listed (itself or a package above it) or provides a ``group`` entry point."""
    if any(module == a or module.startswith(f"{a}.") for a in allowed):
        return True
    return module in _entry_point_modules(group)


def _check_code(
    what: str,
    name: Any,
    builtins: Iterable[str],
    allowed: Sequence[str],
    group: str,
    key: str = "name",
) -> None:
    if not isinstance(name, str) or name in builtins:
        return  # not a string: the job's own validation says what is wrong
    if ":" not in name:
        return  # an unknown builtin or an entry point's name: the loader looks it up
    module = name.split(":", 1)[0]
    if not _MODULE.fullmatch(module):
        raise CodeError(
            f"job: {what}.{key}: {excerpt(name, 80)!r} is not 'package.module:function'"
        )
    if not module_allowed(module, allowed, group):
        raise CodeError(
            f"job: {what}.{key}: module {excerpt(module, 80)!r} is not allowed: list it in "
            f"cluster.toml [security] allowed_modules (or install it as a '{group}' "
            f"entry point)"
        )


def check_code(job: Any, allowed_modules: Sequence[str]) -> None:
    """Refuse a job (a dict in the job file's shape, or a JobSpec) before it imports anything.

    Raises :class:`CodeError` naming the module and the setting that would allow it.
    """
    from hetpipe.core.lr import KINDS
    from hetpipe.data import _LOADERS
    from hetpipe.models import BUILTIN

    if hasattr(job, "to_dict"):
        job = job.to_dict()
    if not isinstance(job, dict):
        raise CodeError("job: must be a table")
    check_job_name(job.get("name"))
    for what, builtins, group in (
        ("model", BUILTIN, "hetpipe.models"),
        ("data", _LOADERS, "hetpipe.data"),
    ):
        table = job.get(what)
        if isinstance(table, dict):
            _check_code(what, table.get("name"), builtins, allowed_modules, group)
            if what == "model":  # a loss function of the user's: the same policy
                _check_code("model", table.get("loss"), (), allowed_modules, group, "loss")
    table = job.get("lr_schedule")  # a schedule function: "hetpipe.lr_schedules" entry points
    if isinstance(table, dict):
        _check_code(
            "lr_schedule", table.get("kind"), KINDS, allowed_modules, "hetpipe.lr_schedules", "kind"
        )
    data = job.get("data")
    if isinstance(data, dict):  # the data set's own collate function, by the same rule
        _check_code("data", data.get("collate"), (), allowed_modules, "hetpipe.data", "collate")
    train = job.get("train")  # a metric function of the user's (train.metrics), likewise
    metrics = train.get("metrics") if isinstance(train, dict) else None
    for name in metrics if isinstance(metrics, list | tuple) else ():
        _check_code(
            "train", name, ("accuracy", "perplexity"), allowed_modules, "hetpipe.metrics", "metrics"
        )
