"""``hetpipe``: the command line of the cluster.

One root group; the cluster file is loaded once into ``ctx.obj``. User errors are
``click.ClickException`` (one clear line, exit 1) or ``UsageError`` (exit 2); never a
traceback for a mistake the user can fix.

Each command asks the head (or reads a job's directory) and hands the answer to a renderer
of :mod:`hetpipe.views`; what is printed is decided there. The commands stay in one file
because they share the group's context, its request helpers and their timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import difflib
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from hetpipe import jobstore, launch, security
from hetpipe.client import HeadClient, HeadError, client_curve
from hetpipe.config import ClusterConfig, ConfigError, check_address, load_cluster
from hetpipe.job import JobError, JobSpec, load_job
from hetpipe.schedulecli import schedule
from hetpipe.security import Curve
from hetpipe.views import (
    SECURITY_OFF,
    Progress,
    brief,
    explain_lines,
    final_line,
    job_line,
    render_log_line,
    render_profile,
    render_result,
    render_running,
    render_status,
)
from hetpipe.wire import Kind

__all__ = ["main"]


@dataclass
class Ctx:
    """What every command shares: the cluster file, its path and where daemons keep files."""

    path: str
    run_dir_opt: str | None
    head_opt: str | None
    user_opt: str | None = None  # whose key talks to the head (None: the admin's client key)
    _cluster: ClusterConfig | None = None

    @property
    def cluster(self) -> ClusterConfig:
        if self._cluster is None:
            try:
                self._cluster = load_cluster(self.path)
            except ConfigError as exc:
                raise click.ClickException(str(exc)) from None
        return self._cluster

    @property
    def run_dir(self) -> Path:
        return Path(self.run_dir_opt or self.cluster.runtime.run_dir)

    @property
    def head(self) -> str:
        if self.head_opt is None:
            return self.cluster.head.address
        try:
            return check_address(self.head_opt)
        except ValueError as exc:
            raise click.ClickException(f"--head: {exc}") from None

    @property
    def curve(self) -> Curve | None:
        """This user's Curve keys for the cluster (None when its security is off)."""
        try:
            return client_curve(self.cluster, self.user_opt)
        except HeadError as exc:
            raise click.ClickException(str(exc)) from None

    def ensure_keys(self, daemons: list[launch.Daemon]) -> None:
        """Create the cluster's missing keys (``up``/``demo`` on first use) where the whole
        cluster lives on this host. A cluster of several hosts shares one key set, made once
        (``hetpipe keys``) and copied to every host: a host that lacks its part refuses in
        one line, and never makes a new set the other hosts would not know."""
        cluster = self.cluster
        if not cluster.security.curve:
            return
        hosts = {s.host for s in cluster.ps} | {d.host for d in cluster.devices}
        if all(launch.is_local(h) for h in hosts):
            make_keys(cluster)
            return
        names = security.key_names(len(cluster.ps), [d.name for d in cluster.devices])
        # a daemon's key pair is named as the daemon (security.shard_user, worker_user)
        own = {security.SERVER, *(d.name for d in daemons)}
        missing = security.missing_keys(cluster.security.keys, names, own)
        if missing:
            shown = ", ".join(missing[:4]) + (
                f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            )
            raise click.ClickException(
                f"{self.path}: this host lacks the cluster's keys {shown} in "
                f"{cluster.security.keys}; the cluster spans several hosts, so its keys are "
                f"made once (hetpipe keys, on one host) and copied to each (docs/several-hosts.md)"
            )


def _cluster_here(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.ensure_object(Ctx)
        ctx.find_object(Ctx).path = value  # type: ignore[union-attr]


def cluster_option(f: Any) -> Any:
    """``--cluster`` accepted after the command too (``hetpipe plan --cluster FILE``)."""
    return click.option(
        "--cluster",
        default=None,
        expose_value=False,
        is_eager=False,
        type=click.Path(dir_okay=False),
        callback=_cluster_here,
        help="Cluster description (overrides the group option).",
    )(f)


REACH_S = 10.0  # how long a request that may work for minutes waits for the head to answer


def _ask(obj: Ctx, kind: Kind, fields: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One request to the head; its ``info``. A request allowed longer than
    :data:`REACH_S` (planning, profiling) first asks the head's status within that, so that
    a cluster that is not up is said in seconds, not after the request's whole timeout."""

    async def go() -> dict[str, Any]:
        async with HeadClient(obj.head, timeout=timeout, curve=obj.curve) as client:
            if timeout > REACH_S:
                await client.call(Kind.CLUSTER_STATUS, timeout=REACH_S)
            return await client.call(kind, fields)

    return _run(go())


def _load_job_or_fail(obj: Ctx, job_file: str) -> JobSpec:
    """The job file, checked on its own and against the cluster file (its code policy first)
    before anything is sent (the head and the workers check again: this only fails sooner).

    The job goes on carrying the hash of each user module's source as checked here (the job
    key ``code``): the head and every worker refuse it where their copy differs
    (:mod:`hetpipe.usercode`), and never train a stale one. Where the cluster ships code
    (``[security] ship_code``) it carries the sources too, and the hosts run them.

    The check builds the model and loads the data, so it imports torch (over a second):
    imported here, not by every command."""
    from hetpipe.jobcheck import check_job
    from hetpipe.usercode import digest, ship_sources

    try:
        spec = load_job(job_file)
        facts = check_job(spec, obj.cluster, job_file)
    except JobError as exc:
        raise click.ClickException(str(exc)) from None
    spec = dataclasses.replace(spec, code={**spec.code, **facts.code}) if facts.code else spec
    if obj.cluster.security.ship_code:  # the hosts run these very bytes (hetpipe.usercode)
        sources = ship_sources(spec)
        code = {m: digest(text.encode()) for m, text in sources.items()}
        spec = dataclasses.replace(spec, code={**spec.code, **code}, sources=sources)
    return spec


def _run(coro: Any) -> Any:
    try:
        return asyncio.run(coro)
    except HeadError as exc:
        raise click.ClickException(str(exc)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--cluster",
    "cluster_path",
    default="cluster.toml",
    show_default=True,
    envvar="HETPIPE_CLUSTER",
    type=click.Path(dir_okay=False),
    help="Cluster description.",
)
@click.option(
    "--run-dir",
    default=None,
    envvar="HETPIPE_RUN_DIR",
    help="Where daemons keep pids, logs and job outputs (default: the file's).",
)
@click.option(
    "--head",
    default=None,
    envvar="HETPIPE_HEAD",
    help="Head address tcp://host:port (default: shard 0 of the cluster file).",
)
@click.option(
    "--user",
    default=None,
    envvar="HETPIPE_USER",
    help="Talk to the head with this user's own key (default: the cluster's client key, "
    "the admin's).",
)
@click.version_option(package_name="hetpipe")
@click.pass_context
def main(
    ctx: click.Context, cluster_path: str, run_dir: str | None, head: str | None, user: str | None
) -> None:
    """Train PyTorch models on mixed GPUs: pipelined virtual workers under WSP."""
    ctx.obj = Ctx(cluster_path, run_dir, head, user)


# -- up / down ------------------------------------------------------------------------------


@main.command()
@cluster_option
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for readiness.")
@click.pass_obj
def up(obj: Ctx, timeout: float) -> None:
    """Start every daemon of the cluster file that lives on this host."""
    cluster = obj.cluster
    daemons = launch.local_daemons(cluster, obj.path, run_dir=obj.run_dir)
    if not daemons:
        raise click.ClickException(f"{obj.path}: no shard or device lives on this host")
    obj.ensure_keys(daemons)
    try:
        launch.start(daemons, obj.run_dir, timeout=timeout)
    except launch.LaunchError as exc:
        raise click.ClickException(str(exc)) from None
    expected = {d.name for d in cluster.devices if f"worker-{d.name}" in {x.name for x in daemons}}
    info = _run(_wait_registered(obj.head, expected, timeout, obj.curve))
    click.echo(
        f"up: {len(daemons)} daemons ({', '.join(d.name for d in daemons)}); "
        f"logs in {obj.run_dir / 'logs'}"
    )
    for entry in info.get("recovered", []):  # jobs the head was running when it stopped
        click.echo(f"up: {jobstore.recovered_line(entry)}")
    if not cluster.security.curve:
        click.echo(SECURITY_OFF, err=True)


async def _wait_registered(
    head: str, devices: set[str], timeout: float, curve: Curve | None = None
) -> dict[str, Any]:
    async with HeadClient(head, curve=curve) as client:
        deadline = time.monotonic() + timeout
        while True:
            info = await client.cluster()
            live = {w["device"] for w in info["workers"] if w["state"] not in ("down", "lost")}
            if devices <= live:
                return info
            if time.monotonic() > deadline:
                raise HeadError(
                    f"workers not registered with the head within {timeout:g} s: "
                    f"{', '.join(sorted(devices - live))}"
                )
            await asyncio.sleep(0.2)


@main.command()
@cluster_option
@click.pass_obj
def down(obj: Ctx) -> None:
    """Stop the daemons `hetpipe up` started."""
    stopped, killed = launch.stop(obj.run_dir)
    if not stopped:
        click.echo(f"down: nothing running in {obj.run_dir}")
        return
    extra = f" (killed after timeout: {', '.join(killed)})" if killed else ""
    click.echo(f"down: stopped {len(stopped)} daemons{extra}")


# -- status ---------------------------------------------------------------------------------


@main.command()
@cluster_option
@click.argument("job", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
@click.option("--watch", is_flag=True, help="Refresh every second until Ctrl-C.")
@click.pass_obj
def status(obj: Ctx, job: str | None, as_json: bool, watch: bool) -> None:
    """Show each worker's device, type, state, job and stage, and the jobs; or one JOB
    (its id, or the name it was submitted as when one job has it)."""
    if job is not None:
        info, source = job_status(obj, job)
        if as_json:
            click.echo(json.dumps({**info, "source": source}))
            return
        click.echo(render_result(info) if info["state"] == "done" else job_line(info))
        click.echo(f"(from {source})")
        return

    async def once(client: HeadClient) -> None:
        info = await client.cluster()
        if as_json:
            click.echo(json.dumps(info))
        else:
            if watch:
                click.clear()
            click.echo(render_status(info))
            running = render_running(info)
            if running:
                click.echo("\n" + running)

    async def go() -> None:
        async with HeadClient(obj.head, curve=obj.curve) as client:
            await once(client)
            while watch:
                await asyncio.sleep(1.0)
                await once(client)

    with contextlib.suppress(KeyboardInterrupt):
        _run(go())


# -- jobs: list, cancel, and finished jobs from their directories ---------------------------

QUICK_S = 5.0  # how long a command that can also read the disk waits for the head


_NUMBERED = re.compile(r"-(\d+)$")


def match_job(query: str, ids: Iterable[str]) -> tuple[str | None, list[str]]:
    """The job ``query`` means among the job ids ``ids``, and the candidates otherwise.

    A job's id is its name and a number (``NAME-<n>``), so a user who submitted ``NAME``
    says ``NAME``: an exact id wins, else the one job named ``query``. Returns ``(id, [])``
    when that is one job; ``(None, candidates)`` otherwise, the candidates being every job
    named ``query`` when there are several, else the ids closest in spelling (at most three,
    none when nothing is close), oldest first.
    """
    known = sorted(set(ids), key=lambda i: (int(m[1]) if (m := _NUMBERED.search(i)) else 0, i))
    if query in known:
        return query, []
    named = [i for i in known if _named(query, i)]
    if len(named) == 1:
        return named[0], []
    if named:
        return None, named
    close = set(difflib.get_close_matches(query, known, n=3, cutoff=0.6))
    return None, [i for i in known if i in close]


def no_job(query: str, candidates: list[str], what: str = "job", where: str = "") -> str:
    """``no job 'QUERY'`` (or ``no WHAT 'QUERY' WHERE``), naming the candidates
    :func:`match_job` found, on one line."""
    text = f"no {what} {query!r}{where}"
    if not candidates:
        return text
    listed = ", ".join(candidates)
    if all(_named(query, c) for c in candidates):
        return f"{text}: {len(candidates)} jobs are named {query!r} ({listed}); give one id"
    return f"{text} (closest: {listed})"


def _named(name: str, job_id: str) -> bool:
    """Whether ``job_id`` is the id of a job submitted as ``name`` (``NAME-<n>``)."""
    return job_id.startswith(f"{name}-") and job_id[len(name) + 1 :].isdigit()


def _job_ids(obj: Ctx, ask_head: bool) -> list[str]:
    """Every job id this CLI can see: finished jobs on disk and, with ``ask_head``, the
    head's (queued, running and the recent finished ones)."""
    ids = [info["id"] for info in jobstore.list_jobs(obj.run_dir)]
    if ask_head:
        with contextlib.suppress(click.ClickException):
            jobs = _ask(obj, Kind.CLUSTER_STATUS, {}, timeout=QUICK_S).get("jobs", [])
            ids += [j["id"] for j in jobs if isinstance(j.get("id"), str)]
    return ids


def _unreachable(exc: click.ClickException) -> bool:
    return "did not answer" in exc.message or "cannot connect" in exc.message


T = TypeVar("T")


def _find_job(
    obj: Ctx, job: str, fetch: Callable[[str, bool], T | None], what: str = "job"
) -> tuple[str, T]:
    """``fetch(id, ask_head)`` for ``job``, else for the one job it names (:func:`match_job`).

    ``fetch`` returns None when neither the head nor this host's run directory has the job,
    and raises any other problem; the head's own problems (unreachable) come back as a
    ClickException, after which only the disk is read. When nothing is found, a one-line
    error names the candidates; ``what`` says what this host's directory lacks when the
    head could not be asked (``job``, ``trace of job``).
    """
    head_problem = ""
    try:
        got = fetch(job, True)
    except click.ClickException as exc:
        if not _unreachable(exc):
            raise
        head_problem = exc.message
        got = fetch(job, False)
    if got is not None:
        return job, got
    found, candidates = match_job(job, _job_ids(obj, ask_head=not head_problem))
    if found is not None and found != job:
        got = fetch(found, not head_problem)
        if got is not None:
            return found, got
    if not head_problem:
        raise click.ClickException(no_job(job, candidates))
    where = f" in {obj.run_dir / 'jobs'}"
    raise click.ClickException(f"{no_job(job, candidates, what, where)}, and {head_problem}")


def job_status(obj: Ctx, job: str) -> tuple[dict[str, Any], str]:
    """A job's status and where it came from: the head, or the job's directory.

    A finished job's directory answers when the head is down, restarted or has forgotten
    the job; the head answers for queued and running jobs. ``job`` may also be the name the
    job was submitted as, when one job has it (:func:`match_job`).
    """

    def fetch(job_id: str, ask_head: bool) -> tuple[dict[str, Any], str] | None:
        if ask_head:
            try:
                info = _ask(obj, Kind.JOB_STATUS, {"job": job_id}, timeout=QUICK_S)
            except click.ClickException as exc:
                if "no job " not in exc.message:
                    raise
            else:
                source = info.pop("source", "head")
                if source == "disk":  # the head had forgotten it and read its run directory
                    return info, f"jobs/{job_id}/{jobstore.RESULT} via the head at {obj.head}"
                return info, f"the head at {obj.head}"
        info = jobstore.read_result(obj.run_dir, job_id)
        if info is None:
            return None
        d = jobstore.job_dir(obj.run_dir, job_id)
        return info, str(d / jobstore.RESULT) if d else str(obj.run_dir)

    return _find_job(obj, job, fetch)[1]


@main.command()
@cluster_option
@click.argument("job")
@click.pass_obj
def cancel(obj: Ctx, job: str) -> None:
    """Cancel a queued or running job (its stages stop, its workers become idle)."""
    info = _ask(obj, Kind.CANCEL, {"job": job}, timeout=QUICK_S * 2)
    state = info.get("state")
    click.echo(
        f"cancel: {job} cancelled"
        if state == "cancelled"
        else f"cancel: {job} is stopping (was {state})"
    )


@main.command()
@cluster_option
@click.argument("job")
@click.option("--wait", is_flag=True, help="Return once the checkpoint is written.")
@click.option(
    "--timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds --wait waits for the checkpoint.",
)
@click.pass_obj
def checkpoint(obj: Ctx, job: str, wait: bool, timeout: float) -> None:
    """Checkpoint a running job now: at the next wave boundary all its stages can reach
    (a job without train.checkpoint_every too). Prints the cut's wave; `hetpipe resume`
    continues from it."""

    async def go() -> dict[str, Any]:
        async with HeadClient(obj.head, timeout=QUICK_S, curve=obj.curve) as client:
            return await client.checkpoint(job, wait=wait, timeout=timeout)

    info = _run(go())
    if wait:
        click.echo(f"checkpoint: {job} at wave {info['wave']}: {info.get('path')}")
    else:
        click.echo(f"checkpoint: {job} at wave {info['wave']} (asked; written when reached)")


@main.command()
@cluster_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
@click.pass_obj
def jobs(obj: Ctx, as_json: bool) -> None:
    """List the jobs: the head's (queued, running, recent) and finished ones on disk."""
    rows: dict[str, dict[str, Any]] = {}
    note = ""
    for info in jobstore.list_jobs(obj.run_dir):
        rows[info["id"]] = {**brief(info), "source": "disk"}
    try:
        for info in _ask(obj, Kind.CLUSTER_STATUS, {}, timeout=QUICK_S).get("jobs", []):
            rows[info["id"]] = {**brief(info), "source": "head"}
    except click.ClickException as exc:
        note = f"(head not reachable: {exc.message}; finished jobs from {obj.run_dir / 'jobs'})"
    if note:
        click.echo(note, err=True)
    if as_json:
        click.echo(json.dumps(list(rows.values())))
        return
    if not rows:
        click.echo(f"no jobs (head and {obj.run_dir / 'jobs'})")
    for info in rows.values():
        click.echo(f"{job_line(info)}  [{info['source']}]")


# -- submit ---------------------------------------------------------------------------------


@main.command()
@cluster_option
@click.argument("job_file", type=click.Path(dir_okay=False), required=False)
@click.option("--wait", is_flag=True, help="Follow the job to its end with a progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print one final JSON line (implies --wait).")
@click.option("--timeout", default=None, type=float, help="Give up waiting after this long.")
@click.option(
    "--resume",
    "resume",
    default=None,
    metavar="JOB",
    help="Continue job JOB from its last complete checkpoint (JOB_FILE optional).",
)
@click.pass_obj
def submit(
    obj: Ctx,
    job_file: str | None,
    wait: bool,
    as_json: bool,
    timeout: float | None,
    resume: str | None,
) -> None:
    """Send a job to the head; --wait follows it."""
    if job_file is None and resume is None:
        raise click.UsageError("give a JOB_FILE, or --resume JOB")
    job = _load_job_or_fail(obj, job_file).to_dict() if job_file is not None else None
    info = _run(
        submit_and_follow(
            obj.head,
            job,
            wait=wait or as_json,
            as_json=as_json,
            timeout=timeout,
            curve=obj.curve,
            resume=resume,
        )
    )
    if info is not None and info["state"] != "done":
        raise click.ClickException(f"job {info['id']} {info['state']}: {info.get('error')}")


async def submit_and_follow(
    head: str,
    job: dict[str, Any] | None,
    *,
    wait: bool,
    as_json: bool,
    timeout: float | None,
    curve: Curve | None = None,
    resume: str | None = None,
) -> dict[str, Any] | None:
    """Submit ``job`` (or resume one); with ``wait``, show progress and the result; return
    the final status."""
    async with HeadClient(head, curve=curve) as client:
        job_id = await client.submit(job, resume=resume)
        if not wait:
            click.echo(job_id)
            return None
        bar = Progress(enabled=not as_json)
        click.echo(f"submitted {job_id}", err=as_json)
        try:
            info = await client.follow(job_id, bar.update, timeout=timeout)
        except (KeyboardInterrupt, asyncio.CancelledError):
            await client.cancel(job_id)
            raise
        bar.close()
    if as_json:
        click.echo(json.dumps(final_line(info)))
    else:
        click.echo(render_result(info))
    return info


# -- profile / plan -------------------------------------------------------------------------


@main.command()
@cluster_option
@click.option(
    "--job",
    "job_file",
    required=True,
    type=click.Path(dir_okay=False),
    help="Job file whose model and minibatch size to profile.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
@click.pass_obj
def profile(obj: Ctx, job_file: str, as_json: bool) -> None:
    """Measure every layer on one worker of each device type (stored and reused)."""
    spec = _load_job_or_fail(obj, job_file)
    prof = _ask(obj, Kind.PROFILE, {"job": spec.to_dict()}, timeout=900)["profile"]
    if as_json:
        click.echo(json.dumps(prof))
        return
    click.echo(render_profile(prof))


@main.command()
@cluster_option
@click.option(
    "--job",
    "job_file",
    required=True,
    type=click.Path(dir_okay=False),
    help="Job file to plan (its [[vw]] split, if any, is evaluated instead).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option(
    "--explain", is_flag=True, help="Also list every candidate formation and why one won."
)
@click.pass_obj
def plan(obj: Ctx, job_file: str, as_json: bool, explain: bool) -> None:
    """Show the plan the head would run: VWs, stages, predicted times, memory, Nm."""
    spec = _load_job_or_fail(obj, job_file)
    info = _ask(obj, Kind.PLAN, {"job": spec.to_dict()}, timeout=900)
    click.echo(json.dumps(info["plan"]) if as_json else info["table"])
    if explain and not as_json:
        click.echo("\n".join(explain_lines(info["plan"].get("details", {}))))


@main.command()
@cluster_option
@click.argument("job")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["safetensors"]),
    default="safetensors",
    show_default=True,
    help="The file format to write.",
)
@click.option(
    "-o",
    "--output",
    default=None,
    type=click.Path(dir_okay=False),
    help="The file to write (default: model.safetensors beside the job's model.pt).",
)
@click.pass_obj
def export(obj: Ctx, job: str, fmt: str, output: str | None) -> None:
    """Write a finished job's trained weights (its model.pt, keyed as the module the model's
    builder returns) in another format: the same names and the same values.

    Reads the job's directory on this host (the head's run directory). JOB may be the name
    the job was submitted as, when one job has it. Needs the ``safetensors`` package.
    """

    def fetch(job_id: str, _ask_head: bool) -> Path | None:
        d = jobstore.job_dir(obj.run_dir, job_id)
        return d / "model.pt" if d is not None and (d / "model.pt").exists() else None

    job, source = _find_job(obj, job, fetch, "model.pt of job")
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise click.ClickException(
            "--format safetensors needs the safetensors package (pip install safetensors)"
        ) from None
    import torch

    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise click.ClickException(f"{source}: cannot read: {type(exc).__name__}: {exc}") from None
    target = Path(output) if output else source.with_name(f"model.{fmt}")
    save_file(unshared(state), str(target))
    click.echo(f"export: {len(state)} tensors of job {job} ({source}) -> {target}")


def unshared(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each tensor contiguous and owning its storage: safetensors stores no
    two names over one storage, so a tie is written as two equal tensors (loading both into
    the tied module gives it the one value)."""
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr()
        whole = t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()
        out[name] = t if whole and ptr not in seen else t.contiguous().clone()
        seen.add(ptr)
    return out


@main.command()
@cluster_option
@click.argument("job")
@click.option(
    "-o",
    "--output",
    default=None,
    type=click.Path(dir_okay=False),
    help="Chrome trace JSON to write (opens in Perfetto / chrome://tracing).",
)
@click.option(
    "--png", type=click.Path(dir_okay=False), help="Gantt chart to draw (with or without -o)."
)
@click.option(
    "--minibatches",
    "mb_range",
    default=None,
    metavar="A:B",
    help="Gantt window: minibatches A to B-1 (default: three steady-state waves).",
)
@click.option(
    "--seconds",
    "s_range",
    default=None,
    metavar="A:B",
    help="Gantt window: seconds A to B since the job's first event.",
)
@click.pass_obj
def trace(
    obj: Ctx,
    job: str,
    output: str | None,
    png: str | None,
    mb_range: str | None,
    s_range: str | None,
) -> None:
    """Write a finished job's timeline (-o, one track per device) or its Gantt chart (--png),
    or both.

    Read from the job's directory when it is on this host (no head needed), else asked of
    the head. JOB may be the name the job was submitted as, when one job has it.
    """
    if output is None and png is None:
        raise click.UsageError(
            "give -o FILE (the trace JSON), --png FILE (its Gantt chart), or both"
        )
    if mb_range and s_range:
        raise click.UsageError("give --minibatches or --seconds, not both")
    minibatches = _range(mb_range, "--minibatches", int)
    seconds = _range(s_range, "--seconds", float)
    if png is None and (minibatches or seconds):
        raise click.UsageError("--minibatches and --seconds choose the window of --png")

    def fetch(job_id: str, ask_head: bool) -> tuple[dict[str, Any], str] | None:
        d = jobstore.job_dir(obj.run_dir, job_id)
        local = d / jobstore.TRACE if d is not None else None
        if local is not None and local.exists():
            try:
                return json.loads(local.read_text()), str(local)
            except (OSError, ValueError) as exc:
                raise click.ClickException(f"{local}: cannot read the trace: {exc}") from None
        if not ask_head:
            return None
        try:
            data = _ask(obj, Kind.TRACE, {"job": job_id}, timeout=QUICK_S * 6)
        except click.ClickException as exc:
            if "no job " in exc.message:
                return None
            raise
        return data, f"the head at {obj.head}"

    job, (data, source) = _find_job(obj, job, fetch, "trace of job")
    n = sum(1 for e in data["traceEvents"] if e.get("ph") == "X")
    if output is not None:
        Path(output).write_text(json.dumps(data))
    click.echo(
        f"trace: {n} events of job {job} (from {source})" + (f" -> {output}" if output else "")
    )
    if png:
        from hetpipe.gantt import gantt_png

        try:
            win = gantt_png(data, png, minibatches=minibatches, seconds=seconds)
        except (RuntimeError, ValueError) as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"gantt chart of {win.label} -> {png}")


def _range(text: str | None, option: str, kind: type) -> Any:
    """``"A:B"`` as a pair of ``kind`` with A < B; a UsageError naming the option otherwise."""
    if text is None:
        return None
    a, sep, b = text.partition(":")
    try:
        if not sep:
            raise ValueError
        lo, hi = kind(a), kind(b)
    except ValueError:
        raise click.BadParameter(f"expected A:B, got {text!r}", param_hint=option) from None
    if not lo < hi or lo < 0:
        raise click.BadParameter(f"expected 0 <= A < B, got {text!r}", param_hint=option)
    return lo, hi


# -- demo ---------------------------------------------------------------------------------

DEMO_JOB = Path(__file__).with_name("demo.toml")


@main.command()
@cluster_option
@click.option(
    "--job",
    "job_file",
    default=str(DEMO_JOB),
    show_default=False,
    type=click.Path(dir_okay=False),
    help="Job file (default: the demo job).",
)
@click.option("--json", "as_json", is_flag=True, help="Also print one final JSON line.")
@click.option("--timeout", default=900.0, show_default=True, help="Give up after this long.")
@click.pass_obj
def demo(obj: Ctx, job_file: str, as_json: bool, timeout: float) -> None:
    """Start the cluster, train the demo job under WSP, show the result, stop the cluster."""
    spec = _load_job_or_fail(obj, job_file)
    cluster = obj.cluster
    started = not launch.running(obj.run_dir)
    daemons = launch.local_daemons(cluster, obj.path, run_dir=obj.run_dir)
    obj.ensure_keys(daemons)
    if started:
        click.echo(
            f"demo: starting {len(daemons)} daemons of {obj.path} (logs in {obj.run_dir / 'logs'})"
        )
        try:
            launch.start(daemons, obj.run_dir, timeout=60)
        except launch.LaunchError as exc:
            raise click.ClickException(str(exc)) from None
    else:
        click.echo(f"demo: using the daemons already running in {obj.run_dir}")
    try:
        _run(_wait_registered(obj.head, {d.name for d in cluster.devices}, 60, obj.curve))
        click.echo(
            f"demo: job {spec.name}: {spec.model.name} on {spec.data.name}, "
            f"staleness D = {spec.staleness}; profiling and planning ..."
        )
        click.echo(_ask(obj, Kind.PLAN, {"job": spec.to_dict()}, timeout=900)["table"])
        info = _run(
            submit_and_follow(
                obj.head, spec.to_dict(), wait=True, as_json=False, timeout=timeout, curve=obj.curve
            )
        )
    finally:
        if started:
            stopped, _ = launch.stop(obj.run_dir)
            click.echo(f"demo: stopped {len(stopped)} daemons")
    if as_json:
        click.echo(json.dumps(final_line(info)))
    if info["state"] != "done":
        raise click.ClickException(f"job {info['id']} {info['state']}: {info.get('error')}")


# -- keys (trust: hetpipe.security) ----------------------------------------------------------


def make_keys(cluster: ClusterConfig, *, force: bool = False) -> list[str]:
    """Create the cluster's missing key pairs (all of them with ``force``)."""
    names = security.key_names(len(cluster.ps), [d.name for d in cluster.devices])
    try:
        return security.ensure_keys(cluster.security.keys, names, force=force)
    except OSError as exc:
        raise click.ClickException(f"cannot write keys in {cluster.security.keys}: {exc}") from None


@main.group(invoke_without_command=True)
@cluster_option
@click.option(
    "--force",
    is_flag=True,
    help="Replace existing keys (rotation: restart every daemon and client).",
)
@click.pass_context
def keys(ctx: click.Context, force: bool) -> None:
    """Create the cluster's CurveZMQ keys: server, client (the admin's), one per shard and
    per device; or manage the users' own keys (add-user, remove-user, list-users)."""
    if ctx.invoked_subcommand is not None:
        if force:
            raise click.UsageError("--force goes after the subcommand (keys add-user --force)")
        return
    obj: Ctx = ctx.obj
    cluster = obj.cluster
    made = make_keys(cluster, force=force)
    total = len(security.key_names(len(cluster.ps), [d.name for d in cluster.devices]))
    click.echo(
        f"keys: {len(made)} created, {total - len(made)} kept in "
        f"{cluster.security.keys} (files 0600)"
    )
    if not cluster.security.curve:
        click.echo(SECURITY_OFF, err=True)


def _keys_dir(obj: Ctx) -> Path:
    """The cluster's keys folder; a user's key means nothing where Curve is off."""
    cluster = obj.cluster
    if not cluster.security.curve:
        raise click.ClickException(
            f"{obj.path}: [security] curve = false: the head cannot tell users apart "
            "(turn Curve on to give users their own keys)"
        )
    return Path(cluster.security.keys)


@keys.command("add-user")
@cluster_option
@click.argument("name")
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Write the user's files (their secret key, the server's public key) into this "
    "folder only, for handing to them; the keys folder keeps their public key alone.",
)
@click.option("--force", is_flag=True, help="Replace the user's key (the old one is refused).")
@click.pass_obj
def add_user(obj: Ctx, name: str, out: str | None, force: bool) -> None:
    """Give user NAME a client key of their own: they may act on their own jobs only."""
    root = _keys_dir(obj)
    try:
        files = security.add_user(root, name, out=out, force=force)
    except (security.KeysError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    shown = " and ".join(str(f) for f in files)
    click.echo(
        f"keys: user {name} added; the head accepts {root / (security.user_key(name) + '.key')}; "
        f"the user keeps {shown} (files 0600) and runs `hetpipe --user {name} ...`"
    )


@keys.command("remove-user")
@cluster_option
@click.argument("name")
@click.pass_obj
def remove_user(obj: Ctx, name: str) -> None:
    """Remove user NAME's key: the head refuses it from its next connection on."""
    root = _keys_dir(obj)
    try:
        security.remove_user(root, name)
    except (security.KeysError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"keys: user {name} removed from {root}; the head refuses their next connection")


@keys.command("list-users")
@cluster_option
@click.pass_obj
def list_users(obj: Ctx) -> None:
    """List the users whose keys the cluster's keys folder holds (admin: the client key)."""
    for name in security.list_users(_keys_dir(obj)):
        click.echo(name)


@keys.command("bundle")
@cluster_option
@click.argument("out", type=click.Path(file_okay=False))
@click.pass_obj
def bundle(obj: Ctx, out: str) -> None:
    """Split the keys into what each host and user needs: OUT/hosts/<host>/ (the daemons
    there), OUT/admin/, OUT/users/<name>/; copy each folder to its host as [security] keys."""
    root = _keys_dir(obj)
    cluster = obj.cluster
    if Path(out).exists() and any(Path(out).iterdir()):
        raise click.ClickException(f"{out} is not empty: bundle into a new folder")
    hosts: dict[str, list[str]] = {}
    for i, shard in enumerate(cluster.ps):
        hosts.setdefault(shard.host, []).append(security.shard_user(i))
    for dev in cluster.devices:
        hosts.setdefault(dev.host, []).append(security.worker_user(dev.name))
    try:
        plan = security.bundle_keys(root, out, hosts, cluster.ps[0].host)
    except (security.KeysError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    for folder, files in plan.items():
        click.echo(f"{Path(out) / folder}: {len(files)} files")


# -- logs -----------------------------------------------------------------------------------


@main.command()
@cluster_option
@click.argument("daemon", required=False)
@click.option("-n", "lines", default=40, show_default=True, help="Lines per daemon.")
@click.pass_obj
def logs(obj: Ctx, daemon: str | None, lines: int) -> None:
    """Show the daemons' logs (JSON lines) rendered for a person."""
    logdir = obj.run_dir / "logs"
    files = sorted(logdir.glob("*.log"))
    if daemon:
        files = [f for f in files if f.stem == daemon]
        if not files:
            names = ", ".join(f.stem for f in sorted(logdir.glob("*.log"))) or "none"
            raise click.BadParameter(
                f"no log for {daemon!r} in {logdir} (have: {names})", param_hint="DAEMON"
            )
    for f in files:
        click.echo(click.style(f"== {f.stem}", bold=True))
        for line in f.read_text(errors="replace").splitlines()[-lines:]:
            click.echo(render_log_line(line))


main.add_command(schedule)

if __name__ == "__main__":
    main()
