"""``hetpipe-ps``: one parameter-server shard; shard 0 is also the head.

A shard holds the global weights of the layers placed on it, applies each pushed update of
a (job, vw, stage, wave) exactly once, and parks pulls until the job's global clock meets
their need (:mod:`hetpipe.core.wsp`). It never busy-waits: a push releases the pulls it unblocks.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import Collection
from typing import Any

import click
import torch
import zmq

from hetpipe import log as logmod
from hetpipe.config import ClusterConfig, ConfigError, load_cluster
from hetpipe.core.wsp import WspError
from hetpipe.daemon import Owner, start_daemon, wait_for_signal, write_ready
from hetpipe.ratelog import Throttle, excerpt
from hetpipe.security import ANYONE, Daemon, KeysError, Role, kinds_to, may_send, shard_user
from hetpipe.shard import ShardError, ShardStore
from hetpipe.transport import Channel, bound_address, make_socket, tcp
from hetpipe.wire import Kind, Message

__all__ = ["ShardServer", "main", "serve"]

Parked = tuple[bytes | None, int, int, int]  # (peer, rid, vw, stage)


ACK_RETRY_S = 60.0  # how long a push's answer waits for room in a slow reader's queue
ACK_RETRY_EVERY_S = 0.01


class ShardServer:
    """Serves push, pull and the head's shard requests from one ROUTER channel.

    Authority (:data:`hetpipe.security.AUTHORITY`): ``shard_init``/``fetch``/``cut``/``drop``
    come only from the head (key ``ps0``); a push or reduce for (job, vw, stage) only from the
    worker the head assigned to that stage (the ``owners`` of ``shard_init``), a pull also from
    the stage's replicas. Without Curve (``msg.user`` None) every peer is trusted.
    """

    KINDS = kinds_to(Daemon.SHARD)

    def __init__(self, index: int) -> None:
        self.index = index
        self.store: ShardStore[Parked] = ShardStore()
        self.owners: dict[str, dict[str, str]] = {}  # job -> "vw/stage" -> worker user id
        # job -> the head's requests for cuts not complete yet: (peer, rid, wave)
        self.cut_waits: dict[str, list[tuple[bytes | None, int, int]]] = {}
        self.channel: Channel | None = None
        self.log = logmod.get("shard").bind(shard=index)
        self._refused = Throttle(self.log)  # requests outside a peer's role, once a while
        self._late: set[asyncio.Task[None]] = set()  # acks waiting for room (:meth:`_ack`)

    def _allowed(self, msg: Message) -> bool:
        """Whether the sender may make this request (:func:`hetpipe.security.may_send`)."""
        return may_send(msg.kind, msg.user, msg.fields, lambda role: self._holders(msg, role))

    def _holders(self, msg: Message, role: Role) -> Collection[str]:
        """Who holds a stage role for ``msg`` here: the ``owners`` of the job's ``shard_init``
        ("vw/stage" the stage's leader, "vw/stage/r" its replica r)."""
        owners = self.owners.get(msg["job"])
        if owners is None:
            return ANYONE  # an unknown job: the store refuses it with its own error
        stage = f"{msg['vw']}/{msg['stage']}"
        leader = {owners[stage]} if stage in owners else set()
        if role == Role.STAGE_LEADER:
            return leader
        if role == Role.STAGE_GROUP:
            return leader | {u for k, u in owners.items() if k.startswith(stage + "/")}
        return ()

    async def handle(self, peer: bytes | None, msg: Message) -> None:
        assert self.channel is not None
        rid = msg.get("rid")
        if not self._allowed(msg):
            what = f"{msg.kind} for {excerpt(msg.get('job'), 80)}"
            self._refused.warning(
                "request refused: not this peer's role",
                str(msg.user),
                f"{msg.user} may not send {what}",
                kind=str(msg.kind),
            )
            await self.channel.reply_error(
                peer, f"shard {self.index}: {msg.user} may not send {what}", rid
            )
            return
        try:
            if msg.kind == Kind.PUSH:
                await self._push(peer, msg)
            elif msg.kind == Kind.PULL:
                await self._pull(peer, msg)
            elif msg.kind == Kind.REDUCE:
                await self._reduce(peer, msg)
            elif msg.kind == Kind.SHARD_INIT and msg.get("reform") is not None:
                await self._reform(peer, msg)
            elif msg.kind == Kind.SHARD_INIT:
                js = self.store.init(
                    msg["job"],
                    msg["members"],
                    msg["staleness"],
                    msg.tensors,
                    cut_every=msg.get("cut_every") or 0,
                )
                self.owners[msg["job"]] = {
                    str(k): str(v) for k, v in (msg.get("owners") or {}).items()
                }
                self.log.info("job held", job=msg["job"], tensors=len(js.weights))
                await self.channel.send(Kind.OK, {"rid": rid}, to=peer)
            elif msg.kind == Kind.SHARD_FETCH:
                js = self.store.get(msg["job"])
                info = {
                    **js.clock.snapshot(),
                    "pushes": js.pushes,
                    "bytes": js.pushed_bytes,
                    "duplicates": js.duplicates,
                    "applied": js.applied_sets(),
                }
                await self.channel.send(Kind.OK, {"rid": rid, "info": info}, js.weights, to=peer)
            elif msg.kind == Kind.SHARD_CUT and msg.get("keep"):  # on demand (head/cuts.py)
                info = {"earliest": self.store.get(msg["job"]).ask_cut(msg["wave"])}
                await self.channel.send(Kind.OK, {"rid": rid, "info": info}, to=peer)
            elif msg.kind == Kind.SHARD_CUT:
                self.store.get(msg["job"])  # an unknown job is refused at once
                self.cut_waits.setdefault(msg["job"], []).append((peer, rid, msg["wave"]))
                await self._answer_cuts(msg["job"])
            elif msg.kind == Kind.SHARD_DROP:
                self.owners.pop(msg["job"], None)
                for p, prid, _vw, _stage in self.store.drop(msg["job"]):
                    await self.channel.reply_error(p, f"job {msg['job']} ended", prid)
                for p, prid, _wave in self.cut_waits.pop(msg["job"], []):
                    await self.channel.reply_error(p, f"job {msg['job']} ended", prid)
                await self.channel.send(Kind.OK, {"rid": rid}, to=peer)
        except (ShardError, WspError) as exc:
            self.log.warning("request refused", kind=str(msg.kind), error=str(exc))
            await self.channel.reply_error(peer, f"shard {self.index}: {exc}", rid)

    async def _reform(self, peer: bytes | None, msg: Message) -> None:
        """A virtual worker leaves the job here (``reform = {"vw": v, "leave": true}``: a
        worker of it was lost), or joins it again re-formed (``{"vw": v, "waves": n}``, its
        stages' names in ``members[str(v)]``, its workers in ``owners``):
        :mod:`hetpipe.head.reform`. Leaving answers the pulls its clock held back and
        refuses its own; the reply's ``info`` says its clock and reach (leave) or its offset
        (join, or ``{"vw": v, "base": b}``: moved on to the job's one base for it)."""
        assert self.channel is not None
        job, reform = msg["job"], msg["reform"]
        js = self.store.get(job)
        vw = int(reform["vw"])
        owners = self.owners.setdefault(job, {})
        info: dict[str, Any]
        if reform.get("base") is None:  # (a move to its base keeps its workers)
            for key in [k for k in owners if k.split("/")[0] == str(vw)]:
                del owners[key]
        if reform.get("base") is not None:
            parked, info = [], {"offset": js.rebase_vw(vw, int(reform["base"]))}
        elif reform.get("leave"):
            clock, parked = js.remove_vw(vw, lambda item: item[2] == vw)
            info = {"clock": clock, "reach": js.reach.get(vw, 0)}
            self.log.info("vw left the job", job=job, vw=vw, clock=clock)
        else:
            member = msg["members"].get(str(vw)) or {}
            stages = {int(s): [str(n) for n in held] for s, held in member["stages"].items()}
            offset = js.rejoin_vw(vw, stages, int(reform["waves"]))
            owners.update({str(k): str(v) for k, v in (msg.get("owners") or {}).items()})
            parked = []
            info = {"offset": offset}
            self.log.info("vw joined the job again", job=job, vw=vw, offset=offset)
        await self.channel.send(Kind.OK, {"rid": msg.get("rid"), "info": info}, to=peer)
        for p, prid, _vw, _stage in parked:
            await self.channel.reply_error(p, f"job {job}: vw{vw} left the job (re-formed)", prid)
        for item in js.clock.release():
            await self._answer(job, item)
        if self.cut_waits.get(job):
            await self._answer_cuts(job)

    async def _push(self, peer: bytes | None, msg: Message) -> None:
        assert self.channel is not None
        js = self.store.get(msg["job"])
        if msg.get("migrate") is not None:  # a live migration (hetpipe.migrate)
            names = [str(n) for n in msg["migrate"]]
            js.migrate(msg["vw"], msg["stage"], names, msg["wave"])
            await self.channel.send(Kind.OK, {"rid": msg["rid"]}, to=peer)
            for item in js.clock.release():  # a stage that left may have held the clock
                await self._answer(msg["job"], item)
            return
        applied = js.push(msg["vw"], msg["stage"], msg["wave"], msg.tensors)
        await self._ack(peer, {"rid": msg["rid"], "info": {"applied": applied}})
        for item in js.clock.release():
            await self._answer(msg["job"], item)
        if self.cut_waits.get(msg["job"]):
            await self._answer_cuts(msg["job"])

    async def _ack(self, peer: bytes | None, fields: dict[str, Any]) -> None:
        """Answer a push. A stage that pushes faster than its event loop reads the answers
        fills its queue here (the socket's high-water mark), and ZeroMQ would drop the
        answer; its stage would then hold that push (and every later one) as unanswered to
        the end of its job. So an answer that finds the queue full is sent again in the
        background as the queue drains, for up to :data:`ACK_RETRY_S`; this loop never
        waits for one peer."""
        assert self.channel is not None
        try:
            await self.channel.send(Kind.OK, fields, to=peer)
        except ConnectionError as exc:
            if not isinstance(exc.__cause__, zmq.Again):
                raise
            task = asyncio.get_running_loop().create_task(self._ack_later(peer, fields))
            self._late.add(task)
            task.add_done_callback(self._late.discard)

    async def _ack_later(self, peer: bytes | None, fields: dict[str, Any]) -> None:
        assert self.channel is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ACK_RETRY_S
        while True:
            await asyncio.sleep(ACK_RETRY_EVERY_S)
            try:
                await self.channel.send(Kind.OK, fields, to=peer)
                return
            except ConnectionError as exc:
                if not isinstance(exc.__cause__, zmq.Again) or loop.time() > deadline:
                    self.log.warning("push answer undeliverable", error=str(exc))
                    return

    async def _answer_cuts(self, job: str) -> None:
        """Answer the head's requests for cuts that are complete now (refuse unknown ones)."""
        assert self.channel is not None
        js = self.store.get(job)
        waiting = []
        for peer, rid, wave in self.cut_waits.pop(job, []):
            try:
                cut = js.cut(wave)
            except ShardError as exc:
                await self.channel.reply_error(peer, f"shard {self.index}: {exc}", rid)
                continue
            if cut is None:
                waiting.append((peer, rid, wave))
                continue
            weights, info = cut
            try:
                await self.channel.send(Kind.OK, {"rid": rid, "info": info}, weights, to=peer)
            except ConnectionError as exc:
                self.log.warning("cut answer undeliverable", job=job, wave=wave, error=str(exc))
        if waiting:  # (requests that came in during the sends above stay too)
            self.cut_waits.setdefault(job, []).extend(waiting)

    async def _pull(self, peer: bytes | None, msg: Message) -> None:
        js = self.store.get(msg["job"])
        js.answer(msg["vw"], msg["stage"])  # validates the stage before parking it
        item: Parked = (peer, msg["rid"], msg["vw"], msg["stage"])
        if js.clock.park(js.need_of(msg["vw"], msg["need"]), item):
            await self._answer(msg["job"], item)

    async def _reduce(self, peer: bytes | None, msg: Message) -> None:
        assert self.channel is not None
        js = self.store.get(msg["job"])
        item: Parked = (peer, msg["rid"], msg["vw"], msg["stage"])
        answers = js.reduce(
            msg["vw"], msg["stage"], msg["iteration"], msg["samples"], msg.tensors, item
        )
        for (p, rid, vw, stage), fields, tensors in answers:
            try:
                await self.channel.send(Kind.REDUCED, {"rid": rid, **fields}, tensors, to=p)
            except ConnectionError as exc:
                self.log.warning(
                    "reduce answer undeliverable",
                    job=msg["job"],
                    vw=vw,
                    stage=stage,
                    error=str(exc),
                )

    async def _answer(self, job: str, item: Parked) -> None:
        assert self.channel is not None
        peer, rid, vw, stage = item
        fields, tensors = self.store.get(job).answer(vw, stage)
        try:
            await self.channel.send(Kind.PULLED, {"rid": rid, **fields}, tensors, to=peer)
        except ConnectionError as exc:
            self.log.warning(
                "pull answer undeliverable", job=job, vw=vw, stage=stage, error=str(exc)
            )


async def serve(
    cluster: ClusterConfig,
    index: int,
    *,
    head: str | None = None,
    ready_file: str | None = None,
    run_dir: str | None = None,
) -> None:
    """Run shard ``index`` (and the head, for shard 0) until SIGTERM/SIGINT."""
    spec = cluster.ps[index]
    owner = Owner()
    log = logmod.get("ps").bind(shard=index)
    try:
        owner.secure(cluster.security, shard_user(index), serve=True)
        sock = make_socket(
            owner.ctx,
            zmq.ROUTER,
            bind=tcp(spec.host, spec.port),
            hwm=cluster.runtime.hwm * 16,
            router_mandatory=True,
            max_frame_bytes=cluster.runtime.max_frame_bytes,
            curve=owner.curve,
        )
        address = bound_address(sock)
        server = ShardServer(index)
        head_obj: Any = None
        if index == 0:
            from hetpipe.head import Head

            head_obj = Head(cluster, owner, address, run_dir=run_dir)

        async def handle(peer: bytes | None, msg: Message) -> None:
            if msg.kind in ShardServer.KINDS:
                await server.handle(peer, msg)
            elif head_obj is not None:
                await head_obj.handle(peer, msg)
            else:
                await channel.reply_error(
                    peer,
                    f"{msg.kind} goes to the head (shard 0), this is shard {index}",
                    msg.get("rid"),
                )

        channel = owner.channel(
            Channel(
                sock, handle, name=f"shard{index}", max_frame_bytes=cluster.runtime.max_frame_bytes
            )
        )
        server.channel = channel
        owner.watch_handshakes(channel)
        if head_obj is not None:
            await head_obj.start(channel)
        else:
            owner.spawn(_announce(owner, cluster, index, address, head), "announce")
        write_ready(ready_file, {"role": "ps", "shard": index, "address": address})
        log.info("ready", address=address, head=index == 0, curve=owner.curve is not None)
        sig = await wait_for_signal()
        log.info("stopping", signal=sig)
        if head_obj is not None:
            await head_obj.stop()
    finally:
        await owner.close()


async def _announce(
    owner: Owner, cluster: ClusterConfig, index: int, address: str, head: str | None
) -> None:
    """Tell the head where this shard listens, again every few seconds (the head may restart)."""
    head_addr = head or cluster.head.address
    sock = make_socket(
        owner.ctx,
        zmq.DEALER,
        connect=head_addr,
        hwm=cluster.runtime.hwm,
        max_frame_bytes=cluster.runtime.max_frame_bytes,
        curve=owner.curve,
    )
    ch = owner.channel(
        Channel(sock, None, name="head", max_frame_bytes=cluster.runtime.max_frame_bytes)
    )
    while True:
        await ch.send(Kind.SHARD_HELLO, {"shard": index, "address": address, "pid": os.getpid()})
        await asyncio.sleep(max(cluster.runtime.heartbeat_s, 1.0))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--cluster",
    "cluster_path",
    default="cluster.toml",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Cluster description.",
)
@click.option("--shard", type=int, required=True, help="Shard index; 0 is also the head.")
@click.option("--head", default=None, help="Head address (tcp://host:port) if not the file's.")
@click.option("--ready-file", default=None, help="Write the bound address here when ready.")
@click.option("--run-dir", default=None, help="Where the head writes job outputs.")
@click.option("--log-level", default="info", show_default=True)
@click.option(
    "--log-file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Log here (JSON lines), rotated by the cluster file's log_max_bytes.",
)
def main(
    cluster_path: str,
    shard: int,
    head: str | None,
    ready_file: str | None,
    run_dir: str | None,
    log_level: str,
    log_file: str | None,
) -> None:
    """Run one parameter-server shard (shard 0 is also the head)."""
    logmod.configure(f"ps{shard}", level=log_level)
    # one intra-op thread: shard updates are memory-bound, and idle OpenMP threads spinning
    # after each add would take cores from the workers on the same host
    torch.set_num_threads(1)
    try:
        cluster = load_cluster(cluster_path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    head = start_daemon(f"ps{shard}", cluster, log_file, log_level, head)
    if not 0 <= shard < len(cluster.ps):
        raise click.ClickException(
            f"--shard {shard}: {cluster_path} has {len(cluster.ps)} shards "
            f"(0..{len(cluster.ps) - 1})"
        )
    try:
        asyncio.run(serve(cluster, shard, head=head, ready_file=ready_file, run_dir=run_dir))
    except KeysError as exc:
        raise click.ClickException(str(exc)) from None
    except zmq.ZMQError as exc:
        spec = cluster.ps[shard]
        raise click.ClickException(
            f"shard {shard} cannot listen on {spec.host}:{spec.port} on {socket.gethostname()}: "
            f"{exc}"
        ) from None
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
