"""Trust: CurveZMQ keys and authentication, who may send what, and which code a job may load.

Why one home: the daemons, the CLI and the tests must agree on key file names, on the user id a
key stands for, and on the code-loading rule, or a check in one place is undone in another.

**Keys.** ``hetpipe keys`` (and ``hetpipe up``/``demo`` on first use) writes the cluster's
CurveZMQ certificates into the ``[security] keys`` directory (0700, every file 0600):

=================  ===========================================================================
``server``         held by every daemon; its sockets that bind serve with it (one cluster key)
``client``         the admin's key (user ``admin``): may act on every job
``user-<name>``    user ``name``'s own key (``hetpipe keys add-user NAME``): their own jobs
``ps<i>``          shard ``i``'s own key when it connects (shard 0's is the head's)
``worker-<dev>``   the worker of device ``dev``'s own key when it connects
=================  ===========================================================================

A key's file name is the *user id* ZAP gives the peer: every received message carries it
(``Message.user``), so the daemons decide by who sent a message, not by what it claims.

**Users.** Every client key is a user: ``client`` is the admin, ``user-<name>`` is user
``name``. The head records the user who submits a job as its owner (:func:`owner_of`) and lets
only the owner or the admin cancel or resume it (:func:`may_act`); every user may read every
job's status. Without Curve there is no user to tell apart: every job's owner is ``local`` and
nothing is refused.

**Authentication** happens in the handshake: a socket that binds runs as a Curve server, and
one ZAP authenticator per process (per ZeroMQ context) accepts only the public keys of the
keys directory, so a peer without a valid key never gets a message through to a handler. Each
refused peer is logged once, not once per reconnect.

**Data path.** With ``[security] data_path = "mac"`` the daemons' tensors travel on plain TCP
at each serving port + 1000 (:func:`data_address`), every message tagged under a session key
that its sender handed over Curve (:mod:`hetpipe.framemac`, :mod:`hetpipe.transport`): the
key's owner is the message's user id, so the rules below apply as on Curve.

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
    "ADMIN",
    "ANYONE",
    "AUTHORITY",
    "CLIENT",
    "DATA_PATHS",
    "DATA_PORT_OFFSET",
    "LOCAL",
    "CodeError",
    "Curve",
    "Daemon",
    "KeysError",
    "Role",
    "Rule",
    "SecuritySpec",
    "ZapAuthenticator",
    "add_user",
    "apply_curve",
    "bundle_keys",
    "check_code",
    "check_job_name",
    "check_user_name",
    "data_address",
    "ensure_keys",
    "key_names",
    "kinds_to",
    "list_users",
    "load_curve",
    "log_refused_handshakes",
    "may_act",
    "may_send",
    "missing_keys",
    "module_allowed",
    "owner_of",
    "remove_user",
    "shard_user",
    "start_authenticator",
    "user_key",
    "worker_user",
]

CLIENT = "client"
SERVER = "server"
ADMIN = "admin"  # the user the key ``client`` stands for
LOCAL = "local"  # the owner of every job where Curve is off
USER_PREFIX = "user-"
MAX_JOB_NAME = 64
MAX_USER_NAME = 32
_USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class SecuritySpec:
    """The ``[security]`` table of cluster.toml.

    ``curve = false`` turns authentication and encryption off: every peer that can reach a
    port is then trusted with everything (``status`` and every daemon's log say so).
    ``data_path`` (with Curve on) says how the bulk tensors between daemons travel: ``curve``
    encrypts them like everything else; ``mac`` sends them on plain TCP with a keyed MAC per
    message under a key agreed over Curve (:mod:`hetpipe.framemac`): authenticated, not
    encrypted.
    ``keys`` is absolute once loaded (a relative path is taken from the cluster file's folder).
    """

    curve: bool = True
    keys: str = ".hetpipe/keys"
    allowed_modules: tuple[str, ...] = ()
    ship_code: bool = False  # jobs carry their user modules' sources (hetpipe.usercode)
    data_path: str = "curve"  # DATA_PATHS: how the daemons' data sockets carry tensors


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


def user_key(name: str) -> str:
    """The key name (user id) of user ``name``; the admin's is the cluster's ``client`` key."""
    return CLIENT if name == ADMIN else f"{USER_PREFIX}{name}"


def owner_of(user: str | None) -> str:
    """The user a peer's user id stands for, as a job's owner: ``admin`` for the ``client``
    key, ``name`` for ``user-<name>``, ``local`` without Curve (no user id to go by; no
    user may be called ``local``, so a job recorded without an owner is the admin's alone)."""
    if user is None:
        return LOCAL
    if user == CLIENT:
        return ADMIN
    return user.removeprefix(USER_PREFIX)


def may_act(user: str | None, owner: str | None) -> bool:
    """Whether peer ``user`` may act on (cancel, resume) a job of ``owner``: its owner and
    the admin may; without Curve (``user`` None) everyone may. A job with no recorded owner
    (None, or ``local``) is the admin's alone."""
    if user is None or user == CLIENT:
        return True
    return owner is not None and owner_of(user) == owner


def _is_user(user: str) -> bool:
    return user == CLIENT or user.startswith(USER_PREFIX)


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

    CLIENT = "client"  # a user's key: the admin's (client) or one's own (user-<name>)
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
    Kind.CHECKPOINT: Rule(Role.CLIENT, Daemon.HEAD),
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
    Kind.MIGRATE: Rule(Role.STAGE_GROUP, Daemon.HEAD),
    # to a worker, from the head: registration, stage assignment, profiling, start, abort
    Kind.WELCOME: Rule(Role.HEAD, Daemon.WORKER),
    Kind.ASSIGN: Rule(Role.HEAD, Daemon.WORKER),
    Kind.MEASURE: Rule(Role.HEAD, Daemon.WORKER),
    Kind.START: Rule(Role.HEAD, Daemon.WORKER),
    Kind.MIGRATE_ORDER: Rule(Role.HEAD, Daemon.WORKER),
    Kind.CUT_AT: Rule(Role.HEAD, Daemon.WORKER),
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
        return _is_user(user)
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


# -- users: one client key each ---------------------------------------------------------------


def check_user_name(name: Any) -> None:
    """A user's name is part of a key file's name: letters, digits, ``_ . -`` (starting with
    a letter or digit), at most 32; ``admin`` is the cluster's ``client`` key, not a user."""
    if not isinstance(name, str) or not _USER.fullmatch(name) or len(name) > MAX_USER_NAME:
        raise KeysError(
            f"user name {excerpt(str(name), 80)!r} is not allowed (letters, digits, '_', '.', "
            f"'-', starting with a letter or digit, at most {MAX_USER_NAME})"
        )
    if name == ADMIN:
        raise KeysError("user name 'admin' is taken: the admin's key is the cluster's client key")
    if name == LOCAL:
        raise KeysError("user name 'local' is taken: it owns the jobs of a cluster without Curve")


def add_user(
    keys_dir: str | os.PathLike[str],
    name: str,
    *,
    out: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> list[Path]:
    """Give user ``name`` a key pair of their own; return the files the user keeps.

    The head accepts the public key ``user-<name>.key`` of ``keys_dir``. The user keeps their
    secret key and the server's public key: in ``keys_dir`` itself by default (one host, or a
    keys folder the users share), or, with ``out``, only in that folder (then handed to the
    user), ``keys_dir`` keeping the public key alone. An existing user is refused unless
    ``force`` (a new key: the old one is refused from its next connection on).
    """
    check_user_name(name)
    root = Path(keys_dir)
    key = user_key(name)
    public = root / f"{key}.key"
    if public.exists() and not force:
        raise KeysError(f"user {name!r} already has a key ({public}); --force replaces it")
    server = root / f"{SERVER}.key"
    if not server.is_file():
        raise KeysError(f"missing key {server}: create the cluster's keys with `hetpipe keys`")
    if out is None:
        ensure_keys(root, [key], force=True)
        return [root / f"{key}.key_secret", server]
    dest = Path(out)
    ensure_keys(dest, [key], force=True)
    shutil.copyfile(server, dest / f"{SERVER}.key")
    os.chmod(dest / f"{SERVER}.key", 0o600)
    tmp = root / f".{key}.key.tmp"
    shutil.copyfile(dest / f"{key}.key", tmp)
    os.chmod(tmp, 0o600)
    os.replace(tmp, public)
    (root / f"{key}.key_secret").unlink(missing_ok=True)  # an older pair kept here
    return [dest / f"{key}.key_secret", dest / f"{SERVER}.key"]


def remove_user(keys_dir: str | os.PathLike[str], name: str) -> None:
    """Remove user ``name``'s key from ``keys_dir``: the head refuses it from its next
    connection on (:class:`ZapAuthenticator` checks a known key's file at each handshake)."""
    check_user_name(name)
    root = Path(keys_dir)
    key = user_key(name)
    public = root / f"{key}.key"
    if not public.exists():
        raise KeysError(f"no user {name!r} in {root} (hetpipe keys list-users)")
    (root / f"{key}.key_secret").unlink(missing_ok=True)
    public.unlink()


def list_users(keys_dir: str | os.PathLike[str]) -> list[str]:
    """The users whose keys ``keys_dir`` accepts, ``admin`` first when its key is there."""
    root = Path(keys_dir)
    users = sorted(p.stem.removeprefix(USER_PREFIX) for p in root.glob(f"{USER_PREFIX}*.key"))
    return ([ADMIN] if (root / f"{CLIENT}.key").is_file() else []) + users


def bundle_keys(
    keys_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    hosts: Mapping[str, Sequence[str]],
    head_host: str,
) -> dict[str, list[str]]:
    """Copy into ``out`` one folder per host and per user with exactly the key files each
    needs; return folder -> file names. Nothing is written when a file is missing.

    ``hosts`` maps each host to the key names of the daemons it runs (``ps<i>``,
    ``worker-<dev>``). ``hosts/<host>/``: the server pair, every public key but the users',
    and the secret key of each of its daemons; the head's host also the users' public keys
    (it alone accepts users). ``admin/``: the ``client`` pair and the server's public key.
    ``users/<name>/``: that user's pair (where the keys folder holds its secret; one handed
    out with ``add-user --out`` is not) and the server's public key.
    """
    root, dest = Path(keys_dir), Path(out)
    publics = sorted(p.name for p in root.glob("*.key") if not p.name.startswith(USER_PREFIX))
    users = sorted(p.stem for p in root.glob(f"{USER_PREFIX}*.key"))
    plan: dict[str, list[str]] = {}
    for host, daemons in hosts.items():
        files = [f"{SERVER}.key_secret", *publics, *(f"{d}.key_secret" for d in daemons)]
        if host == head_host:
            files += [f"{u}.key" for u in users]
        plan[f"hosts/{host.replace(':', '_')}"] = files
    plan["admin"] = [f"{CLIENT}.key_secret", f"{SERVER}.key"]
    for u in users:
        if (root / f"{u}.key_secret").exists():
            name = u.removeprefix(USER_PREFIX)
            plan[f"users/{name}"] = [f"{u}.key_secret", f"{u}.key", f"{SERVER}.key"]
    missing = sorted({f for files in plan.values() for f in files if not (root / f).is_file()})
    if missing:
        raise KeysError(
            f"cannot bundle: {root} lacks {', '.join(missing[:4])}"
            + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            + " (create the cluster's keys with `hetpipe keys` on this host)"
        )
    for folder, files in plan.items():
        d = dest / folder
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        for f in files:
            shutil.copyfile(root / f, d / f)
            os.chmod(d / f, 0o600)
    return plan


@dataclass(frozen=True)
class Curve:
    """What one process needs for CurveZMQ: its own key pair and the cluster's server key.

    ``server_secret`` is set for daemons only (their binding sockets serve with it).
    ``data_path`` is the cluster's ``[security] data_path`` (:func:`load_curve` sets it):
    with ``mac`` a daemon's binding sockets also take MAC-tagged data on a plain port
    (:func:`data_address`), and its data channels send on it.
    """

    name: str
    public: bytes
    secret: bytes
    server_public: bytes
    server_secret: bytes | None = None
    data_path: str = "curve"


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
    return Curve(
        name, public, secret, server_public, server_secret if serve else None, spec.data_path
    )


DATA_PATHS = ("mac", "curve")
DATA_PORT_OFFSET = 1000
"""With ``data_path = "mac"``, a daemon that serves on port P takes its MAC-tagged data on
port P + 1000 (both must be open between the hosts)."""


def data_address(address: str) -> str:
    """The plain data endpoint beside a daemon's Curve endpoint ``tcp://host:port``."""
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + DATA_PORT_OFFSET}"


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

    A key is checked at each handshake (each new connection): one whose file is gone or
    replaced since it was read makes the handler read the folder again, so a removed user
    (``hetpipe keys remove-user``) is refused from their next connection on; connections
    already open stay open until they close. A key not known yet is looked up again at most
    every :attr:`RELOAD_EVERY_S` (a device or user added later joins without a restart).

    A refused peer (address and key) is logged once: ZeroMQ reconnects every 100 ms, and a
    log line per attempt would drown the log.
    """

    RELOAD_EVERY_S = 5.0

    def __init__(self, context: zmq.Context, keys_dir: str, who: str) -> None:
        super().__init__(context)
        self.keys_dir = keys_dir
        self.users: dict[bytes, str] = {}
        # user id -> its public file's (inode, mtime) when read
        self._stamps: dict[str, tuple[int, int]] = {}
        self._address = ""
        self._refused: set[tuple[str, bytes]] = set()
        self._loaded = 0.0
        self._log = logmod.get("auth").bind(daemon=who)
        self._load()

    def _load(self) -> None:
        """Read the keys directory (again): a device added later gets its key with
        ``hetpipe keys``, and its worker can join without restarting every daemon."""
        users, stamps = {}, {}
        for path in sorted(Path(self.keys_dir).glob("*.key")):
            if path.stem == SERVER:
                continue
            with contextlib.suppress(OSError, ValueError):
                st = path.stat()
                stamp = (st.st_ino, st.st_mtime_ns)
                public, _ = zmq.auth.load_certificate(str(path))  # z85 text
                users[z85.decode(public)] = path.stem  # ZAP hands over binary keys
                stamps[path.stem] = stamp
        self.users = users
        self._stamps = stamps
        self._loaded = time.monotonic()

    def _current(self, user: str) -> bool:
        """Whether ``user``'s key file is still the one read (not removed nor replaced)."""
        try:
            st = (Path(self.keys_dir) / f"{user}.key").stat()
        except OSError:
            return False
        return (st.st_ino, st.st_mtime_ns) == self._stamps.get(user)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) > 3:
            self._address = msg[3].decode("utf-8", "replace")
        await super().handle_zap_message(msg)

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        user = self.users.get(client_key)
        if user is not None and not self._current(user):
            self._load()  # removed or replaced since read: what the folder holds now decides
        elif user is None and time.monotonic() - self._loaded > self.RELOAD_EVERY_S:
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
