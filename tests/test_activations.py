"""Per-layer activation policies (keep / recompute / swap) and the one memory model they share.

A recomputed or swapped layer must be invisible in the results (same dropout masks, batch-norm
statistics moved once per minibatch) and visible in the memory a stage keeps, counted in
the planner's own terms.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from conftest import assert_same_weights, job

from hetpipe.config import DeviceSpec
from hetpipe.core.layout import StageLayout
from hetpipe.core.memory import (
    MemoryCapError,
    activation_bytes,
    copy_seconds,
    stage_memory_of,
    swap_seconds,
    unhidden_swap_s,
    working_bytes,
)
from hetpipe.data import MinibatchStream, load_dataset
from hetpipe.job import JobSpec
from hetpipe.measure import measure_layers
from hetpipe.models import build_model
from hetpipe.planner.partition import CostModel, Infeasible, Partition
from hetpipe.planner.profile import LayerProfile, ModelProfile
from hetpipe.stage import StageCompute
from hetpipe.task import StageTask


def device(memory: int = 1 << 30, host_gbps: float = 96.0) -> DeviceSpec:
    return DeviceSpec("gpu0", "cpu", "fast", memory, 1.0, 0, "node0", "127.0.0.1", host_gbps)


def whole_stage(
    model: str,
    recompute: list[int],
    *,
    nm: int = 3,
    memory: int = 1 << 30,
    seed: int = 3,
    swap: list[int] | None = None,
    host_gbps: float = 96.0,
) -> StageCompute:
    """One stage holding the whole model (so also the loss), initial weights loaded."""
    spec = JobSpec.from_dict(job("unit", model=model, minibatches=12, nm=nm, seed=seed))
    n = len(build_model(spec.model.name, spec.model.args))
    task = StageTask.standalone(
        "unit",
        spec.to_dict(),
        StageLayout(("gpu0",), 0, n, recompute=tuple(recompute), swap=tuple(swap or [])),
        nm=nm,
        minibatches=12,
    )
    compute = StageCompute(task, device(memory, host_gbps))
    torch.manual_seed(seed)
    state = build_model(spec.model.name, spec.model.args).state_dict()
    names = compute.state_names()
    compute.load({k: state[k] for k in names}, {k: [] for k in names})
    return compute


def train(compute: StageCompute, steps: int, nm: int = 3) -> None:
    """Async order with ``nm`` in flight: forwards run ahead of backwards, so a recompute
    happens after other minibatches' forwards reseeded the generators."""
    stream = MinibatchStream(load_dataset("digits"), 32, 0, 0, 1)
    for p in range(steps + nm - 1):
        if p < steps:
            compute.forward(p, *stream.batch(p))
        q = p - nm + 1
        if q >= 0:
            compute.backward(q, None)
            compute.step(q)


def n_layers(model: str) -> int:
    return len(build_model(model))


@pytest.mark.parametrize("model", ["usermodels:dropout_mlp", "cnn"])
def test_recompute_is_transparent(model: str) -> None:
    """Every layer recomputed: the same weights and batch-norm statistics as keeping them,
    dropout included, with several minibatches in flight."""
    keep = whole_stage(model, [])
    again = whole_stage(model, list(range(n_layers(model))))
    train(keep, 8)
    train(again, 8)
    assert_same_weights(again.state_dict(), keep.state_dict(), tol=1e-6)
    want_losses, got_losses = keep.read_losses(block=True), again.read_losses(block=True)
    assert [p for p, _ in want_losses] == list(range(8))
    assert [p for p, _ in got_losses] == list(range(8))
    assert [v for _, v in want_losses] == pytest.approx([v for _, v in got_losses], abs=1e-6)


def test_recompute_keeps_less_and_the_cap_counts_what_is_kept() -> None:
    """The activations term counts only what a recomputed layer keeps (its input), so a cap
    that refuses the kept job admits the recomputed one."""
    model = "usermodels:dropout_mlp"
    keep = whole_stage(model, [])
    again = whole_stage(model, list(range(n_layers(model))))
    stream = MinibatchStream(load_dataset("digits"), 32, 0, 0, 1)
    for p in range(3):
        keep.forward(p, *stream.batch(p))
        again.forward(p, *stream.batch(p))
    k, r = keep.memory(), again.memory()
    # from the first forward on, which also measures the layers
    assert all(again.in_flight[p].kept_bytes < keep.in_flight[p].kept_bytes for p in range(3))
    assert r.activations < k.activations
    assert (k.params, k.stash) == (r.params, r.stash)
    cap = (k.total + r.total) // 2
    tight = whole_stage(model, [], memory=cap)
    with pytest.raises(MemoryCapError, match="memory cap"):
        for p in range(3):
            tight.forward(p, *stream.batch(p))
    fits = whole_stage(model, list(range(n_layers(model))), memory=cap)
    for p in range(3):
        fits.forward(p, *stream.batch(p))
    assert fits.memory().total <= cap


@pytest.mark.parametrize("recompute", [[], [1, 3, 4]])
def test_runtime_memory_equals_the_planner_formula(recompute: list[int]) -> None:
    """With Nm minibatches in flight a stage's counted activations and working memory are
    the planner's figures for the same layers measured by the profiler."""
    model, nm = "usermodels:dropout_mlp", 3
    compute = whole_stage(model, recompute, nm=nm)
    stream = MinibatchStream(load_dataset("digits"), 32, 0, 0, 1)
    x, _ = stream.batch(0)
    torch.manual_seed(3)
    layers = measure_layers(build_model(model), x, repeats=3, warmup=1)
    profile = ModelProfile(model, 32, x.numel() * x.element_size(), {"fast": layers})
    # a stage at position 0 of 2 holds Nm in flight (the last stage of one holds one)
    want = stage_memory_of(profile, "fast", (0, len(layers)), 0, 2, nm, 1, recompute=recompute)
    # the first forward of a shape measures its layers, keeping all; the policy applies after
    compute.forward(0, *stream.batch(0))
    compute.backward(0, None)
    for p in range(1, nm + 1):
        compute.forward(p, *stream.batch(p))
    got = compute.memory()
    assert got.activations == want.activations
    assert got.working == want.working
    assert got.params == want.params


# --------------------------------------------------------------------------- the planner


# a host link so slow that swapping never beats recomputing these profiles' layers
SLOW_HOST = 1e-3


def cpu(name: str, dtype: str, memory: int, host_gbps: float = 96.0) -> DeviceSpec:
    return DeviceSpec(name, "cpu", dtype, memory, 1.0, 0, "n0", "127.0.0.1", host_gbps)


def bw(_a: DeviceSpec, _b: DeviceSpec) -> float:
    return 1e9


def activation_heavy(seed: int, layers: int = 8) -> ModelProfile:
    """Few parameters, large saved activations: what recompute is for."""
    r = random.Random(seed)
    lps = tuple(
        LayerProfile(
            r.uniform(1e-3, 4e-3),
            r.uniform(2e-3, 8e-3),
            r.randint(1, 8) * 1000,
            0,
            r.randint(2, 20) * 1000,
            r.randint(20, 200) * 1000,
            r.randint(2, 20) * 1000,
        )
        for _ in range(layers)
    )
    return ModelProfile("heavy", 32, 8000, {"t": lps})


def brute_force_auto(
    model: CostModel, prof: ModelProfile, devs: list[DeviceSpec], nm: int, weights: str = "stash"
) -> float | None:
    """Every split and, per stage short of memory, every run to recompute and every set of
    layers to swap, priced by the single formula (:func:`stage_memory_of`) and the stage
    time plus one more forward or the swap's unhidden copies."""
    k, L = len(devs), prof.n_layers()
    lps = prof.layers["t"]
    best = None
    for inner in itertools.combinations(range(1, L), k - 1):
        times = []
        for i, (a, b) in enumerate(itertools.pairwise((0, *inner, L))):
            d = devs[i]
            base = model.stage_time("t", a, b, 1e9 if i > 0 else None, 1e9 if i < k - 1 else None)
            keep = stage_memory_of(prof, "t", (a, b), i, k, nm, 1, weights=weights)
            options = (
                [0.0]
                if keep.total <= d.memory
                else [
                    sum(lp.fwd_s for lp in lps[c:e])
                    for c in range(a, b)
                    for e in range(c + 1, b + 1)
                    if stage_memory_of(
                        prof, "t", (a, b), i, k, nm, 1, weights=weights, recompute=range(c, e)
                    ).total
                    <= d.memory
                ]
                + [
                    unhidden_swap_s(
                        copy_seconds(sum(lps[j].saved_bytes for j in swap), d.host_gbps),
                        sum(lp.fwd_s for lp in lps[a:b]),
                        sum(lp.bwd_s for lp in lps[a:b]),
                    )
                    for n in range(1, b - a + 1)
                    for swap in itertools.combinations(range(a, b), n)
                    if keep.total > d.memory
                    and stage_memory_of(
                        prof, "t", (a, b), i, k, nm, 1, weights=weights, swap=swap
                    ).total
                    <= d.memory
                ]
            )
            if not options:
                break
            times.append(base + min(options))
        else:
            if best is None or max(times) < best:
                best = max(times)
    return best


@pytest.mark.parametrize("host_gbps", [SLOW_HOST, 96.0])
@pytest.mark.parametrize("shares", [(0.2, 0.2, 0.3), (0.3, 0.3, 0.4)])
@pytest.mark.parametrize("seed", range(12))
def test_auto_plans_what_keep_cannot_and_matches_brute_force(
    seed: int, shares: tuple[float, ...], host_gbps: float
) -> None:
    """Caps at shares of what keeping every activation of Nm minibatches needs: the tighter
    ones leave keep infeasible for most seeds, the looser ones let recompute (over a slow
    host link) or swap (over a fast one, whose copies the compute hides) rebalance. The
    brute force tries every swapped set: where the copies hide, auto's smallest-first set
    is as good as any (the full set frees the most, so some prefix fits whenever any set
    does)."""
    prof = activation_heavy(seed)
    nm = 3
    keep_need = sum(lp.saved_bytes for lp in prof.layers["t"]) * nm
    devs = [cpu(f"g{i}", "t", int(keep_need * f), host_gbps) for i, f in enumerate(shares)]
    keep = CostModel(prof, bw, 1, activations="keep").partition(devs, nm)
    auto_model = CostModel(prof, bw, 1, activations="auto")
    auto = auto_model.partition(devs, nm)
    want = brute_force_auto(auto_model, prof, devs, nm)
    if want is None:
        assert isinstance(auto, Infeasible)
        return
    assert isinstance(auto, Partition)
    assert auto.bottleneck == pytest.approx(want, rel=1e-9)
    swaps = auto.swap or ((),) * len(devs)
    for i, (d, (a, b)) in enumerate(zip(devs, auto.cuts, strict=True)):
        mem = stage_memory_of(
            prof, "t", (a, b), i, 3, nm, 1, recompute=auto.recompute[i], swap=swaps[i]
        )
        assert mem == auto.memory[i] and mem.total <= d.memory
        assert auto.keep_memory[i] == stage_memory_of(prof, "t", (a, b), i, 3, nm, 1)
        assert not (auto.recompute[i] and swaps[i])  # one policy per stage
        if auto.recompute[i] or swaps[i]:  # only where keeping does not fit
            assert auto.keep_memory[i].total > d.memory
    if host_gbps == SLOW_HOST:
        assert not any(swaps)
    if isinstance(keep, Partition):
        assert auto.bottleneck <= keep.bottleneck
    else:
        assert any(auto.recompute) or any(swaps)


@pytest.mark.parametrize("weights", ["latest", "predict", "predict-consistent"])
@pytest.mark.parametrize("seed", range(6))
def test_auto_knows_the_weights_mode(seed: int, weights: str) -> None:
    """One formula for the weights mode and the activation policy together: where the
    backward reruns the forward (latest) only one minibatch's kept tensors count (a
    recompute then only moves them into the working term, so auto keeps); predict keeps
    every in-flight minibatch's graph (paper: and a recomputed run's predicted weights), so
    auto recomputes; and auto's choice is the brute-force optimum priced by
    stage_memory_of."""
    prof = activation_heavy(seed)
    nm = 3
    keep_need = sum(lp.saved_bytes for lp in prof.layers["t"]) * nm
    devs = [cpu(f"g{i}", "t", int(keep_need * f), SLOW_HOST) for i, f in enumerate((0.2, 0.2, 0.3))]
    model = CostModel(prof, bw, 1, weights=weights, activations="auto")
    auto = model.partition(devs, nm)
    want = brute_force_auto(model, prof, devs, nm, weights)
    if want is None:
        assert isinstance(auto, Infeasible)
        return
    assert isinstance(auto, Partition)
    assert auto.bottleneck == pytest.approx(want, rel=1e-9)
    for i, (d, (a, b)) in enumerate(zip(devs, auto.cuts, strict=True)):
        mem = stage_memory_of(
            prof, "t", (a, b), i, 3, nm, 1, weights=weights, recompute=auto.recompute[i]
        )
        assert mem == auto.memory[i] and mem.total <= d.memory
    if weights == "latest":
        assert not any(auto.recompute)
    else:
        assert any(auto.recompute)  # every in-flight minibatch's activations: tight


def test_auto_is_keep_when_everything_fits() -> None:
    prof = activation_heavy(0)
    devs = [cpu(f"g{i}", "t", 1 << 30) for i in range(3)]
    keep = CostModel(prof, bw, 1).partition(devs, 3)
    auto = CostModel(prof, bw, 1, activations="auto").partition(devs, 3)
    assert isinstance(keep, Partition) and isinstance(auto, Partition)
    assert auto.cuts == keep.cuts and auto.bottleneck == keep.bottleneck
    assert auto.recompute == ((), (), ()) and auto.swap == ()


def test_pinned_recompute_charges_every_stage_one_more_forward() -> None:
    prof = activation_heavy(1)
    devs = [cpu(f"g{i}", "t", 1 << 30) for i in range(2)]
    model = CostModel(prof, bw, 1, activations="recompute")
    p = model.describe(devs, [(0, 4), (4, 8)], 2)
    lps = prof.layers["t"]
    assert p.recompute == (tuple(range(4)), tuple(range(4, 8)))
    for i, (a, b) in enumerate(p.cuts):
        base = model.stage_time("t", a, b, None if i == 0 else 1e9, 1e9 if i == 0 else None)
        assert p.stage_times[i] == pytest.approx(base + sum(lp.fwd_s for lp in lps[a:b]))
        assert p.memory[i].activations < p.keep_memory[i].activations


def test_make_plan_with_auto_fits_a_tight_cluster_and_shows_the_policy() -> None:
    """A model whose activations fit only recomputed: keep cannot be planned, auto can, and
    the table says per stage what is recomputed and the memory before and after."""
    from hetpipe.config import ClusterConfig, NetworkSpec, NodeSpec, RuntimeSpec, ShardSpec
    from hetpipe.planner import Plan, PlanError, make_plan

    prof = activation_heavy(3)
    need = sum(lp.saved_bytes for lp in prof.layers["t"])
    devs = tuple(
        DeviceSpec(f"gpu{i}", "cpu", "t", need, 1.0, 7200 + i, "node0", "127.0.0.1", SLOW_HOST)
        for i in range(2)
    )
    cluster = ClusterConfig(
        "cluster.toml",
        (ShardSpec(0, "127.0.0.1", 7100),),
        NetworkSpec(100.0, 10.0, ()),
        (NodeSpec("node0", "127.0.0.1", devs),),
        RuntimeSpec(),
    )
    kw = {"minibatch": 32, "staleness": 0, "optimizer_state_factor": 1, "nm": 3, "num_vws": 1}
    with pytest.raises(PlanError):
        make_plan(cluster, prof, **kw)
    plan = make_plan(cluster, prof, activations="auto", **kw)
    stages = [s for vw in plan.vws for s in vw.stages]
    assert any(s.recompute for s in stages)
    for s in stages:
        assert s.memory.total <= s.memory_cap
        assert s.keep_memory is not None
        if s.recompute:
            assert s.keep_memory.total > s.memory_cap
    table = plan.table()
    assert "activations: keep " in table and ", swap none;" in table
    assert "keeping all ->" in table
    again = Plan.from_dict(plan.to_dict())
    assert [s.recompute for vw in again.vws for s in vw.stages] == [s.recompute for s in stages]


# --------------------------------------------------------------------------- swap


@pytest.mark.parametrize("model", ["usermodels:dropout_mlp", "cnn"])
def test_swap_is_transparent(model: str) -> None:
    """Every layer swapped: the same weights, batch-norm statistics and losses as keeping
    them, dropout included, with several minibatches in flight."""
    keep = whole_stage(model, [])
    swapped = whole_stage(model, [], swap=list(range(n_layers(model))))
    train(keep, 8)
    train(swapped, 8)
    assert_same_weights(swapped.state_dict(), keep.state_dict(), tol=1e-6)
    want = [v for _, v in keep.read_losses(block=True)]
    assert [v for _, v in swapped.read_losses(block=True)] == pytest.approx(want, abs=1e-6)


def test_swap_keeps_less_on_the_device_and_the_cap_counts_it() -> None:
    """The activations term leaves out what swapped layers park in host memory, the
    working term holds room for the largest one in transit, and a cap that refuses the
    kept job admits the swapped one."""
    model = "usermodels:dropout_mlp"
    layers = list(range(n_layers(model)))
    keep = whole_stage(model, [])
    swapped = whole_stage(model, [], swap=layers)
    stream = MinibatchStream(load_dataset("digits"), 32, 0, 0, 1)
    for p in range(3):
        keep.forward(p, *stream.batch(p))
        swapped.forward(p, *stream.batch(p))
    k, s = keep.memory(), swapped.memory()
    (known,) = keep._layer_bytes.values()
    saved = known.saved
    assert all(swapped.in_flight[p].swapped == sum(saved) for p in range(3))
    # the device no longer holds what the layers save, less what it held once anyway: the
    # stage input the first layer saves, a tensor two layers save (the stage output, which
    # the last layer does not save, stays with each minibatch either way)
    assert known.saved_out[-1] == 0
    once = sum(saved) - known.saved_in[0]
    once -= sum(min(known.saved_in[j], known.saved_out[j - 1]) for j in range(1, len(saved)))
    assert 0 < once < sum(saved)
    assert s.activations == k.activations - 3 * once
    assert s.working == k.working + max(saved)
    assert s.total < k.total
    cap = (k.total + s.total) // 2
    fits = whole_stage(model, [], memory=cap, swap=layers)
    for p in range(3):
        fits.forward(p, *stream.batch(p))
    assert fits.memory().total <= cap


@pytest.mark.parametrize(("recompute", "swap"), [([], [0, 2, 5]), ([1, 3], [0, 4, 5])])
def test_runtime_memory_with_swap_equals_the_planner_formula(
    recompute: list[int], swap: list[int]
) -> None:
    """Swapped (and recomputed) layers: the runtime counts the planner's figures."""
    model, nm = "usermodels:dropout_mlp", 3
    compute = whole_stage(model, recompute, nm=nm, swap=swap)
    stream = MinibatchStream(load_dataset("digits"), 32, 0, 0, 1)
    x, _ = stream.batch(0)
    torch.manual_seed(3)
    layers = measure_layers(build_model(model), x, repeats=3, warmup=1)
    profile = ModelProfile(model, 32, x.numel() * x.element_size(), {"fast": layers})
    want = stage_memory_of(
        profile, "fast", (0, len(layers)), 0, 2, nm, 1, recompute=recompute, swap=swap
    )
    for p in range(nm):
        compute.forward(p, *stream.batch(p))
    got = compute.memory()
    assert got.activations == want.activations
    assert got.working == want.working


def test_emulated_swap_charges_the_copy_its_compute_does_not_hide() -> None:
    """At a host bandwidth so low that the copies dwarf the compute, each pass takes at
    least the copy time (the compute plus the part of the copy it does not hide)."""
    model = "usermodels:dropout_mlp"
    layers = list(range(n_layers(model)))
    stream = MinibatchStream(load_dataset("digits"), 32, 0, 0, 1)
    slow = whole_stage(model, [], swap=layers, host_gbps=1e-3)
    slow.forward(0, *stream.batch(0))
    moved = slow.in_flight[0].swapped
    copy_s = copy_seconds(moved, 1e-3)
    assert 0.05 < copy_s < 2.0, copy_s  # the bandwidth chosen makes it visible yet short
    slow.backward(0, None)
    assert slow.stats.forward_s >= copy_s
    assert slow.stats.backward_s >= copy_s


def test_swap_memory_and_time_terms() -> None:
    """Pure terms: swapped saved bytes leave the activations, one layer's stay as working
    room; the charge is what each direction's copy exceeds its compute by."""
    saved, inputs, work = [100, 40, 70, 10], [5, 6, 7, 8], [3, 3, 3, 3]
    assert activation_bytes(saved, inputs, swap=[0, 2]) == 40 + 10
    assert activation_bytes(saved, inputs, recompute=[1], swap=[0, 2]) == 6 + 10
    assert working_bytes(work, saved, swap=[0, 2]) == 3 + 100
    assert working_bytes(work, saved, recompute=[1, 2], swap=[3]) == 3 + 110 + 10
    assert swap_seconds(saved, [0, 2], 8e-9) == pytest.approx(170.0)
    assert copy_seconds(10**9, 8.0) == pytest.approx(1.0)
    assert unhidden_swap_s(1.0, 2.0, 3.0) == 0.0
    assert unhidden_swap_s(1.0, 0.25, 0.5) == pytest.approx(0.75 + 0.5)
    assert unhidden_swap_s(1.0, 0.25, 2.0) == pytest.approx(0.75)


def saved_heavy(fwd_s: float, saved: int) -> ModelProfile:
    """Four equal layers whose saved tensors dominate (parameters are tiny), two per stage."""
    lp = LayerProfile(fwd_s, 2 * fwd_s, 1000, 0, 4000, saved, 4000)
    return ModelProfile("choice", 32, 4000, {"t": (lp,) * 4})


@pytest.mark.parametrize(
    ("fwd_s", "host_gbps", "want"),
    [
        (5e-3, 96.0, "swap"),  # a layer's 250 kB at 12 GB/s: ~21 us, hidden behind 10 ms
        (1e-5, 0.08, "recompute"),
    ],  # at 10 MB/s: 25 ms each way; a forward again: 10 us
)
def test_auto_swaps_where_transfer_is_cheap_and_recomputes_where_compute_is(
    fwd_s: float, host_gbps: float, want: str
) -> None:
    """One stage that keeping cannot fit: expensive compute and a fast host link swap (the
    copies hide behind the compute, nothing added); cheap compute and a slow link
    recompute (one more forward beats the unhidden copies). The stage time adds exactly the
    chosen policy's cost."""
    saved, nm = 250_000, 3
    prof = saved_heavy(fwd_s, saved)
    keep_need = stage_memory_of(prof, "t", (0, 2), 0, 2, nm, 1).total
    devs = [cpu("g0", "t", keep_need - saved, host_gbps), cpu("g1", "t", 1 << 30, host_gbps)]
    model = CostModel(prof, bw, 1, activations="auto")
    p = model.describe(devs, [(0, 2), (2, 4)], nm)
    keep = CostModel(prof, bw, 1).describe(devs, [(0, 2), (2, 4)], nm)
    swaps = p.swap or ((), ())
    assert p.memory[0].total <= devs[0].memory < p.keep_memory[0].total
    if want == "swap":
        assert swaps[0] and not p.recompute[0]
        assert p.stage_times[0] == keep.stage_times[0]  # hidden: nothing added
    else:
        assert p.recompute[0] and not swaps[0]
        lps = prof.layers["t"]
        assert p.stage_times[0] == pytest.approx(
            keep.stage_times[0] + sum(lps[j].fwd_s for j in p.recompute[0])
        )
    assert not p.recompute[1] and not swaps[1]  # the roomy stage keeps


def test_pinned_swap_charges_only_the_unhidden_copies() -> None:
    """``swap`` pinned: every layer of every stage swapped; the stage time adds the copies'
    excess over the forward and over the backward, and the activations leave the device."""
    prof = saved_heavy(1e-4, 250_000)
    devs = [cpu(f"g{i}", "t", 1 << 30, 0.8) for i in range(2)]
    model = CostModel(prof, bw, 1, activations="swap")
    p = model.describe(devs, [(0, 2), (2, 4)], 2)
    keep = CostModel(prof, bw, 1).describe(devs, [(0, 2), (2, 4)], 2)
    assert p.swap == ((0, 1), (2, 3)) and p.recompute == ((), ())
    copy = copy_seconds(500_000, 0.8)  # 5 ms one way
    for i in range(2):
        assert p.stage_times[i] == pytest.approx(
            keep.stage_times[i] + unhidden_swap_s(copy, 2e-4, 4e-4)
        )
        assert p.memory[i].activations < p.keep_memory[i].activations
        assert p.memory[i].working == p.keep_memory[i].working + 250_000


def test_make_plan_with_auto_swaps_over_a_fast_host_link_and_shows_it() -> None:
    """The tight cluster of the recompute test, but with fast host links: auto swaps, the
    table shows per stage what is kept, recomputed and swapped, and the plan round-trips."""
    from hetpipe.config import ClusterConfig, NetworkSpec, NodeSpec, RuntimeSpec, ShardSpec
    from hetpipe.planner import Plan, make_plan

    prof = activation_heavy(3)
    need = sum(lp.saved_bytes for lp in prof.layers["t"])
    devs = tuple(
        DeviceSpec(f"gpu{i}", "cpu", "t", need, 1.0, 7200 + i, "node0", "127.0.0.1")
        for i in range(2)
    )
    cluster = ClusterConfig(
        "cluster.toml",
        (ShardSpec(0, "127.0.0.1", 7100),),
        NetworkSpec(100.0, 10.0, ()),
        (NodeSpec("node0", "127.0.0.1", devs),),
        RuntimeSpec(),
    )
    kw = {"minibatch": 32, "staleness": 0, "optimizer_state_factor": 1, "nm": 3, "num_vws": 1}
    plan = make_plan(cluster, prof, activations="auto", **kw)
    stages = [s for vw in plan.vws for s in vw.stages]
    assert any(s.swap for s in stages)
    for s in stages:
        assert s.memory.total <= s.memory_cap
        if s.swap:
            assert s.keep_memory is not None and s.keep_memory.total > s.memory_cap
    assert "recompute none, swap " in plan.table()
    again = Plan.from_dict(plan.to_dict())
    assert [s.swap for vw in again.vws for s in vw.stages] == [s.swap for s in stages]
