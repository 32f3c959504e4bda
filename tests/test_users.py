"""Several users: each with a client key of their own, a job owned by who submitted it.

Keys and rules without daemons first (who may act on whose job, the key files ``hetpipe keys
add-user`` writes, a removed key refused by the handshake handler), then real daemons on
loopback with Curve on: user A's job, user B's cancel and resume refused in one line, the
admin's cancel done, the owner in ``status``, a removed user's next connection refused; and a
cluster without Curve, where nothing changes (every job ``local``, no refusal).
"""

from __future__ import annotations

import asyncio
import json
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from click.testing import CliRunner, Result
from conftest import job

from hetpipe import cli, security
from hetpipe.client import HeadClient, HeadError, client_curve
from hetpipe.config import load_cluster
from hetpipe.jobstore import read_result
from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml
from hetpipe.security import KeysError, ensure_keys, may_act, may_send, owner_of
from hetpipe.views import render_result
from hetpipe.wire import Kind

# -- rules and key files (no daemons) --------------------------------------------------------


def test_a_users_key_stands_for_the_user_and_the_client_key_for_the_admin() -> None:
    assert security.user_key("alice") == "user-alice"
    assert security.user_key("admin") == "client"
    assert owner_of("user-alice") == "alice"
    assert owner_of("client") == "admin"
    assert owner_of(None) == "local"


@pytest.mark.parametrize(
    ("user", "owner", "allowed"),
    [
        ("user-alice", "alice", True),  # the owner
        ("user-bob", "alice", False),  # another user
        ("client", "alice", True),  # the admin: every job
        ("client", None, True),
        ("user-alice", None, False),  # no owner recorded: the admin's alone
        ("user-alice", "local", False),  # a job of the cluster without Curve
        (None, "alice", True),  # without Curve nobody is told apart
    ],
)
def test_only_the_owner_and_the_admin_may_act_on_a_job(
    user: str | None, owner: str | None, allowed: bool
) -> None:
    assert may_act(user, owner) is allowed


def test_every_users_key_may_send_a_users_requests_only() -> None:
    for user in ("client", "user-alice"):
        assert may_send(Kind.SUBMIT, user, {})
        assert may_send(Kind.CANCEL, user, {})
        assert not may_send(Kind.HELLO, user, {"device": "gpu0"})
        assert not may_send(Kind.SHARD_INIT, user, {})
    assert not may_send(Kind.SUBMIT, "worker-gpu0", {})
    assert not may_send(Kind.CANCEL, "ps1", {})


@pytest.mark.parametrize("name", ["admin", "local", "", "-x", "a/b", "..", "x" * 33, "a b"])
def test_user_names_that_are_taken_or_unsafe_are_refused(tmp_path: Path, name: str) -> None:
    ensure_keys(tmp_path, ["server", "client"])
    with pytest.raises(KeysError) as err:
        security.add_user(tmp_path, name)
    assert "\n" not in str(err.value)
    assert not list(tmp_path.glob("user-*"))


def test_add_user_writes_a_private_pair_and_refuses_a_second(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    ensure_keys(keys, ["server", "client"])
    files = security.add_user(keys, "alice")
    assert files == [keys / "user-alice.key_secret", keys / "server.key"]
    assert (keys / "user-alice.key").is_file()
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in keys.iterdir())
    with pytest.raises(KeysError, match="already has a key"):
        security.add_user(keys, "alice")
    assert security.list_users(keys) == ["admin", "alice"]
    security.remove_user(keys, "alice")
    assert not list(keys.glob("user-alice*"))
    assert security.list_users(keys) == ["admin"]
    with pytest.raises(KeysError, match="no user 'alice'"):
        security.remove_user(keys, "alice")


def test_add_user_with_out_keeps_the_secret_off_the_heads_folder(tmp_path: Path) -> None:
    keys, out = tmp_path / "keys", tmp_path / "alice"
    ensure_keys(keys, ["server", "client"])
    files = security.add_user(keys, "alice", out=out)
    assert files == [out / "user-alice.key_secret", out / "server.key"]
    assert not (keys / "user-alice.key_secret").exists()
    assert (keys / "user-alice.key").read_bytes() == (out / "user-alice.key").read_bytes()
    assert (out / "server.key").read_bytes() == (keys / "server.key").read_bytes()
    assert not (out / "server.key_secret").exists()
    # the user's folder alone is a client's whole key material
    curve = security.load_curve(security.SecuritySpec(keys=str(out)), "user-alice", serve=False)
    assert curve is not None and curve.server_secret is None


def _public(keys: Path, name: str) -> bytes:
    curve = security.load_curve(security.SecuritySpec(keys=str(keys)), name, serve=False)
    assert curve is not None
    return zmq.utils.z85.decode(curve.public)


def test_a_removed_or_replaced_users_key_is_refused_at_the_next_handshake(tmp_path: Path) -> None:
    """No waiting: a known key's file is checked at each handshake."""
    keys = tmp_path / "keys"
    ensure_keys(keys, ["server", "client"])
    security.add_user(keys, "alice")
    security.add_user(keys, "bob")
    alice, bob = _public(keys, "user-alice"), _public(keys, "user-bob")

    async def go() -> list[tuple[bool, bytes]]:
        ctx = zmq.asyncio.Context()
        auth = security.ZapAuthenticator(ctx, str(keys), "test")
        try:
            seen = [
                await auth._authenticate_curve("", alice),
                await auth._authenticate_curve("", bob),
            ]
            security.remove_user(keys, "alice")
            time.sleep(0.01)  # a replaced file has a new inode and time either way
            security.add_user(keys, "bob", force=True)
            seen += [
                await auth._authenticate_curve("", alice),
                await auth._authenticate_curve("", bob),
            ]
            seen.append(await auth._authenticate_curve("", _public(keys, "user-bob")))
            return seen
        finally:
            ctx.term()

    ok, refused = (True, b"OK"), (False, b"Unknown key")
    assert asyncio.run(go()) == [ok, ok, refused, refused, ok]


def test_a_finished_jobs_result_names_its_owner() -> None:
    done = {
        "id": "a-1",
        "state": "done",
        "owner": "alice",
        "seconds": 1.0,
        "minibatches": 2,
        "samples_per_s": 64.0,
        "model_path": "m",
        "metrics_path": "x",
        "trace_path": "t",
    }
    assert "owner:   alice" in render_result(done).splitlines()


class _Replies:
    """Stands for the head's channel: keeps the errors and answers it would send."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.sent: list[dict[str, Any]] = []

    async def reply_error(self, _to: object, message: str, _rid: object = None) -> None:
        self.errors.append(message)

    async def send(self, _kind: object, fields: dict[str, Any], **_kw: object) -> None:
        self.sent.append(fields)


def test_the_head_checks_the_owner_of_a_job_it_knows_only_from_disk(tmp_path: Path) -> None:
    """Resume by the owner recorded in the job's directory; a job recorded without an owner
    (or a recovered one whose record had none) is the admin's alone."""
    from hetpipe.daemon import Owner
    from hetpipe.head import Head, JobState
    from hetpipe.job import JobSpec
    from hetpipe.wire import Message

    path = tmp_path / "c.toml"
    path.write_text(cluster_toml([DeviceDef("gpu0")], shards=1))
    for job_id, record in (("old-1", {"owner": "alice"}), ("legacy-2", {})):
        d = tmp_path / "run" / "jobs" / job_id
        d.mkdir(parents=True)
        (d / "job.json").write_text(json.dumps({"id": job_id, "state": "failed", **record}))

    async def go() -> tuple[list[str], list[dict[str, Any]]]:
        owner = Owner()
        try:
            head = Head(load_cluster(str(path)), owner, "tcp://127.0.0.1:1", str(tmp_path / "run"))
            replies = _Replies()
            head.channel = replies  # type: ignore[assignment]
            for user, job_id in (
                ("user-bob", "old-1"),  # not his
                ("user-alice", "old-1"),  # hers: on to its checkpoint (there is none)
                ("client", "old-1"),  # the admin's: likewise
                ("user-alice", "legacy-2"),  # no owner recorded
                ("client", "legacy-2"),
            ):
                fields = {"rid": 1, "job": None, "resume": job_id}
                await head._submit(b"p", Message(Kind.SUBMIT, fields, {}, user=user))
            spec = JobSpec.from_dict(job("r"), source="test")
            head.jobs["r-3"] = JobState(id="r-3", spec=spec, submitted=0.0)  # owner None
            for user in ("user-alice", "client"):
                fields = {"rid": 2, "job": "r-3"}
                await head.handle(b"p", Message(Kind.CANCEL, fields, {}, user=user))
            return replies.errors, replies.sent
        finally:
            await owner.close()

    errors, sent = asyncio.run(go())
    no_checkpoint = "no complete checkpoint of job"
    assert [e.split(";")[0] for e in errors[:5]] == [
        "resume: job old-1 belongs to alice",
        f"{no_checkpoint} 'old-1' in {tmp_path / 'run' / 'jobs' / 'old-1' / 'checkpoints'}",
        f"{no_checkpoint} 'old-1' in {tmp_path / 'run' / 'jobs' / 'old-1' / 'checkpoints'}",
        "resume: job legacy-2 has no recorded owner (the admin's alone)",
        f"{no_checkpoint} 'legacy-2' in {tmp_path / 'run' / 'jobs' / 'legacy-2' / 'checkpoints'}",
    ]
    assert errors[5] == (
        "cancel: job r-3 has no recorded owner (the admin's alone); "
        "user alice may cancel only their own jobs"
    )
    assert len(errors) == 6 and sent == [{"rid": 2, "info": {"state": "cancelled"}}]


def keys_cli(path: Path, *args: str) -> Result:
    env = {"HETPIPE_CLUSTER": None, "HETPIPE_RUN_DIR": None, "HETPIPE_HEAD": None}
    env["HETPIPE_USER"] = None
    return CliRunner().invoke(cli.main, ["--cluster", str(path), "keys", *args], env=env)


def one_line_error(result: Result) -> str:
    assert result.exit_code == 1, result.output
    lines = [x for x in result.output.splitlines() if x]
    assert len(lines) == 1, lines
    assert lines[0].startswith("Error: "), lines[0]
    return lines[0]


def test_keys_commands_add_list_and_remove_users(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(cluster_toml([DeviceDef("gpu0")], shards=1))
    assert keys_cli(path).exit_code == 0
    added = keys_cli(path, "add-user", "alice")
    assert added.exit_code == 0, added.output
    assert "user alice added" in added.output and "--user alice" in added.output
    assert keys_cli(path, "list-users").output.split() == ["admin", "alice"]
    assert "already has a key" in one_line_error(keys_cli(path, "add-user", "alice"))
    assert "is not allowed" in one_line_error(keys_cli(path, "add-user", "a/b"))
    assert "'admin' is taken" in one_line_error(keys_cli(path, "add-user", "admin"))
    removed = keys_cli(path, "remove-user", "alice")
    assert removed.exit_code == 0 and "refuses their next connection" in removed.output
    assert "no user 'alice'" in one_line_error(keys_cli(path, "remove-user", "alice"))
    # `hetpipe keys` itself is unchanged by users: they are neither made nor counted
    assert "0 created, 4 kept" in keys_cli(path).output


def test_keys_for_users_need_curve(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(cluster_toml([DeviceDef("gpu0")], shards=1, curve=False))
    assert "curve = false" in one_line_error(keys_cli(path, "add-user", "alice"))


def test_a_user_without_a_key_is_told_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(cluster_toml([DeviceDef("gpu0")], shards=1))
    keys_cli(path)
    result = CliRunner().invoke(
        cli.main,
        ["--cluster", str(path), "--head", "tcp://127.0.0.1:9", "--user", "carol", "status"],
        env={"HETPIPE_USER": None},
    )
    line = one_line_error(result)
    assert "no key of user 'carol'" in line and "keys add-user carol" in line


def test_bundle_gives_each_host_and_user_only_the_files_it_needs(tmp_path: Path) -> None:
    keys, out = tmp_path / "keys", tmp_path / "out"
    ensure_keys(keys, security.key_names(2, ["gpu0", "gpu1"]))
    security.add_user(keys, "alice")
    security.add_user(keys, "bob", out=tmp_path / "bob")  # handed out: not bundled again
    hosts = {"h0": ["ps0", "worker-gpu0"], "h1": ["ps1", "worker-gpu1"]}
    plan = security.bundle_keys(keys, out, hosts, "h0")
    assert set(plan) == {"hosts/h0", "hosts/h1", "admin", "users/alice"}

    def names(folder: str) -> set[str]:
        return {p.name for p in (out / folder).iterdir()}

    publics = {f"{n}.key" for n in ("server", "client", "ps0", "ps1", "worker-gpu0", "worker-gpu1")}
    assert names("hosts/h0") == publics | {
        "server.key_secret",
        "ps0.key_secret",
        "worker-gpu0.key_secret",
        "user-alice.key",
        "user-bob.key",
    }
    assert names("hosts/h1") == publics | {
        "server.key_secret",
        "ps1.key_secret",
        "worker-gpu1.key_secret",
    }
    assert names("admin") == {"client.key_secret", "server.key"}
    assert names("users/alice") == {"user-alice.key_secret", "user-alice.key", "server.key"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in out.rglob("*") if p.is_file())
    (keys / "ps1.key_secret").unlink()
    with pytest.raises(KeysError, match=r"lacks ps1\.key_secret") as err:
        security.bundle_keys(keys, tmp_path / "again", hosts, "h0")
    assert "\n" not in str(err.value) and not (tmp_path / "again").exists()


def test_keys_bundle_command(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(cluster_toml([DeviceDef("gpu0")], shards=1))
    keys_cli(path)
    result = keys_cli(path, "bundle", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert f"{tmp_path / 'out' / 'hosts' / '127.0.0.1'}: " in result.output
    assert "not empty" in one_line_error(keys_cli(path, "bundle", str(tmp_path / "out")))


# -- real daemons, Curve on ------------------------------------------------------------------

LONG = job("long", model="mlp", epochs=5000)  # runs far longer than these tests


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One device, one shard, Curve on; users alice (her files handed out with ``--out``,
    her own cluster file naming that folder) and bob (in the cluster's keys folder)."""
    root = tmp_path_factory.mktemp("users")
    text = cluster_toml([DeviceDef("gpu0")], shards=1)
    path = root / "cluster.toml"
    path.write_text(text)
    (root / "alice").mkdir()
    alice_path = root / "alice" / "cluster.toml"
    alice_path.write_text(text)  # its keys: alice/.hetpipe/keys, what she was handed
    keys = root / ".hetpipe" / "keys"
    ensure_keys(keys, security.key_names(1, ["gpu0"]))
    assert (
        keys_cli(path, "add-user", "alice", "--out", str(root / "alice/.hetpipe/keys")).exit_code
        == 0
    )
    assert keys_cli(path, "add-user", "bob").exit_code == 0
    with LocalCluster(path, root / "run", timeout=60) as c:
        yield {"c": c, "alice": alice_path, "bob": path, "jobs": {}}


def as_user(cluster_file: Path, user: str | None, head: str, timeout: float = 10.0) -> HeadClient:
    return HeadClient(
        head, timeout=timeout, curve=client_curve(load_cluster(str(cluster_file)), user)
    )


def hetpipe(s: dict[str, Any], user: str | None, *args: str) -> Result:
    """The CLI as ``user`` (None: the admin's client key), from that user's cluster file."""
    c: LocalCluster = s["c"]
    path = s["alice"] if user == "alice" else s["bob"]
    head = ["--run-dir", str(c.run_dir), "--head", c.head]
    who = ["--user", user] if user else []
    env = {"HETPIPE_CLUSTER": None, "HETPIPE_RUN_DIR": None, "HETPIPE_HEAD": None}
    env["HETPIPE_USER"] = None
    return CliRunner().invoke(cli.main, ["--cluster", str(path), *head, *who, *args], env=env)


def submit_as(s: dict[str, Any], user: str, spec: dict[str, Any]) -> str:
    async def go() -> str:
        async with as_user(s["alice"] if user == "alice" else s["bob"], user, s["c"].head) as h:
            return await h.submit(spec)

    return asyncio.run(go())


@pytest.mark.timeout(240)
def test_a_job_is_owned_by_who_submitted_it(shared: dict[str, Any]) -> None:
    job_id = submit_as(shared, "alice", LONG)
    shared["jobs"]["alice"] = job_id
    info = shared["c"].run(_job(shared["c"], job_id))
    assert info["owner"] == "alice"
    status = hetpipe(shared, "bob", "status")  # every user reads every job
    assert status.exit_code == 0, status.output
    line = next(x for x in status.output.splitlines() if job_id in x)
    assert "owner alice" in line
    one = hetpipe(shared, "alice", "status", job_id)
    assert one.exit_code == 0 and "owner alice" in one.output
    listed = hetpipe(shared, None, "jobs")
    assert any(job_id in x and "owner alice" in x for x in listed.output.splitlines())


async def _job(c: LocalCluster, job_id: str) -> dict[str, Any]:
    async with c.client() as h:
        return await h.job(job_id)


@pytest.mark.timeout(240)
def test_another_user_may_neither_cancel_nor_resume_the_job(shared: dict[str, Any]) -> None:
    job_id = shared["jobs"].get("alice") or submit_as(shared, "alice", LONG)
    shared["jobs"]["alice"] = job_id
    line = one_line_error(hetpipe(shared, "bob", "cancel", job_id))
    assert line.endswith(
        f": cancel: job {job_id} belongs to alice; user bob may cancel only their own jobs"
    ), line

    async def resume() -> str:
        async with as_user(shared["bob"], "bob", shared["c"].head) as h:
            with pytest.raises(HeadError) as err:
                await h.submit(None, resume=job_id)
            return str(err.value)

    refused = asyncio.run(resume())
    assert "\n" not in refused
    assert refused.endswith(
        f": resume: job {job_id} belongs to alice; user bob may resume only their own jobs"
    ), refused
    assert shared["c"].run(_job(shared["c"], job_id))["state"] in ("queued", "planning", "running")


@pytest.mark.timeout(240)
def test_the_admin_cancels_any_job_and_the_owner_stays_recorded(shared: dict[str, Any]) -> None:
    c: LocalCluster = shared["c"]
    job_id = shared["jobs"].get("alice") or submit_as(shared, "alice", LONG)
    result = hetpipe(shared, None, "cancel", job_id)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"cancel: {job_id} ")

    async def ended() -> dict[str, Any]:
        async with c.client() as h:
            return await h.follow(job_id, timeout=120, every_s=0.2)

    assert c.run(ended())["state"] == "cancelled"
    stored = read_result(c.run_dir, job_id)
    assert stored is not None and stored["owner"] == "alice"
    # the owner cancels her own job too
    own = submit_as(shared, "alice", LONG)
    assert hetpipe(shared, "alice", "cancel", own).exit_code == 0


@pytest.mark.timeout(240)
def test_a_removed_users_key_is_refused_from_the_next_connection(shared: dict[str, Any]) -> None:
    c: LocalCluster = shared["c"]
    # bob's files go with his key: he tries again with a copy he kept
    bob = client_curve(load_cluster(str(shared["bob"])), "bob")

    async def status(timeout: float) -> dict[str, Any]:
        async with HeadClient(c.head, timeout=timeout, curve=bob) as h:
            return await h.cluster()

    assert "workers" in asyncio.run(status(10.0))
    removed = keys_cli(Path(shared["bob"]), "remove-user", "bob")
    assert removed.exit_code == 0, removed.output
    with pytest.raises(HeadError, match="did not answer"):
        asyncio.run(status(2.0))
    log = c.run_dir / "logs" / "ps0.log"
    assert "peer refused" in log.read_text()
    assert "workers" in asyncio.run(_cluster(c))  # the admin still gets through


async def _cluster(c: LocalCluster) -> dict[str, Any]:
    async with c.client() as h:
        return await h.cluster()


# -- a cluster without Curve: as before ------------------------------------------------------


@pytest.mark.timeout(240)
def test_without_curve_jobs_are_local_and_anyone_cancels(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml([DeviceDef("gpu0")], shards=1, curve=False))
    with LocalCluster(path, tmp_path / "run", timeout=60) as c:

        async def go() -> str:
            async with c.client() as h:
                return await h.submit(LONG)

        job_id = c.run(go())
        assert c.run(_job(c, job_id))["owner"] == "local"
        env = {"HETPIPE_CLUSTER": None, "HETPIPE_RUN_DIR": None, "HETPIPE_HEAD": None}
        args = ["--cluster", str(path), "--run-dir", str(c.run_dir), "--head", c.head]
        result = CliRunner().invoke(
            cli.main, [*args, "--user", "bob", "cancel", job_id], env={**env, "HETPIPE_USER": None}
        )
        assert result.exit_code == 0, result.output
