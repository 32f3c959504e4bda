"""Live layer migration (hetpipe.migrate): the pure split arithmetic, the shard following a
migration, and a virtual worker's real stages (StageCompute and StageRunner in one process,
messages delivered between them, the real JobShard behind their shard channel) that change
their split at a wave or iteration boundary while they train.

Lossless: with the same seed and data order, a virtual worker that migrates layers ends with
the same weights (<= 1e-6) as the same job that does not; in ``async`` with Nm > 1, where a
layer's staleness depends on its stage, as the job that changes its split at the same
boundary by stopping there and resuming on the new split (hetpipe.migrate says why)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import job
from helpers import InlineExecutor, check_invariants

from hetpipe import migrate, stagestate
from hetpipe.config import DeviceSpec
from hetpipe.core.layout import StageLayout, VWLayout
from hetpipe.core.wsp import WspError
from hetpipe.head.migration import MigrationPart, relaid_plan
from hetpipe.head.states import JobStatus
from hetpipe.job import JobSpec
from hetpipe.migrate import (
    LocalBus,
    MigrationError,
    Migrator,
    Move,
    Order,
    check_order,
    cut_points,
    moves,
    outgoing,
)
from hetpipe.models import build_model
from hetpipe.pipeline import StageRunner
from hetpipe.planner.online import Decision
from hetpipe.rotation import RotatingJsonl
from hetpipe.shard import JobShard, ShardError, ShardStore
from hetpipe.stage import StageCompute
from hetpipe.task import StageTask
from hetpipe.transport import RemoteError
from hetpipe.wire import Kind, Message

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def no_validation_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """These runners exchange only the schedule's messages: no job-end validation pass."""
    monkeypatch.setattr(StageRunner, "validates", property(lambda self: False))


# -- pure ---------------------------------------------------------------------------------------


def test_moves_name_each_range_that_changes_stage() -> None:
    assert cut_points([4, 8, 4]) == (0, 4, 12, 16)
    assert moves([4, 8, 4], [4, 8, 4]) == ()
    assert moves([4, 8, 4], [6, 4, 6]) == (Move(4, 6, 1, 0), Move(10, 12, 1, 2))
    assert moves([8, 4, 4], [2, 4, 10]) == (Move(2, 6, 0, 1), Move(6, 8, 0, 2), Move(8, 12, 1, 2))
    with pytest.raises(MigrationError, match="hold 16 and 15"):
        moves([8, 8], [8, 7])


@pytest.mark.parametrize(
    ("order", "match"),
    [
        (Order(4, (8, 8, 0)), "at least one layer"),
        (Order(4, (8, 8)), "2 stages"),
        (Order(4, (8, 4, 5)), "17 layers"),
        (Order(6, (8, 4, 4)), "opens no wave"),
        (Order(0, (8, 4, 4)), "opens no wave"),
    ],
)
def test_an_order_that_cannot_replace_the_split_is_refused(order: Order, match: str) -> None:
    with pytest.raises(MigrationError, match=match):
        check_order(order, 3, 4, total=16, what="vw0")


# -- a virtual worker in one process ------------------------------------------------------------

MODEL = "cnn"  # 16 layers: convolutions, batch norm (buffers), linear
LAYERS = (6, 6, 4)


def device(s: int, memory: int = 1 << 30) -> DeviceSpec:
    return DeviceSpec(f"gpu{s}", "cpu", "fast", memory, 1.0, 0, "n", "h")


def batch(p: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + p)
    return torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)


class Shard:
    """A parameter-server shard in process: the real :class:`hetpipe.shard.JobShard` behind
    the two calls a stage makes on its channel (``request``, ``send_request``), pulls parked
    under WSP until the global clock allows them, as :mod:`hetpipe.ps` serves them."""

    def __init__(self, js: JobShard) -> None:
        self.js = js
        self.name = "shard0"

    def _answer(self, vw: int, stage: int) -> Message:
        fields, tensors = self.js.answer(vw, stage)
        return Message(Kind.PULLED, fields, {n: t.clone() for n, t in tensors.items()})

    def _release(self) -> None:
        for fut, vw, stage in self.js.clock.release():
            fut.set_result(self._answer(vw, stage))

    async def request(self, kind: Any, fields: dict, *_a: Any, **_k: Any) -> Message:
        vw, stage = fields["vw"], fields["stage"]
        if kind == Kind.PUSH:  # a migration's: the names this stage holds from a wave on
            self.js.migrate(vw, stage, list(fields["migrate"]), fields["wave"])
            self._release()
            return Message(Kind.OK, {}, {})
        assert kind == Kind.PULL, kind
        self.js.answer(vw, stage)
        fut = asyncio.get_running_loop().create_future()
        if self.js.clock.park(fields["need"], (fut, vw, stage)):
            return self._answer(vw, stage)
        return await fut

    async def send_request(self, kind: Any, fields: dict, tensors: dict, **_k: Any):
        assert kind == Kind.PUSH
        self.js.push(fields["vw"], fields["stage"], fields["wave"], tensors)
        self._release()
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(Message(Kind.OK, {}, {}))
        return fut


def run_job(
    kind: str,
    nm: int,
    total: int,
    orders: dict[int, list[Order]],
    *,
    vws: int = 1,
    staleness: int = 0,
    optimizer: str = "sgd",
    memory: dict[int, int] | None = None,
    layers: tuple[int, ...] = (),
    start: int = 0,
    initial: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict[str, torch.Tensor] | None = None,
    opt_steps: dict[str, int] | None = None,
    lose: int | None = None,
    errors: list[BaseException] | None = None,
    later: list[tuple[int, int, tuple[int, ...]]] | None = None,
    cancel_later: bool = False,
) -> tuple[list[dict[str, torch.Tensor]], JobShard, list[list[StageRunner]]]:
    """Train ``vws`` virtual workers of ``len(layers)`` stages each (split ``layers``, else
    ``LAYERS``) for ``total`` minibatches each under WSP's ``staleness`` through one
    shard, virtual worker ``v`` with the migrations ``orders[v]``; each virtual worker's
    stages' local weights at the end, the shard, the runners by virtual worker.

    A resumed attempt (the offline path a migration replaces): from minibatch ``start`` of
    the data on, from the weights ``initial``, each parameter's optimizer state from
    ``optimizer_state`` (checkpoint names, any stage's) and ``opt_steps``. ``memory``: the
    cap of stage ``s``'s device. ``lose``: that stage of virtual worker 0 is lost as it
    reaches its migration; each stage's error goes to ``errors``. ``later``: ``(vw, after,
    layers)``, a migration ordered while the job trains, once stage 0 of ``vw`` admitted
    ``after`` minibatches, in the order the head's ``migrate`` takes (stage 0 first, which
    picks the boundary: hetpipe.head.migration); ``cancel_later``: stage 0 alone takes it,
    holds at its boundary, and the order is cancelled there (a later stage refused it)."""
    layers = layers or LAYERS
    train: dict[str, Any] = {"schedule": kind, "push_every": 0}
    spec = JobSpec.from_dict(
        job(
            "mig",
            model=MODEL,
            nm=nm,
            minibatches=total,
            optimizer=optimizer,
            train=train,
            staleness=staleness,
        )
    ).to_dict()
    torch.manual_seed(0)
    state = initial if initial is not None else build_model(MODEL).state_dict()
    k = len(layers)
    bounds = cut_points(layers)
    layouts = [StageLayout((f"gpu{s}",), bounds[s], bounds[s + 1]) for s in range(k)]
    computes: list[list[StageCompute]] = []
    for v in range(vws):
        computes.append([])
        for s in range(k):
            task = dataclasses.replace(
                StageTask.standalone(
                    "mig",
                    spec,
                    layouts[s],
                    stage=s,
                    k=k,
                    nm=nm,
                    minibatches=total,
                    num_vws=vws,
                    placement=dict.fromkeys(state, 0),
                    prev=layouts[s - 1] if s else None,
                    next=layouts[s + 1] if s + 1 < k else None,
                    start=start,
                ),
                vw=v,
                staleness=staleness,
            )
            c = StageCompute(task, device(s, (memory or {}).get(s, 1 << 30)))
            if optimizer_state is not None:
                c.load_state({"opt_steps": opt_steps or {}}, optimizer_state, weights=False)
            computes[v].append(c)
    members = {
        str(v): {
            "waves": -(-total // nm),
            "stages": {str(s): c.state_names() for s, c in enumerate(computes[v])},
        }
        for v in range(vws)
    }
    shard = Shard(ShardStore().init("mig", members, staleness, state))
    runners: list[list[StageRunner]] = [[] for _ in range(vws)]

    async def main() -> None:
        for v in range(vws):
            bus = LocalBus(k)
            # each virtual worker reads its own minibatches
            stream = SimpleNamespace(
                reader=lambda _start, v=v: SimpleNamespace(get=lambda p: batch(p + 1000 * v)),
                source=SimpleNamespace(val=None),
            )
            for s, c in enumerate(computes[v]):

                async def send(
                    kind_: str,
                    p: int,
                    tensors: dict,
                    _shared: Any = None,
                    _to: int = 0,
                    extra: dict | None = None,
                    s: int = s,
                    v: int = v,
                ) -> None:
                    dst = s + 1 if kind_ == Kind.ACT else s - 1
                    tensors = {n: t.clone() for n, t in tensors.items()}
                    msg = Message(Kind(kind_), {"p": p, **(extra or {})}, tensors)
                    runners[v][dst].on_message(msg)

                async def report(_stats: dict) -> None:
                    pass

                r = StageRunner(
                    c,
                    InlineExecutor(),
                    send=send,
                    shards={0: shard},  # type: ignore[dict-item]
                    report=report,
                    stream=stream if s == 0 else None,  # type: ignore[arg-type]
                )
                runners[v].append(r)
                if orders.get(v) or later:
                    cap = (memory or {}).get(s, 1 << 30)
                    # short only where a stage is lost on purpose: elsewhere a loaded host
                    # must not turn a slow stage into a "lost" one
                    wait_s = 2.0 if lose is not None else 60.0
                    m = Migrator(orders.get(v, []), bus, device(s, cap), timeout_s=wait_s)
                    m.install(r)
                    if (v, s) == (0, lose):
                        m._carry_out = lost  # type: ignore[method-assign]
        every = [r.run() for rs in runners for r in rs]
        for v, after, split in later or []:
            every.append(order_later(runners[v], after, split))
        got = await asyncio.wait_for(asyncio.gather(*every, return_exceptions=True), 60)
        failed = [e for e in got if isinstance(e, BaseException)]
        if errors is None and failed:
            raise failed[0]
        if errors is not None:
            errors.extend(failed)

    async def order_later(rs: list[StageRunner], after: int, split: tuple[int, ...]) -> None:
        while rs[0].schedule.nf < after:
            await asyncio.sleep(0)
        # the head proposes the first boundary (its view of stage 0 lags); stage 0 picks
        at = migrate.order(rs[0], Order(nm, split, "test"), pick=True)
        assert at % nm == 0 and at > rs[0].schedule.nf
        if cancel_later:
            while rs[0].migration.held_since is None:  # stage 0 holds at the boundary
                await asyncio.sleep(0)
            assert migrate.cancel(rs[0], at) and not migrate.cancel(rs[0], at)
            return
        for r in rs[1:]:
            assert migrate.order(r, Order(at, split, "test")) == at

    async def lost(*_a: Any) -> None:
        raise ConnectionError("worker lost")

    asyncio.run(main())
    local = [
        {n: t.detach().clone() for r in rs for n, t in r.compute.state_dict().items()}
        for rs in runners
    ]
    return local, shard.js, runners


def run_vw(
    kind: str, nm: int, total: int, orders: list[Order], **kw: Any
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[StageRunner]]:
    """:func:`run_job` of one virtual worker: its local weights, the shard's, its runners."""
    local, js, runners = run_job(kind, nm, total, {0: orders}, **kw)
    return local[0], js.weights, runners[0]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.allclose(a[n].float(), b[n].float(), atol=1e-6, rtol=0), (
            n,
            (a[n].float() - b[n].float()).abs().max().item(),
        )


def test_a_migration_in_async_with_nm_1_is_lossless() -> None:
    plain_local, plain_shard, _ = run_vw("async", 1, 12, [])
    local, shard, runners = run_vw("async", 1, 12, [Order(5, (3, 9, 4)), Order(9, (8, 2, 6))])
    assert_same(local, plain_local)
    assert_same(shard, plain_shard)
    assert [(r.task.first, r.task.last) for r in runners] == [(0, 8), (8, 10), (10, 16)]
    # the moved layers train on their new stage: its pushes carry them
    rec = runners[0].final_stats()["migrations"]
    assert [m["event"] for m in rec] == ["migration", "migration"]
    assert rec[0]["moves"] == [{"first": 3, "last": 6, "src": 0, "dst": 1}]
    assert rec[0]["bytes_out"] > 0 and rec[0]["migration_stall_s"] >= 0


def stopped_and_resumed(
    kind: str, nm: int, total: int, at: int, new: tuple[int, ...], optimizer: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The job without migration that changes its split at ``at`` by the offline path: it
    stops there (every update pushed), and a new attempt on split ``new`` starts from the
    weights at the cut with each parameter's optimizer state (as a checkpoint's restore
    gives it, hetpipe.head.recovery.stage_restores) and the data from ``at`` on. The weights
    are the stages' own: a lone virtual worker's global weights hold the same updates,
    summed in another order, and Adam turns that rounding into whole steps on a parameter
    whose gradient is rounding alone (a convolution's bias before batch norm)."""
    local, _, runners = run_vw(kind, nm, at, [], optimizer=optimizer)
    opt: dict[str, torch.Tensor] = {}
    steps: dict[str, int] = {}
    for r in runners:
        meta, tensors = stagestate.save(r.compute.wv, at // nm)
        opt.update({k: t for k, t in tensors.items() if k.startswith("opt/")})
        steps.update(meta["opt_steps"])
    return run_vw(
        kind,
        nm,
        total - at,
        [],
        optimizer=optimizer,
        layers=new,
        start=at,
        initial=local,
        optimizer_state=opt,
        opt_steps=steps,
    )[:2]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_migration_in_async_with_weight_stashing_is_lossless(optimizer: str) -> None:
    # Nm = 4: the staleness a layer trains with depends on its stage, so the comparable job
    # changes its split at the same boundary by stopping and resuming (hetpipe.migrate)
    new = (8, 4, 4)
    want_local, _ = stopped_and_resumed("async", 4, 16, 8, new, optimizer)
    local, shard, runners = run_vw("async", 4, 16, [Order(8, new)], optimizer=optimizer)
    assert_same(local, want_local)
    # the shard holds every update once: the stages' weights, summed in its own order
    for n, t in local.items():
        assert torch.allclose(shard[n], t, rtol=1e-6, atol=1e-6), n
    assert runners[0].task.last == 8
    # before the boundary the pipeline held several minibatches at once (stashed versions)
    assert runners[0].compute.stats.peak_in_flight > 1


def test_a_migration_in_1f1b_is_lossless() -> None:
    plain_local, plain_shard, _ = run_vw("1f1b", 4, 16, [])
    local, shard, _ = run_vw("1f1b", 4, 16, [Order(8, (2, 7, 7))], optimizer="adam")
    plain_local_adam, plain_shard_adam, _ = run_vw("1f1b", 4, 16, [], optimizer="adam")
    assert_same(local, plain_local_adam)
    assert_same(shard, plain_shard_adam)
    local, shard, _ = run_vw("1f1b", 4, 16, [Order(4, (8, 5, 3)), Order(12, (5, 5, 6))])
    assert_same(local, plain_local)
    assert_same(shard, plain_shard)


def test_a_split_that_would_not_fit_is_refused_and_training_goes_on() -> None:
    plain_local, _, _ = run_vw("async", 1, 8, [])
    # stage 2's device holds its 4 layers, not 12 of them
    local, _, runners = run_vw("async", 1, 8, [Order(4, (2, 2, 12))], memory={2: 1_200_000})
    assert_same(local, plain_local)
    assert [(r.task.first, r.task.last) for r in runners] == [(0, 6), (6, 12), (12, 16)]
    for r in runners:
        (rec,) = r.final_stats()["migrations"]
        assert rec["event"] == "migration_refused"
        assert "vw0/stage2: layers 4..15 would need" in rec["refused"]
    # a stage that held state would hold none (layers 9..11: ReLU and pools): refused too
    local, _, runners = run_vw("async", 1, 8, [Order(4, (9, 3, 4))])
    assert_same(local, plain_local)
    assert (
        "layers 9..11 would hold no state" in runners[1].final_stats()["migrations"][0]["refused"]
    )


def test_orders_a_stage_cannot_carry_out_are_refused() -> None:
    _, _, runners = run_vw("async", 2, 4, [])
    c = runners[0].compute
    with pytest.raises(MigrationError, match="past the job's 4"):
        Migrator.validate(c, [Order(4, (8, 4, 4))])
    with pytest.raises(MigrationError, match="opens no wave"):
        Migrator.validate(c, [Order(3, (8, 4, 4))])
    Migrator.validate(c, [Order(2, (8, 4, 4))])
    c.spec = dataclasses.replace(c.spec, checkpoint_every=1)
    with pytest.raises(MigrationError, match="opens wave 1, a checkpoint's cut"):
        Migrator.validate(c, [Order(2, (8, 4, 4))])


def test_each_stage_knows_alone_what_it_gives_away() -> None:
    for old, new in itertools.product([(4, 8, 4), (1, 1, 14), (6, 6, 4)], [(14, 1, 1), (5, 5, 6)]):
        a, b = cut_points(old), cut_points(new)
        mine = [m for s in range(3) for m in outgoing(s, a[s], a[s + 1], b)]
        assert tuple(sorted(mine, key=lambda m: m.first)) == moves(old, new)


def test_every_layer_ends_on_one_stage() -> None:
    for old, new in itertools.product([(4, 8, 4), (1, 1, 14)], [(14, 1, 1), (5, 5, 6)]):
        owner = {}
        for m in moves(old, new):
            for j in range(m.first, m.last):
                assert j not in owner
                owner[j] = m.dst
        b = cut_points(new)
        for j, dst in owner.items():
            assert b[dst] <= j < b[dst + 1]


@pytest.mark.parametrize("staleness", [0, 1])
def test_wsp_invariant_holds_with_a_migration_in_one_of_two_virtual_workers(staleness) -> None:
    nm, total = 2, 12
    orders = {1: [Order(4, (8, 4, 4)), Order(8, (3, 9, 4))]}
    local, js, runners = run_job("async", nm, total, orders, vws=2, staleness=staleness)
    records = {}
    for v, rs in enumerate(runners):
        for s, r in enumerate(rs):
            stats = r.final_stats()
            fields = stats["record_fields"]
            records[(v, s)] = [dict(zip(fields, row, strict=True)) for row in stats["records"]]
            assert [row["p"] for row in records[(v, s)]] == list(range(total))
    check_invariants(records, {0: nm, 1: nm}, staleness)
    assert [(r.task.first, r.task.last) for r in runners[1]] == [(0, 3), (3, 12), (12, 16)]
    assert [(r.task.first, r.task.last) for r in runners[0]] == [(0, 6), (6, 12), (12, 16)]
    assert [m["event"] for m in runners[1][0].final_stats()["migrations"]] == ["migration"] * 2
    # the shard applied every wave of every stage once, under the names each stage held then
    waves = total // nm
    for v in range(2):
        assert js.clock.vw_clock(v) == waves
    assert sorted(js.names[(1, 1)]) == sorted(runners[1][1].compute.state_names())
    assert all(torch.isfinite(t).all() for t in js.weights.values())
    assert all(torch.isfinite(t).all() for w in local for t in w.values())


def test_a_stage_lost_during_a_migration_fails_the_others_naming_it() -> None:
    errors: list[BaseException] = []
    run_job("async", 1, 8, {0: [Order(4, (8, 4, 4))]}, lose=1, errors=errors)
    assert any(isinstance(e, ConnectionError) for e in errors)
    named = [str(e) for e in errors if isinstance(e, MigrationError)]
    assert named and all(
        "stage 1 of vw0 did not reach the migration at minibatch 4" in m for m in named
    )


def test_the_shard_follows_a_stage_that_gains_or_loses_names() -> None:
    w = {n: torch.zeros(2) for n in ("0.w", "1.w", "2.w")}
    members = {"0": {"waves": 4, "stages": {"0": ["0.w"], "1": ["1.w", "2.w"]}}}
    js = ShardStore().init("j", members, 0, w)
    for wave in range(2):
        for stage in (0, 1):
            js.push(0, stage, wave, {})
    js.migrate(0, 2, ["2.w"], 2)  # a stage new on this shard: waves 0, 1 count as pushed
    js.migrate(0, 1, ["1.w"], 2)
    assert js.clock.vw_clock(0) == 2
    js.push(0, 2, 2, {"2.w": torch.ones(2)})
    with pytest.raises(ShardError, match="unknown update"):
        js.push(0, 1, 2, {"2.w": torch.ones(2)})
    js.migrate(0, 0, [], 2)  # stage 0 leaves: its clock no longer counts here
    js.push(0, 1, 2, {})
    assert js.clock.vw_clock(0) == 3
    with pytest.raises(ShardError, match="migrated unknown"):
        js.migrate(0, 1, ["9.w"], 3)
    with pytest.raises(WspError, match="would hold nothing"):
        js.migrate(0, 1, [], 3) or js.migrate(0, 2, [], 3)


@pytest.mark.parametrize(("kind", "nm"), [("async", 1), ("1f1b", 2)])
def test_a_migration_ordered_while_training_is_lossless(kind: str, nm: int) -> None:
    plain_local, plain_shard, _ = run_vw(kind, nm, 16, [])
    local, shard, runners = run_vw(kind, nm, 16, [], later=[(0, 3, (8, 4, 4))])
    assert_same(local, plain_local)
    assert_same(shard, plain_shard)
    assert [(r.task.first, r.task.last) for r in runners] == [(0, 8), (8, 12), (12, 16)]
    (rec,) = runners[0].final_stats()["migrations"]
    assert rec["reason"] == "test" and rec["at"] % nm == 0


def test_an_order_cancelled_at_its_boundary_lets_the_stage_go_on() -> None:
    """Stage 0 holds at a boundary whose migration a later stage refused: once the head
    cancels it there, the virtual worker trains on unchanged, as if it was never ordered
    (Nm = 1: nothing is in flight at a boundary, so holding there changes no step)."""
    plain_local, plain_shard, _ = run_vw("async", 1, 12, [])
    local, shard, runners = run_vw("async", 1, 12, [], later=[(0, 3, (8, 4, 4))], cancel_later=True)
    assert_same(local, plain_local)
    assert_same(shard, plain_shard)
    assert [(r.task.first, r.task.last) for r in runners] == [(0, 6), (6, 12), (12, 16)]
    assert all("migrations" not in r.final_stats() for r in runners)


def test_stage_0_picks_a_boundary_past_what_it_admitted_and_past_cuts() -> None:
    _, _, runners = run_vw("async", 2, 16, [Order(4, (8, 4, 4))])
    first = runners[0]
    first.schedule.nf = 7  # as if it admitted 0..6: the next one may be decided already
    first.asked.add(4)  # wave 4 closes at a cut asked for on demand (minibatch 8)
    assert migrate.order(first, Order(2, (6, 6, 4)), pick=True) == 10
    assert [o.at for o in first.migration.orders] == [10]
    first.schedule.nf = 15
    with pytest.raises(MigrationError, match="past the job's 16"):
        migrate.order(first, Order(2, (6, 6, 4)), pick=True)


def test_an_order_a_stage_has_passed_is_refused() -> None:
    _, _, runners = run_vw("async", 1, 8, [Order(4, (8, 4, 4))])
    with pytest.raises(MigrationError, match="minibatch 6 is behind this stage"):
        migrate.order(runners[1], Order(6, (6, 6, 4)))
    runners[1].migration = None
    with pytest.raises(MigrationError, match="does not migrate layers"):
        migrate.order(runners[1], Order(6, (6, 6, 4)))


def test_the_heads_plan_follows_a_migration() -> None:
    vws = (
        VWLayout(
            (
                StageLayout(("a",), 0, 6, recompute=(1, 4)),
                StageLayout(("b",), 6, 12, swap=(7,)),
                StageLayout(("c",), 12, 16),
            ),
            2,
        ),
        VWLayout((StageLayout(("d",), 0, 16),), 1),
    )
    got = relaid_plan(vws, 0, [3, 9, 4])
    assert [(s.first, s.last, s.recompute, s.swap) for s in got[0].stages] == [
        (0, 3, (1,), ()),
        (3, 12, (4,), (7,)),
        (12, 16, (), ()),
    ]
    assert got[1] == vws[1]


# -- the head's part, without a process -------------------------------------------------------


class FakeHead(MigrationPart):
    """MigrationPart over stand-ins for the head's channel, registry and jobs."""

    def __init__(self, tmp: Path, refuse: int | None = None) -> None:
        stages = (
            StageLayout(("a",), 0, 6),
            StageLayout(("b",), 6, 12),
            StageLayout(("c",), 12, 16),
        )
        plan = SimpleNamespace(vws=(VWLayout(stages, 2),), job="j.r1", minibatches_of=lambda _v: 40)
        self.js = SimpleNamespace(
            id="j",
            plan=plan,
            state=JobStatus.RUNNING,
            progress={(0, 0): {"forwards": 5}},
            spec=SimpleNamespace(checkpoint_every=0),
            migrations=[],
        )
        self.jobs = {"j": self.js}
        workers = {
            d: SimpleNamespace(job="j", vw=0, stage=s, ident=d.encode(), device=d)
            for s, d in enumerate("abc")
        }
        self.registry = SimpleNamespace(workers=workers)
        self.sent: list[tuple[Any, dict, dict, Any]] = []
        self.refuse = refuse
        self.picked = 10
        self.tmp = tmp
        self.log = SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None)
        head = self

        class Channel:
            async def request(self, kind: Any, fields: dict, **kw: Any) -> Message:
                head.sent.append((kind, fields, {}, kw["to"]))
                mode = fields.get("mode")
                refused = head.refuse is not None and kw["to"] == "abc"[head.refuse].encode()
                if refused and mode != "cancel":
                    raise RemoteError("vw0/stage1: a migration at minibatch 8 is pending")
                # stage 0 admitted more than its last report said: it picks a later boundary
                info = {"at": head.picked} if mode == "pick" else {}
                return Message(Kind.OK, {"rid": 0, "info": info}, {})

            async def send(self, kind: Any, fields: dict, tensors: Any = None, to: Any = None):
                head.sent.append((kind, fields, tensors or {}, to))

            async def reply_error(self, to: Any, message: str, rid: Any = None) -> None:
                head.sent.append((Kind.ERROR, {"message": message}, {}, to))

        self.channel = Channel()

    def _by_wire(self, wire: str) -> Any:
        return self.js if wire == "j.r1" else None

    def job_dir(self, _js: Any) -> Path:
        return self.tmp

    def metrics_file(self, _js: Any) -> RotatingJsonl:
        return RotatingJsonl(self.tmp / "metrics.jsonl", 1 << 20, 1)


def test_the_head_orders_a_migration_at_the_boundary_stage_0_picks(tmp_path: Path) -> None:
    head = FakeHead(tmp_path)
    got = asyncio.run(head.migrate("j", 0, [8, 4, 4], "drift"))
    # stage 0 last reported 5 admitted (nm = 2): the head proposes 6, stage 0 (told first)
    # picks 10 from what it admitted since, and the later stages take 10 as it is
    assert got == {"at": 10}
    sent = [(f["at"], f.get("mode"), to) for _k, f, _t, to in head.sent]
    assert sent == [(6, "pick", b"a"), (10, None, b"b"), (10, None, b"c")]
    assert all(k == Kind.MIGRATE_ORDER for k, *_ in head.sent)
    with pytest.raises(MigrationError, match="2 stages"):
        asyncio.run(head.migrate("j", 0, [8, 8], "drift"))
    with pytest.raises(MigrationError, match="job k is not running"):
        asyncio.run(head.migrate("k", 0, [8, 4, 4], "drift"))


def test_an_order_a_later_stage_refuses_is_cancelled_where_it_was_taken(tmp_path: Path) -> None:
    """Stage 0 took the order, stage 1 refused it: stage 0 must not wait at the boundary for
    a migration that cannot happen. It is told to drop the order, and a stage already at
    its exchange (now or later) is answered ``cancelled``."""
    head = FakeHead(tmp_path, refuse=1)
    t = torch.ones(1)

    async def main() -> None:
        parcels = {"rid": 7, "job": "j.r1", "vw": 0, "stage": 0, "at": 10, "step": "parcels"}
        await head._on_migrate(b"a", Message(Kind.MIGRATE, {**parcels, "parcels": []}, {}))
        assert head.sent == []  # parked: stage 0 drained before stage 1 refused
        with pytest.raises(MigrationError, match=r"vw0/stage1: .*pending"):
            await head.migrate("j", 0, [8, 4, 4], "drift")
        late = {**parcels, "rid": 8, "stage": 2, "parcels": []}
        await head._on_migrate(b"c", Message(Kind.MIGRATE, late, {"0/x": t}))

    asyncio.run(main())
    orders = [(f["at"], f.get("mode"), to) for k, f, _t, to in head.sent if k == Kind.MIGRATE_ORDER]
    assert orders == [(6, "pick", b"a"), (10, None, b"b"), (10, "cancel", b"a")]
    answers = {f["rid"]: f["info"] for k, f, _t, _to in head.sent if k == Kind.OK}
    assert set(answers) == {7, 8}
    assert all(a["cancelled"].startswith("cancelled: ") for a in answers.values())
    assert head._meets == {}
    head.refuse, head.picked, head.sent = None, 12, []
    asyncio.run(head.migrate("j", 0, [8, 4, 4], "drift"))
    assert head.sent[0][1]["at"] == 12  # proposed past the cancelled boundary 10


def test_an_online_replan_decision_is_ordered_as_a_migration(tmp_path: Path) -> None:
    """The drift watch's hook: a decision's split goes to the stages as a migration order
    (Nm kept); one that changes Nm, or whose order a stage refuses, is recorded refused."""
    bounds = ((0, 8), (8, 12), (12, 16))
    d = Decision(0, "b", 1, 3.0, True, "gpu b 3x slower", 1.5, nm=2, old_nm=2, bounds=bounds)

    async def order(head: FakeHead, decision: Decision) -> str | None:
        why = head.order_migration(head.js, decision)
        await asyncio.sleep(0.05)  # the order runs as a task of the head's loop
        return why

    head = FakeHead(tmp_path)
    assert asyncio.run(order(head, d)) is None
    assert [(f["at"], f["layers"], to) for _k, f, _t, to in head.sent] == [
        (6, [8, 4, 4], b"a"),
        (10, [8, 4, 4], b"b"),
        (10, [8, 4, 4], b"c"),
    ]
    assert head.js.migrations == []  # its outcome comes when the stages reach minibatch 10
    head = FakeHead(tmp_path)
    why = asyncio.run(order(head, dataclasses.replace(d, nm=4)))
    assert why == "not carried out: a live migration keeps Nm 2, the re-plan wants 4"
    assert head.sent == []
    head = FakeHead(tmp_path, refuse=1)
    assert asyncio.run(order(head, d)) is None
    (entry,) = head.js.migrations
    assert entry["event"] == "migration_refused" and "pending" in entry["refused"]


def test_the_head_meets_the_stages_and_records_the_migration(tmp_path: Path) -> None:
    head = FakeHead(tmp_path)
    t = torch.ones(2)

    def msg(stage: int, step: str, **more: Any) -> Message:
        fields = {"rid": stage, "job": "j.r1", "vw": 0, "stage": stage, "at": 8, "step": step}
        fields.update(layers=[8, 4, 4], reason="drift", **more)
        tensors = more.pop("tensors", {}) if "tensors" in more else {}
        return Message(Kind.MIGRATE, fields, tensors)

    async def main() -> None:
        move = {"move": [6, 8, 1, 0], "meta": {"x": 1}, "names": ["param/7.weight"]}
        await head._on_migrate(b"a", msg(0, "parcels", parcels=[]))
        m1 = msg(1, "parcels", parcels=[move])
        m1.tensors["0/param/7.weight"] = t
        await head._on_migrate(b"b", m1)
        assert head.sent == []  # parked until every stage came
        await head._on_migrate(b"c", msg(2, "parcels", parcels=[]))
        replies = {to: (f, ts) for _k, f, ts, to in head.sent}
        assert replies[b"a"][0]["info"]["parcels"] == [move]
        assert replies[b"a"][1]["0/param/7.weight"] is t
        assert replies[b"b"][0]["info"]["parcels"] == []
        head.sent.clear()
        for s, d in enumerate(b"abc"):
            await head._on_migrate(bytes([d]), msg(s, "verdict:0"))
        assert [f["info"]["refusal"] for _k, f, _t, _to in head.sent] == [None] * 3

    asyncio.run(main())
    (entry,) = head.js.migrations
    assert (entry["event"], entry["at"], entry["layers"]) == ("migration", 8, [8, 4, 4])
    assert [(s.first, s.last) for s in head.js.plan.vws[0].stages] == [(0, 8), (8, 12), (12, 16)]
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line)["event"] == "migration"
