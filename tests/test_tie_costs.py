"""The planner and ties (a tensor several layers share, GPT's embedding and output head): the
profile says which layers share which tensor; a stage counts it once however many of its
layers use it, and every stage holding a copy counts it in full, as the runtime's accounting
does; a tie spanning stages is priced (the async copies' push and pull per wave, the sync
gradient sums along the links per iteration), so the split keeps a tie on one stage where
that is as fast and spans it where that pays; the bytes the planner prices on each link are
the bytes the runtime sends there."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
from typing import Any

import pytest
import torch
from conftest import job
from helpers import InlineExecutor, StandInCompute

from hetpipe import carry
from hetpipe.config import (
    ClusterConfig,
    DeviceSpec,
    NetworkSpec,
    NodeSpec,
    RuntimeSpec,
    ShardSpec,
)
from hetpipe.core.layout import StageLayout
from hetpipe.core.memory import stage_memory_of
from hetpipe.core.profile import LayerProfile, ModelProfile, TieProfile
from hetpipe.data import MinibatchStream, load_data
from hetpipe.hostcopy import HostCopier
from hetpipe.job import JobSpec
from hetpipe.measure import measure_layers, ties_of
from hetpipe.models import build_model
from hetpipe.optim import StageOptimizer
from hetpipe.pipeline import StageRunner
from hetpipe.planner.partition import CostModel, Partition, brute_force
from hetpipe.planner.predict import stage_costs
from hetpipe.planner.profile import ProfileStore, synthetic_profile
from hetpipe.planner.runtime import RuntimeCosts
from hetpipe.planner.simulate import SimStage, SimVW, simulate
from hetpipe.planner.syncmodel import SyncModel
from hetpipe.planner.syncplan import sync_plan
from hetpipe.stage import StageCompute
from hetpipe.task import StageTask
from hetpipe.wire import Kind, Message

GIB = 1 << 30
TIE = "0.weight"  # tied_gpt: the embedding's weight, the head's too


def dev(i: int, memory: int = GIB, node: str = "n0") -> DeviceSpec:
    return DeviceSpec(f"d{i}", "cpu", "t", memory, 1.0, 0, node, "127.0.0.1")


def profile(times: list[float], params: int, ties: tuple[TieProfile, ...]) -> ModelProfile:
    """Layers of ``times`` (forward a third, backward two thirds), ``params`` bytes each."""
    layers = tuple(LayerProfile(t / 3, 2 * t / 3, params, 0, 1000, 1000, 2000) for t in times)
    return ModelProfile("m", 8, 1000, {"t": layers}, {}, ties)


def bw(gbps: float) -> Any:
    return lambda _a, _b: gbps * 1e9 / 8


# -- the profile ---------------------------------------------------------------------------


def test_the_profile_keeps_the_ties(tmp_path: Any) -> None:
    """The worker's profile of a tied model names the tie (its layers, its bytes); the
    profile store and the profile's dict keep it; a profile without ties loads with none."""
    (tie,) = ties_of(build_model("usermodels:tied_gpt"))
    assert tie == TieProfile(TIE, (0, 4), 17 * 16 * 4)
    assert ties_of(build_model("usermodels:tied_mlp")) == (TieProfile("3.weight", (3, 5), 4096),)
    assert ties_of(build_model("mlp")) == ()
    prof = profile([1.0] * 5, 4352, (tie,))
    assert ModelProfile.from_dict(prof.to_dict()) == prof
    assert prof.scaled(16).ties == (tie,)
    store = ProfileStore(tmp_path / "p.json")
    store.put("k", 8, "t", prof.layers["t"], input_bytes=1000, ties=[tie])
    store.save()
    assert ProfileStore(tmp_path / "p.json").model_profile("k", 8).ties == (tie,)
    store.put("plain", 8, "t", prof.layers["t"], input_bytes=1000)
    assert store.model_profile("plain", 8).ties == ()
    with pytest.raises(ValueError, match="uses layer 7 of 5"):
        profile([1.0] * 5, 10, (TieProfile("x", (0, 7), 4),))


def test_tie_link_bytes_follow_the_runtime_route() -> None:
    """Each copy's sum crosses every link between the first and last holder: up the sums of
    the holders before the link, down those after it."""
    prof = profile([1.0] * 6, 100, (TieProfile("a", (0, 5), 64), TieProfile("b", (1, 2), 8)))
    assert prof.tie_link_bytes([(0, 6)]) == []
    assert prof.tie_link_bytes([(0, 1), (1, 5), (5, 6)]) == [(64, 64), (64, 64)]
    # "b" spans stages 0 and 1 here, "a" stages 0 and 3
    assert prof.tie_link_bytes([(0, 2), (2, 3), (3, 5), (5, 6)]) == [(72, 72), (64, 64), (64, 64)]
    # "b" spans stages 1 and 2, "a" stages 0 and 2
    assert prof.tie_link_bytes([(0, 1), (1, 2), (2, 6)]) == [(64, 64), (72, 72)]
    assert prof.tie_link_bytes([(0, 3), (3, 6)]) == [(64, 64)]  # "b" on one stage
    three = profile([1.0] * 6, 100, (TieProfile("c", (0, 2, 5), 10),))
    assert three.tie_link_bytes([(0, 1), (1, 3), (3, 6)]) == [(10, 20), (20, 10)]
    assert three.spanning([(0, 1), (1, 3), (3, 6)]) == {"c": [0, 1, 2]}


# -- memory --------------------------------------------------------------------------------


def test_a_stage_counts_a_tie_once_and_every_copy_in_full() -> None:
    prof = profile([1.0] * 5, 1000, (TieProfile("w", (0, 4), 600),))
    one = stage_memory_of(prof, "t", (0, 5), 0, 1, 1, 2)
    assert one.params == 5 * 1000 - 600 and one.optimizer == 2 * one.params
    first = stage_memory_of(prof, "t", (0, 2), 0, 2, 1, 2)
    last = stage_memory_of(prof, "t", (2, 5), 1, 2, 1, 2)
    assert (first.params, last.params) == (2000, 3000)  # the copy in full on both
    cm = CostModel(prof, bw(10), 2)
    for a, b in itertools.combinations(range(6), 2):
        for pos, k in ((0, 2), (1, 2)):
            want = stage_memory_of(prof, "t", (a, b), pos, k, 2, 2)
            assert cm.stage_memory("t", a, b, pos, k, 2) == want
            assert int(cm.memory_total("t", 2 if pos == 0 else 1)[a, b]) == want.total
    sync = SyncModel(prof, [dev(0), dev(1)], bw(10), 4, 2)
    for a, b in itertools.combinations(range(6), 2):
        want = stage_memory_of(prof, "t", (a, b), 1, 2, 4, 2, "1f1b")
        assert sync._memory_matrix(0, 1, 2, "1f1b")[a, b] == want.total


def accounted(computes: list[StageCompute], nm: int, spec: JobSpec) -> list[Any]:
    """Run the async order (Nm forwards ahead at the first stage, the last stage's backward
    right after its forward) until the first stage holds Nm minibatches of Nm weight
    versions and both stages two waves' updates, and the last one minibatch in flight; then
    each stage's accounting."""
    data = load_data(spec.data.name, spec.data.args)
    stream = MinibatchStream(data, spec.minibatch, 0, 0, 1)
    first, last = computes
    acts: dict[int, Any] = {}

    def through_last(q: int) -> None:
        _, y = stream.batch(q)
        last.forward(q, carry.mapped(acts.pop(q), lambda t: t.detach().clone()), y)
        grad = last.backward(q, None)
        last.step(q)
        first.backward(q, grad)
        first.step(q)

    for p in range(nm):
        acts[p] = first.forward(p, *stream.batch(p))
    for p in range(nm, 2 * nm + 1):
        through_last(p - nm)
        acts[p] = first.forward(p, *stream.batch(p))
    q = nm + 1
    _, y = stream.batch(q)
    last.forward(q, carry.mapped(acts[q], lambda t: t.detach().clone()), y)
    assert len(first.in_flight) == nm and len(last.in_flight) == 1
    assert sorted(first.acc) == sorted(last.acc) == [0, 1]
    return [c.memory() for c in computes]


def tied_spec(nm: int) -> JobSpec:
    d = job("unit", model="usermodels:tied_gpt", minibatch=8, minibatches=24, nm=nm, seed=3)
    d["data"] = {
        "name": "synthetic",
        "args": {"kind": "tokens", "seq": 8, "vocab": 17, "n_train": 64, "n_test": 16},
    }
    return JobSpec.from_dict(d)


@pytest.mark.parametrize("cut", [None, 2])
def test_runtime_accounting_of_a_tie_equals_the_planner(cut: int | None) -> None:
    """``tied_gpt`` on one stage (the tie used by its first and last layer) and cut so that the
    tie spans both stages (the last holds a copy): each real stage's accounting equals the
    planner's figure for its layers, term by term, from the profiler's layers and ties."""
    nm = 2
    spec = tied_spec(nm)
    torch.manual_seed(3)
    state = build_model(spec.model.name, spec.model.args).state_dict()
    n = 5
    bounds = [(0, n)] if cut is None else [(0, cut), (cut, n)]
    ties = {} if cut is None else {TIE: [0, 1]}
    cpu = DeviceSpec("gpu0", "cpu", "fast", GIB, 1.0, 0, "node0", "127.0.0.1")
    computes = []
    for s, (a, b) in enumerate(bounds):
        task = StageTask.standalone(
            "unit",
            spec.to_dict(),
            StageLayout(("gpu0",), a, b),
            stage=s,
            k=len(bounds),  # the whole model: its own last stage, as test_core_memory's
            nm=nm,
            minibatches=24,
            ties=ties,
        )
        c = StageCompute(task, cpu)
        names = c.state_names()
        c.load({k: state[k] for k in names}, {k: [] for k in names})
        computes.append(c)
    data = load_data(spec.data.name, spec.data.args)
    x, _ = MinibatchStream(data, spec.minibatch, 0, 0, 1).batch(0)
    torch.manual_seed(3)
    model = build_model(spec.model.name, spec.model.args)
    # as test_core_memory measures: the runtime's accounting counts the layers' tensors,
    # not what the loss saves
    layers = measure_layers(model, x, repeats=3, warmup=1)
    prof = ModelProfile("tied_gpt", 8, carry.nbytes(x), {"fast": layers}, {}, ties_of(model))
    factor = StageOptimizer.state_factor(spec.optimizer)
    if cut is None:
        got = [_whole_stage_memory(computes[0], nm, spec)]
        want = [stage_memory_of(prof, "fast", (0, n), 0, 2, nm, factor)]
        assert want[0].params == sum(t.numel() * 4 for t in model.parameters())  # the tie once
    else:
        got = accounted(computes, nm, spec)
        want = [
            stage_memory_of(prof, "fast", ab, pos, 2, nm, factor) for pos, ab in enumerate(bounds)
        ]
        tie_bytes = state[TIE].numel() * 4
        assert want[1].params == tie_bytes + sum(
            state[f"2.{w}"].numel() * 4 for w in ("weight", "bias")
        )
    assert [g.to_dict() for g in got] == [w.to_dict() for w in want]


def _whole_stage_memory(compute: StageCompute, nm: int, spec: JobSpec) -> Any:
    """The whole model as the first stage of two (Nm in flight, as test_core_memory's)."""
    data = load_data(spec.data.name, spec.data.args)
    stream = MinibatchStream(data, spec.minibatch, 0, 0, 1)
    for p in range(nm):
        compute.forward(p, *stream.batch(p))
    for p in range(nm, 2 * nm + 1):
        q = p - nm
        compute.backward(q, None)
        compute.step(q)
        compute.forward(p, *stream.batch(p))
    return compute.memory()


# -- the split -----------------------------------------------------------------------------


def test_an_equally_fast_split_keeping_the_tie_on_one_stage_is_chosen() -> None:
    """Layer 0 bounds every split of three stages at 10; two splits reach it with the same
    latency, one keeps the tie of layers 2 and 3 on one stage, one spans it: the planner
    takes the one that keeps it, at the bottleneck of the model without the tie."""
    tie = TieProfile("w", (2, 3), 4 << 20)
    devices = [dev(0), dev(1), dev(2)]
    for nm in (1, 3):
        plain = CostModel(profile([10, 1, 1, 1], 1 << 20, ()), bw(10), 1).partition(devices, nm)
        tied = CostModel(profile([10, 1, 1, 1], 8 << 20, (tie,)), bw(10), 1)
        p = tied.partition(devices, nm)
        assert isinstance(p, Partition) and isinstance(plain, Partition)
        assert p.cuts == ((0, 1), (1, 2), (2, 4)) and p.bottleneck == plain.bottleneck
        assert p.stage_times == tuple(tied.describe(devices, p.cuts, nm).stage_times)
        spans = tied.describe(devices, ((0, 1), (1, 3), (3, 4)), nm)
        assert spans.stage_times[2] > tied.stage_time("t", 3, 4, bw(10)(0, 0), None)


def test_a_tie_spans_stages_where_that_is_much_faster_and_its_cost_is_in_the_time() -> None:
    """The tie of layers 1 and 2 is in the two heavy layers: keeping it on one stage puts
    both there. Spanning it halves the bottleneck, and the stage holding the copy pays its
    push and pull each wave; where the link is slow enough that this outweighs the gain,
    the split keeps the tie."""
    tie = TieProfile("w", (1, 2), 64 << 20)
    prof = profile([1, 10, 10, 1], 80 << 20, (tie,))
    devices = [dev(0), dev(1)]
    for nm in (1, 2):
        fast = CostModel(prof, bw(100), 1)
        p = fast.partition(devices, nm)
        assert isinstance(p, Partition) and p.cuts == ((0, 2), (2, 4))
        link = bw(100)(0, 0)
        plain_last = fast.stage_time("t", 2, 4, link, None)
        copy = 2 * (64 << 20) / link / nm
        assert p.stage_times[1] == pytest.approx(plain_last + copy, rel=1e-12)
        assert fast.tie_time(2, 4, link, nm) == pytest.approx(copy)
        assert fast.tie_time(0, 2, None, nm) == 0.0 and fast.tie_time(3, 4, link, nm) == 0.0
        slow = CostModel(prof, bw(0.001), 1).partition(devices, nm)
        assert isinstance(slow, Partition) and slow.cuts in (((0, 1), (1, 4)), ((0, 3), (3, 4)))


@pytest.mark.parametrize("seed", range(40))
def test_the_split_with_ties_equals_brute_force(seed: int) -> None:
    """The DP's split with ties (memory counted once per stage, the copies' cost) is the
    brute force's optimum: the same bottleneck and latency, exactly."""
    r = random.Random(seed)
    n = r.randint(4, 8)
    groups = [tuple(sorted(r.sample(range(n), r.randint(2, 3)))) for _ in range(r.randint(1, 2))]
    prof = synthetic_profile(n, {"t": 1.0}, seed, ties=groups, param_bytes=(4 << 20, 32 << 20))
    k = r.randint(2, min(4, n))
    mem = r.choice([GIB, 160 << 20, 96 << 20])
    devices = [dev(i, mem, node=f"n{i % 2}") for i in range(k)]
    gbps = r.choice([0.1, 1.0, 10.0])
    nm = r.randint(1, 3)
    got = CostModel(prof, bw(gbps), 1).partition(devices, nm)
    want = brute_force(prof, devices, nm, bw(gbps), 1)
    assert bool(got) == bool(want)
    if isinstance(got, Partition) and isinstance(want, Partition):
        assert (got.bottleneck, got.latency) == (want.bottleneck, want.latency)
        assert [m.total for m in got.memory] == [
            stage_memory_of(prof, "t", ab, i, k, nm, 1).total for i, ab in enumerate(got.cuts)
        ]


# -- synchronous schedules -----------------------------------------------------------------


def test_sync_iteration_includes_the_tie_exchange_and_keeps_the_tie_where_as_good() -> None:
    """The synchronous model adds the ties' gradient sums along the links to the iteration;
    with a slow link it keeps the tie on one stage, with a fast one it spans it where
    that is much faster."""
    tie = TieProfile("w", (1, 2), 64 << 20)
    prof = profile([1e-3, 10e-3, 10e-3, 1e-3], 80 << 20, (tie,))
    fast = SyncModel(prof, [dev(0), dev(1)], bw(100), 4, 1, kinds=("1f1b",))
    cut, spans = ((0, 2), (2, 4)), ((0, 1), (1, 4))
    link = bw(100)(0, 0)
    hop = (64 << 20) / link  # one sum each way over the one link
    assert fast.tie_bytes(cut) == [(64 << 20, 64 << 20)] and fast.tie_bytes(spans) == [(0, 0)]
    assert fast.tie_exchange_s((0, 1), cut) == pytest.approx(hop)
    assert fast.tie_exchange_s((0, 1), spans) == 0.0
    plain = SyncModel(
        profile([1e-3, 10e-3, 10e-3, 1e-3], 80 << 20, ()), [dev(0), dev(1)], bw(100), 4, 1
    )
    assert fast.unchecked((0, 1), cut, "1f1b") == pytest.approx(
        plain.unchecked((0, 1), cut, "1f1b") + hop
    )
    best = fast.best_cuts((0, 1), "1f1b")
    assert best is not None and best[1] == cut
    # room for a stage of three layers' step (six times its weights: the held update too)
    roomy = [dev(0, 2 * GIB), dev(1, 2 * GIB)]
    slow = SyncModel(prof, roomy, bw(0.01), 4, 1, kinds=("1f1b",))
    best = slow.best_cuts((0, 1), "1f1b")
    assert best is not None and best[1] in (spans, ((0, 3), (3, 4)))


# -- the bytes the runtime sends -----------------------------------------------------------


def exchanged(k: int, ties: dict[str, list[int]], shapes: dict[str, tuple[int, ...]]) -> list:
    """Run the synchronous tie exchange of one iteration on ``k`` stage runners wired to each
    other in process: the bytes each link carried up and down."""
    runners: list[StageRunner] = []
    carried = [[0, 0] for _ in range(k - 1)]

    def make(s: int) -> StageRunner:
        compute = StandInCompute("1f1b", k, s, 2, 4)
        compute.task = dataclasses.replace(compute.task, ties=ties)
        copier = HostCopier("cpu")
        own = {t: torch.ones(shapes[t]) for t in compute.task.tied}
        compute.tie_gradients = lambda: copier.to_host(own)  # type: ignore[attr-defined]
        compute.sum_tied = lambda sums: None  # type: ignore[attr-defined]

        async def send(kind: str, i: int, tensors: dict, *_more: Any) -> None:
            fields = _more[-1] if _more else {}
            to = s + 1 if kind == Kind.ACT else s - 1
            carried[min(s, to)][0 if kind == Kind.ACT else 1] += sum(
                carry.nbytes(t) for t in tensors.values()
            )
            runners[to].on_message(Message(kind, {"p": i, **fields}, dict(tensors)))
            runners[to].wakeup.set()

        async def nothing(*_args: Any) -> None:
            pass

        return StageRunner(
            compute,
            InlineExecutor(),
            send=send,
            shards={},  # type: ignore[arg-type]
            report=nothing,
            stream=None,
        )

    runners.extend(make(s) for s in range(k))

    async def all_of_them() -> None:
        await asyncio.wait_for(asyncio.gather(*(r._exchange(0) for r in runners)), 10)

    asyncio.run(all_of_them())
    return [tuple(c) for c in carried]


@pytest.mark.parametrize(
    ("layers", "tie_layers"),
    [([1, 1, 2, 1], (0, 4)), ([2, 3], (0, 4)), ([1, 2, 2], (0, 4)), ([2, 1, 1, 1], (0, 2, 4))],
)
def test_planned_tie_bytes_are_the_bytes_sent(layers: list[int], tie_layers: tuple) -> None:
    """Per link, the bytes of the ties' gradient sums the planner prices an iteration at are
    the bytes the runtime's exchange sends there."""
    shape = (17, 16)
    bounds = list(itertools.pairwise(itertools.accumulate(layers, initial=0)))
    prof = profile([1.0] * 5, 2000, (TieProfile(TIE, tie_layers, 17 * 16 * 4),))
    ties = prof.spanning(bounds)
    assert ties  # the cut spans the tie
    assert exchanged(len(layers), ties, {TIE: shape}) == prof.tie_link_bytes(bounds)


def test_the_async_prediction_charges_the_copy_each_wave() -> None:
    """The prediction the plan reports (:func:`predict.stage_costs`) adds the copy's push and
    pull to its stage's per-wave push, and a stage holding every layer of a tie pushes the
    tensor once."""
    tie = TieProfile("w", (1, 2), 64 << 20)
    rt = RuntimeCosts()  # the runtime's own costs: a push's bytes take time
    tied = CostModel(profile([1, 10, 10, 1], 80 << 20, (tie,)), bw(10), 1, rt)
    plain = CostModel(profile([1, 10, 10, 1], 80 << 20, ()), bw(10), 1, rt)
    devices = [dev(0), dev(1)]
    spans = tied.describe(devices, ((0, 2), (2, 4)), 2)
    got = stage_costs(tied, devices, spans, vws=1, shards=1)
    want = stage_costs(plain, devices, plain.describe(devices, spans.cuts, 2), vws=1, shards=1)
    assert got[0].push_s == want[0].push_s
    link = bw(10)(0, 0)
    copy = 2 * ((64 << 20) / link + rt.message_s + (64 << 20) * rt.message_byte_s)
    assert tied.tie_time(2, 4, link, 1) == pytest.approx(copy)
    assert got[1].push_s == pytest.approx(want[1].push_s + copy)
    # both hold the tie: they pull every wave, alone too (SimStage.tied)
    assert [c.tied for c in got] == [True, True] and all(c.pull_s > 0 for c in got)
    assert [c.tied for c in want] == [False, False] and all(c.pull_s == 0 for c in want)
    keeps = ((0, 3), (3, 4))
    got = stage_costs(tied, devices, tied.describe(devices, keeps, 2), vws=1, shards=1)
    want = stage_costs(plain, devices, plain.describe(devices, keeps, 2), vws=1, shards=1)
    assert got[0].push_s < want[0].push_s and got[1].push_s == want[1].push_s


def two_fast_devices() -> ClusterConfig:
    devs = tuple(
        DeviceSpec(f"gpu{i}", "cpu", "t", GIB, 1.0, 7200 + i, "node0", "127.0.0.1")
        for i in range(2)
    )
    return ClusterConfig(
        "c.toml",
        (ShardSpec(0, "127.0.0.1", 7100),),
        NetworkSpec(100.0, 10.0, ()),
        (NodeSpec("node0", "127.0.0.1", devs),),
        RuntimeSpec(),
    )


def test_a_sync_plan_spans_a_tie_where_much_faster_and_predicts_its_exchange() -> None:
    """The two heavy layers share a tensor: the synchronous plan still splits them over two
    devices (faster than one, the exchange paid), its predicted iteration holds the tie's
    exchange, and its details the bytes each link carries, as the runtime sends them."""
    nbytes = 8 << 20
    times = [1e-3, 20e-3, 20e-3, 1e-3]
    tied = profile(times, 16 << 20, (TieProfile("w", (1, 2), nbytes),))
    plain = profile(times, 16 << 20, ())
    cluster = two_fast_devices()
    kw: dict[str, Any] = {"minibatch": 8, "m": 4, "optimizer_state_factor": 1, "kind": "1f1b"}
    plan = sync_plan(cluster, tied, budget_s=2, **kw)
    (vw,) = plan.vws
    assert [s.layers for s in vw.stages] == [(0, 2), (2, 4)]
    assert plan.details["tie_bytes"] == [[(nbytes, nbytes)]]
    given = [(["gpu0", "gpu1"], [2, 2])]
    with_tie = sync_plan(cluster, tied, vws=given, **kw)
    without = sync_plan(cluster, plain, vws=given, **kw)
    usable = list(cluster.devices)
    model = SyncModel(
        tied, usable, cluster.network.bytes_per_s, 4, 1, RuntimeCosts().with_runtime(cluster)
    )
    exchange = model.tie_exchange_s((0, 1), ((0, 2), (2, 4)))
    assert exchange > nbytes / cluster.network.bytes_per_s(usable[0], usable[1])
    assert with_tie.iteration_s == pytest.approx(without.iteration_s + exchange, rel=1e-9)
    assert plan.iteration_s == pytest.approx(with_tie.iteration_s, rel=1e-9)
    one = sync_plan(cluster, tied, vws=[(["gpu0"], [4])], **kw)
    assert one.iteration_s > plan.iteration_s and one.details["tie_bytes"] == [[]]


def test_a_lone_async_virtual_worker_with_a_spanning_tie_waits_at_each_wave() -> None:
    """The simulator follows the runtime: a stage holding a tie's copy pulls every wave,
    alone in its job after every stage's push of the wave before; so stage 0 starts no wave
    before the previous wave's minibatches are done everywhere, where an untied pipeline
    keeps Nm in flight across waves."""
    nm, n = 2, 16

    def vw(tied: bool) -> SimVW:
        stages = tuple(SimStage(1.0, 2.0, tied=tied) for _ in range(2))
        return SimVW(stages, nm, schedule="async")

    free = simulate([vw(False)], 0, n, record=True)
    held = simulate([vw(True)], 0, n, record=True)
    assert held.makespan_s > free.makespan_s * 1.2

    def gaps(result: Any) -> list[float]:
        """Per wave c >= 1: stage 0's forward of its first minibatch, less the end of stage
        0's backward of the wave before's last (its last action on it, 2 s long)."""
        first = {(type(a).__name__, getattr(a, "p", None)): t for t, a in result.actions[0][0]}
        return [
            first[("Forward", c * nm)] - (first[("Backward", c * nm - 1)] + 2.0)
            for c in range(1, n // nm)
        ]

    assert min(gaps(held)) >= 0.0  # the wave before is done everywhere first
    assert min(gaps(free)) < 0.0  # Nm in flight across waves
