"""The runtime's costs, host sharing, and the predictions made from them."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

import pytest

from hetpipe.config import DeviceSpec, RuntimeSpec
from hetpipe.planner import CallProfile, CostModel, LayerProfile, ModelProfile, explicit_plan
from hetpipe.planner import predict as predict_module
from hetpipe.planner.plan import sim_vw
from hetpipe.planner.predict import LONG_JOB, predict, stage_costs
from hetpipe.planner.runtime import RuntimeCosts, all_busy, host_cores, slowdowns
from hetpipe.planner.simulate import SimStage, SimVW, simulate

MiB = 1 << 20


def test_processes_that_fit_the_cores_run_unslowed():
    assert slowdowns([1.0, 1.0], 2) == [1.0, 1.0]
    assert slowdowns([1.0, 0.3, 0.0], 4) == [1.0, 1.0, 1.0]


def test_always_busy_processes_share_the_cores():
    assert slowdowns([1.0] * 4, 2) == pytest.approx([2.0] * 4)
    assert slowdowns([1.0] * 3, 1) == pytest.approx([3.0] * 3)
    # idle processes take nothing (and would wait for the two busy ones when they want more)
    assert slowdowns([1.0, 1.0, 0.0, 0.0], 2) == pytest.approx([1.0, 1.0, 1.5, 1.5])


def test_partly_busy_processes_slow_each_other_in_expectation():
    # three processes, each wanting a core half the time, on two cores: a process finds both
    # others busy a quarter of the time, and then gets 2/3 of a core
    want = 1.0 / (0.75 + 0.25 * 2 / 3)
    assert slowdowns([0.5, 0.5, 0.5], 2) == pytest.approx([want] * 3)
    # a padded device (busy less) is slowed less than it slows the others... all alike here,
    # but the busier the others, the slower everyone
    light, heavy = slowdowns([0.5, 0.2, 0.2], 2), slowdowns([0.5, 0.9, 0.9], 2)
    assert 1.0 < light[0] < heavy[0]


def test_corun_slows_cores_that_compute_together():
    # two always-busy processes on two cores: no sharing, but each core is slower while the
    # other computes; on many cores one other busy core costs proportionally less
    assert slowdowns([1.0, 1.0], 2, corun=0.2) == pytest.approx([1.2, 1.2])
    assert slowdowns([1.0, 1.0], 11, corun=0.2) == pytest.approx([1.02, 1.02])
    assert slowdowns([1.0], 2, corun=0.2) == [1.0]


def test_padded_compute_sleeps_off_a_share_of_a_core():
    """A device padded to the least CPU time its kind of pass took / speed
    (hetpipe.emulate.pad) loses nothing to a share of a core down to its speed: four
    always-busy devices at 0.5 on two cores compute at their own speed, at 0.75 they lose a
    third, unpadded half. Co-running cores' cache and memory contention costs cycles beyond
    that least, which the pad sleeps off the same way: at 0.5 nothing is lost to a 1.2
    stretch, at 0.9 what goes over the pad's target (0.9 x 1.2), unpadded all of it."""
    assert slowdowns([1.0] * 4, 2, speeds=[0.5] * 4) == pytest.approx([1.0] * 4)
    assert slowdowns([1.0] * 4, 2, speeds=[0.75] * 4) == pytest.approx([1.5] * 4)
    assert slowdowns([1.0] * 4, 2, speeds=[1.0] * 4) == slowdowns([1.0] * 4, 2)
    assert slowdowns([1.0] * 2, 2, corun=0.2, speeds=[0.5] * 2) == pytest.approx([1.0] * 2)
    assert slowdowns([1.0] * 2, 2, corun=0.2, speeds=[0.9] * 2) == pytest.approx([1.08] * 2)
    assert slowdowns([1.0] * 2, 2, corun=0.2, speeds=[1.0] * 2) == pytest.approx([1.2] * 2)


def test_all_busy_is_the_chance_that_every_core_is_taken():
    assert all_busy([1.0, 1.0], 2) == pytest.approx(1.0)
    assert all_busy([0.5, 0.5], 2) == pytest.approx(0.25)
    assert all_busy([0.5, 0.5, 0.5], 2) == pytest.approx(0.5)
    assert all_busy([1.0], 2) == 0.0


def test_host_cores():
    assert host_cores(4, "n0") == 4
    assert host_cores({"n0": 8}, "n0") == 8
    assert host_cores({"n1": 8}, "n0") >= 1  # this machine's
    with pytest.raises(ValueError, match="cores"):
        host_cores(0, "n0")


def test_runtime_costs_round_trip_and_checks():
    c = RuntimeCosts()
    assert RuntimeCosts.from_dict(c.to_dict()) == c
    assert RuntimeCosts.zero().is_zero and not c.is_zero
    with pytest.raises(ValueError, match="unknown"):
        RuntimeCosts.from_dict({"nope": 1.0})
    with pytest.raises(ValueError, match="hop_s"):
        RuntimeCosts.from_dict({"hop_s": -1.0})


# ------------------------------------------------------------------------------ predictions


def dev(name: str, dtype: str, speed: float = 1.0, device: str = "cpu", node: str = "n0"):
    return DeviceSpec(name, device, dtype, 64 * MiB, speed, 0, node, f"10.0.0.{node[-1]}")


def flat_profile(types: dict[str, float], layers: int = 4, t: float = 1e-3) -> ModelProfile:
    """Identical layers; each type ``1/speed`` slower, as an emulated device is."""
    lp = LayerProfile(t, 2 * t, 4096, 0, 1024, 2048, 2048)
    return ModelProfile(
        "flat",
        8,
        1024,
        {
            k: tuple(dataclasses.replace(lp, fwd_s=t / s, bwd_s=2 * t / s) for _ in range(layers))
            for k, s in types.items()
        },
    )


def flat(slowdown) -> list[float]:
    return [k for vw in slowdown for k in vw]


def bw(a, b) -> float:
    return 1e10


def one_stage(model, devices):
    return [((d,), model.partition((d,), 1)) for d in devices]


def test_an_ideal_runtime_predicts_what_the_simulator_does():
    prof = flat_profile({"a": 1.0})
    model = CostModel(prof, bw, 0, RuntimeCosts.zero())
    devs = (dev("x", "a"), dev("y", "a"))
    p = model.partition(devs, 2)
    pred = predict(model, [(devs, p)], minibatch=8, staleness=0, cores=8, minibatches=40)
    sim = simulate([SimVW((SimStage(2e-3, 4e-3), SimStage(2e-3, 4e-3)), 2, (), 8)], 0, 40)
    assert pred.sim.makespan_s == pytest.approx(sim.makespan_s, rel=1e-4)  # links: ~0
    assert pred.slowdown == ((1.0, 1.0),) and pred.rounds == 1


@pytest.mark.parametrize("schedule", ["async", "gpipe", "1f1b"])
def test_busy_time_counts_the_simulators_hand_offs(schedule):
    """A stage's predicted busy time per minibatch is what the simulated stage was busy for:
    a hop per hand-off to the compute thread as the schedule groups actions (the last
    stage's forward and backward, a backward with its step and push, the first stage's
    backward with its next forward), not one per action."""
    prof = flat_profile({"a": 1.0})
    model = CostModel(prof, bw, 0, dataclasses.replace(RuntimeCosts(), cold=0.0))
    devs = (dev("x", "a"), dev("y", "a"), dev("z", "a"))
    p = model.partition(devs, 4)
    pred = predict(
        model, [(devs, p)], minibatch=8, staleness=0, cores=8, minibatches=32, schedule=schedule
    )
    finish = pred.sim.vw_finish_s[0]
    for i in range(3):
        busy = pred.sim.busy[0][i] * finish / 32
        assert pred.busy_s(0, i, 4) == pytest.approx(busy, rel=1e-9)
    # the last stage makes fewer hand-offs than it runs forwards, backwards, steps and pushes
    assert pred.sim.trips[0][2] < 2 + 2 / 4


def test_devices_of_one_host_share_its_cores():
    prof = flat_profile({"a": 1.0})
    costs = dataclasses.replace(RuntimeCosts.zero(), hop_s=1e-9)  # some cost: iterate
    model = CostModel(prof, bw, 0, costs)
    devs = [dev(f"g{i}", "a") for i in range(4)]
    alone = predict(model, one_stage(model, devs[:1]), minibatch=8, staleness=0, cores=2)
    four = predict(model, one_stage(model, devs), minibatch=8, staleness=0, cores=2)
    # four always-busy devices on two cores: each at half speed, the job at twice one's rate
    assert flat(four.slowdown) == pytest.approx([2.0] * 4, rel=0.02)
    # the first round's answer replaces the unslowed start whole: the second round finds it
    # settled and the third is the final run (halving the step from the start took seven)
    assert four.rounds == 3
    assert four.sim.job_samples_per_s == pytest.approx(2 * alone.sim.job_samples_per_s, rel=0.03)
    # on a host of four cores nobody waits; on separate nodes neither
    roomy = predict(model, one_stage(model, devs), minibatch=8, staleness=0, cores=4)
    assert flat(roomy.slowdown) == pytest.approx([1.0] * 4)
    apart = [dev(f"g{i}", "a", node=f"n{i}") for i in range(4)]
    spread = predict(model, one_stage(model, apart), minibatch=8, staleness=0, cores=2)
    assert flat(spread.slowdown) == pytest.approx([1.0] * 4)


def test_padded_and_gpu_devices_want_less_of_the_host():
    # a device at speed 0.25 sleeps three quarters of its compute: four of them fit 2 cores
    prof = flat_profile({"slow": 0.25})
    costs = dataclasses.replace(RuntimeCosts.zero(), hop_s=1e-9)
    model = CostModel(prof, bw, 0, costs, {"slow": 0.25})
    slow = [dev(f"s{i}", "slow", speed=0.25) for i in range(4)]
    pred = predict(model, one_stage(model, slow), minibatch=8, staleness=0, cores=2)
    assert all(1.0 < k[0] < 1.3 for k in pred.slowdown)
    # devices on cuda compute on their GPU: only their event loops use the host
    gpus = [dev(f"c{i}", "slow", speed=0.25, device=f"cuda:{i}") for i in range(4)]
    pred = predict(model, one_stage(model, gpus), minibatch=8, staleness=0, cores=2)
    assert flat(pred.slowdown) == pytest.approx([1.0] * 4, abs=1e-6)


def test_a_padded_device_computes_at_its_speed_while_the_cores_it_shares_suffice():
    """Eight devices at speed 0.25 on two cores want two cores' worth of compute: their
    event loops wait for a core, but their padded compute loses nothing (the pad sleeps
    less), so the job runs at eight times one device's rate."""
    prof = flat_profile({"slow": 0.25})
    costs = dataclasses.replace(RuntimeCosts.zero(), hop_s=1e-9)
    model = CostModel(prof, bw, 0, costs, {"slow": 0.25})
    slow = [dev(f"s{i}", "slow", speed=0.25) for i in range(8)]
    alone = predict(model, one_stage(model, slow[:1]), minibatch=8, staleness=0, cores=2)
    eight = predict(model, one_stage(model, slow), minibatch=8, staleness=0, cores=2)
    assert min(flat(eight.slowdown)) > 1.5
    assert flat(eight.pad_slowdown) == pytest.approx([1.0] * 8)
    assert eight.sim.job_samples_per_s == pytest.approx(8 * alone.sim.job_samples_per_s, rel=0.01)
    assert eight.compute_s(0, 0) == pytest.approx(alone.compute_s(0, 0))


def test_stage_costs_follow_the_runtime():
    prof = flat_profile({"a": 0.5})
    costs = RuntimeCosts(
        task_s=1e-3,
        hop_s=2e-3,
        message_s=3e-3,
        message_byte_s=0.0,
        wave_s=4e-3,
        wave_byte_s=0.0,
        latency_s=5e-3,
    )
    model = CostModel(prof, bw, 0, costs, {"a": 0.5})
    devs = (dev("x", "a", 0.5), dev("y", "a", 0.5))
    p = model.describe(devs, [(0, 2), (2, 4)], 2)
    first, last = stage_costs(model, devs, p, vws=2, shards=1)
    # compute is padded (task_s too); hand-offs and sends are the event loop's, unpadded
    assert first.compute_fwd_s == pytest.approx(2 * 2e-3 + 1e-3 / 0.5)
    assert first.compute_bwd_s == pytest.approx(2 * 4e-3 + 1e-3 / 0.5)
    assert first.loop_fwd_s == pytest.approx(2e-3 + 3e-3)  # hand-off, send the activation
    assert last.compute_bwd_s == 0.0 and last.loop_bwd_s == 0.0
    assert last.loop_fwd_s == pytest.approx(2e-3 + 3e-3)  # hand-off, send the gradient
    # per wave: push, and with several VWs a pull's answer and a merge
    assert first.push_s == pytest.approx(2e-3 + 4e-3)
    assert first.merge_s == first.push_s and first.pull_s == pytest.approx(2 * 5e-3)
    alone = stage_costs(model, devs, p, vws=1, shards=1)[0]
    assert alone.merge_s == 0.0 and alone.pull_s == 0.0
    # a padded device wants a core only for its share of the compute
    assert first.cpu_s == pytest.approx(
        first.compute_s * 0.5
        + first.loop_fwd_s
        + first.loop_bwd_s
        + first.recv_s
        + (first.push_s + first.merge_s) / 2
    )


def test_short_tasks_of_an_unslowed_cpu_device_skip_the_hand_off():
    """As the runtime runs them (hetpipe.computethread): an unslowed CPU device's tasks
    shorter than ``inline_s`` cost no hop and no hand-off wake-ups; a padded device's, a
    GPU's, longer tasks and a stage that pulls weights every wave do."""
    prof = flat_profile({"a": 1.0})  # a stage of two layers: tasks of 2 and 4 ms
    costs = dataclasses.replace(RuntimeCosts(), task_s=0.0, inline_s=5e-3)

    def first(devs, rt=costs, vws=1):
        model = CostModel(prof, bw, 0, rt, {"a": min(d.speed for d in devs)})
        p = model.describe(devs, [(0, 2), (2, 4)], 2)
        return stage_costs(model, devs, p, vws=vws, shards=1)[0]

    on_loop = first((dev("x", "a"), dev("y", "a")))
    assert on_loop.inline and on_loop.hop_s == 0.0
    for devs, rt in [
        ((dev("x", "a", 0.5), dev("y", "a", 0.5)), costs),  # padded
        ((dev("x", "a", device="cuda:0"), dev("y", "a", device="cuda:0")), costs),
        ((dev("x", "a"), dev("y", "a")), dataclasses.replace(costs, inline_s=4e-3)),
        ((dev("x", "a"), dev("y", "a")), dataclasses.replace(costs, inline_s=0.0)),
    ]:
        handed = first(devs, rt)
        assert not handed.inline and handed.hop_s == costs.hop_s, devs
        # the same send, and the hop of its hand-off
        assert handed.loop_fwd_s == pytest.approx(on_loop.loop_fwd_s + costs.hop_s)
    # several virtual workers: the stage pulls its weights every wave and keeps the hand-off
    assert not first((dev("x", "a"), dev("y", "a")), vws=2).inline
    # the cluster file's setting reaches the costs
    spec = dataclasses.replace(RuntimeSpec(), inline_ms=7)
    assert RuntimeCosts().with_runtime(SimpleNamespace(runtime=spec)).inline_s == 0.007
    assert RuntimeCosts().with_runtime(object()) == RuntimeCosts()


def test_an_async_update_is_charged_as_the_runtime_runs_it_unpadded():
    """A padded device sleeps after its forwards and backwards, never after its optimizer
    step, while the profile holds the update padded: stage costs, the partitioner's stage
    time and the simulator's view all charge it at the device's speed, and the CPU it
    wants counts it whole."""
    base = flat_profile({"a": 0.25})
    lps = tuple(dataclasses.replace(lp, update_s=4e-3) for lp in base.layers["a"])
    devs = (dev("x", "a", 0.25), dev("y", "a", 0.25))

    def priced(profile: ModelProfile):
        model = CostModel(profile, bw, 0, RuntimeCosts.zero(), {"a": 0.25})
        p = model.describe(devs, [(0, 2), (2, 4)], 2)
        return model, p, stage_costs(model, devs, p, vws=1, shards=1)

    bare_model, _, bare = priced(base)
    model, p, c = priced(dataclasses.replace(base, layers={"a": lps}))
    # two layers' updates of 4 ms each, run at speed 0.25: 2 ms per stage
    assert c[0].compute_bwd_s - bare[0].compute_bwd_s == pytest.approx(2e-3)
    assert c[1].compute_fwd_s - bare[1].compute_fwd_s == pytest.approx(2e-3)
    assert model.stage_time("a", 0, 2, None, 1.0) - bare_model.stage_time(
        "a", 0, 2, None, 1.0
    ) == pytest.approx(2e-3)
    assert c[0].cpu_s - bare[0].cpu_s == pytest.approx(2e-3)  # unpadded: all of it on a core
    sim = sim_vw(model, devs, p, 16)
    assert sim.stages[0].bwd_s == pytest.approx(sum(lp.bwd_s for lp in lps[:2]) + 2e-3)
    sync = stage_costs(model, devs, p, vws=1, shards=1, schedule="1f1b")
    assert sync[0].step_s == pytest.approx(2e-3)  # the iteration's one step, unpadded


def test_stage_costs_charge_the_call_term_once_per_task():
    costs = RuntimeCosts(task_s=1e-3, hop_s=2e-3, message_s=3e-3, message_byte_s=0.0)
    bare = flat_profile({"a": 0.5})
    call = CallProfile(3e-4, 6e-4, 1e-4)
    devs = (dev("x", "a", 0.5), dev("y", "a", 0.5), dev("z", "a", 0.5))
    got = {}
    for name, prof in (("bare", bare), ("call", dataclasses.replace(bare, calls={"a": call}))):
        model = CostModel(prof, bw, 0, costs, {"a": 0.5})
        p = model.describe(devs, [(0, 2), (2, 3), (3, 4)], 2)
        got[name] = stage_costs(model, devs, p, vws=1, shards=1)
    # the update runs unpadded: at the devices' speed (0.5) of its profiled (padded) time
    update = call.update_s * 0.5
    for i, (x, y) in enumerate(zip(got["bare"], got["call"], strict=True)):
        if i < 2:  # a forward task, and a backward task with the update
            assert y.compute_fwd_s - x.compute_fwd_s == pytest.approx(call.fwd_s)
            assert y.compute_bwd_s - x.compute_bwd_s == pytest.approx(call.bwd_s + update)
        else:  # the last stage's one task runs the forward, the backward and the update
            assert y.compute_fwd_s - x.compute_fwd_s == pytest.approx(
                call.fwd_s + call.bwd_s + update
            )
            assert y.compute_bwd_s == x.compute_bwd_s == 0.0
        assert y.loop_fwd_s == x.loop_fwd_s and y.push_s == x.push_s


def test_explicit_plan_reports_predicted_compute_and_busy_time():
    prof = flat_profile({"a": 1.0})
    devs = [dev(f"g{i}", "a") for i in range(3)]
    cluster = type("C", (), {"devices": devs, "ps": (), "network": _Net()})()
    plan = explicit_plan(
        cluster,
        prof,
        [(["g0", "g1", "g2"], [2, 1, 1], 3)],
        minibatch=8,
        staleness=0,
        optimizer_state_factor=1,
        cores=1,
    )
    for s in plan.vws[0].stages:
        assert s.slowdown > 1.0  # three workers on one core
        assert s.busy_s > s.time_s > 0
    ideal = explicit_plan(
        cluster,
        prof,
        [(["g0", "g1", "g2"], [2, 1, 1], 3)],
        minibatch=8,
        staleness=0,
        optimizer_state_factor=1,
        cores=8,
        costs=RuntimeCosts.zero(),
    )
    assert ideal.vws[0].stages[0].time_s == pytest.approx(2 * 3e-3)
    assert ideal.samples_per_s > plan.samples_per_s
    assert plan.details["runtime_costs"] == RuntimeCosts().to_dict()


def test_a_long_job_is_predicted_from_a_bounded_run_at_its_rate(monkeypatch):
    """A job of a million minibatches is predicted at once (the head plans it before it
    starts), within 0.1 % of the rate of a long job simulated to its end."""
    prof = flat_profile({"a": 1.0})
    devs = [dev(f"g{i}", "a") for i in range(3)]
    cluster = type("C", (), {"devices": devs, "ps": (), "network": _Net()})()
    common = {"minibatch": 8, "staleness": 0, "optimizer_state_factor": 1, "cores": 4}
    vws = [(["g0", "g1"], [2, 2], 3), (["g2"], [4], 2)]
    t0 = time.process_time()
    long = explicit_plan(cluster, prof, vws, minibatches=1_000_000, **common)
    assert time.process_time() - t0 < 5  # every minibatch simulated took ~40 s
    monkeypatch.setattr(predict_module, "LONG_JOB", 1 << 40)  # every minibatch simulated
    whole = explicit_plan(cluster, prof, vws, minibatches=4 * LONG_JOB, **common)
    assert long.samples_per_s != whole.samples_per_s  # two different runs were simulated
    assert long.samples_per_s == pytest.approx(whole.samples_per_s, rel=1e-3)
    assert [v.samples_per_s for v in long.vws] == pytest.approx(
        [v.samples_per_s for v in whole.vws], rel=1e-3
    )


class _Net:
    links = ()

    def bytes_per_s(self, a, b) -> float:
        return 1e10


def test_tasks_that_start_cold_cost_more():
    prof = flat_profile({"a": 1.0, "slow": 0.5})
    costs = dataclasses.replace(RuntimeCosts.zero(), cold=0.2)
    model = CostModel(prof, bw, 0, costs, {"a": 1.0, "slow": 0.5})
    # alone and unpadded, a device computes back to back: nothing cools down
    fast = predict(model, one_stage(model, [dev("f", "a")]), minibatch=8, staleness=0, cores=4)
    assert fast.cold[0][0] == pytest.approx(1.0, abs=0.02)
    assert fast.compute_s(0, 0) == pytest.approx(fast.costs[0][0].compute_s, rel=0.02)
    # busy half the time, half its tasks start cold
    two = [dev("f", "a"), dev("s", "slow", speed=0.5)]
    half = predict(
        model, [(tuple(two), model.partition(tuple(two), 1))], minibatch=8, staleness=0, cores=4
    )
    assert 1.05 < half.cold[0][0] < 1.2
    # a padded device sleeps after every task, but its pad counts its thread's CPU time,
    # which shows no cold start (measured); on a GPU the host's caches and clocks do not
    # matter
    slow = [dev("s", "slow", speed=0.5)]
    padded = predict(model, one_stage(model, slow), minibatch=8, staleness=0, cores=4)
    assert padded.cold[0][0] == pytest.approx(1.0)
    assert padded.compute_s(0, 0) == pytest.approx(padded.costs[0][0].compute_s)
    gpu = [dev("g", "slow", speed=0.5, device="cuda:0")]
    on_gpu = predict(model, one_stage(model, gpu), minibatch=8, staleness=0, cores=4)
    assert on_gpu.cold[0][0] == pytest.approx(1.0)


def test_a_flush_shares_a_core_by_the_timeline_not_by_independence():
    """Two stages of one microbatch per iteration under gpipe never compute at once (stage 1
    waits for stage 0's forward, stage 0 for stage 1's backward): one core is enough and
    neither is slowed. The same busy shares, taken as independent, would charge both; the
    asynchronous schedule with Nm = 2 does compute them together."""
    prof = flat_profile({"a": 1.0})
    model = CostModel(prof, bw, 0, RuntimeCosts.zero())
    devs = (dev("x", "a"), dev("y", "a"))
    p = model.partition(devs, 1)
    sync = predict(
        model, [(devs, p)], minibatch=8, staleness=0, cores=1, minibatches=12, schedule="gpipe"
    )
    assert sync.slowdown[0] == pytest.approx((1.0, 1.0))
    busy = sync.sim.busy[0]
    assert max(slowdowns(list(busy), 1)) > 1.3  # what independence would have said
    two = model.partition(devs, 2)
    pipelined = predict(model, [(devs, two)], minibatch=8, staleness=0, cores=1, minibatches=40)
    assert min(pipelined.slowdown[0]) > 1.3


def test_the_synchronous_step_runs_once_per_iteration_unpadded():
    prof = flat_profile({"slow": 0.5})
    prof = dataclasses.replace(
        prof,
        layers={
            "slow": tuple(dataclasses.replace(lp, update_s=1e-3) for lp in prof.layers["slow"])
        },
    )
    model = CostModel(prof, bw, 0, RuntimeCosts.zero(), {"slow": 0.5})
    devs = (dev("s", "slow", speed=0.5),)
    p = model.partition(devs, 4)
    [sync] = stage_costs(model, devs, p, vws=1, shards=1, schedule="1f1b")
    [asyn] = stage_costs(model, devs, p, vws=1, shards=1)
    assert sync.step_s == pytest.approx(4 * 1e-3 * 0.5)  # the profile's update is padded
    assert asyn.step_s == 0.0
    # async: in each backward, unpadded too; sync: not in any backward
    assert asyn.compute_s - sync.compute_s == pytest.approx(4 * 1e-3 * 0.5)


def test_a_synchronous_wake_up_waits_only_for_the_other_stages_cores():
    """A synchronous stage's wake-ups come while it waits (for an input, or its compute
    thread for the hand-off), so its own compute never takes the core they wait for: alone
    on one core they never wait. Two stages on one core: a wake-up waits while the other
    computes, never longer than ``wake_s``. The same two on two cores: never (measured on
    the default cluster: 0.1 ms from one action's end to the next one's start, the hop
    included). The waits themselves are not counted as wanting a core (counting them fed
    back until every wake-up waited ``wake_s``)."""
    prof = flat_profile({"a": 1.0})  # per microbatch: forward 4 ms, backward 8 ms
    costs = dataclasses.replace(RuntimeCosts.zero(), wake_s=2e-3)
    model = CostModel(prof, bw, 0, costs)
    x, y = dev("x", "a"), dev("y", "a")

    def waits(devs, cores):
        p = model.partition(devs, 4)
        return predict(
            model,
            [(devs, p)],
            minibatch=8,
            staleness=0,
            cores=cores,
            minibatches=48,
            schedule="1f1b",
        ).wake[0]

    assert waits((x,), 1) == (0.0,)
    shared = waits((x, y), 1)
    assert all(0.1 * costs.wake_s < w < costs.wake_s for w in shared)
    assert waits((x, y), 2) == (0.0, 0.0)


def test_a_shard_works_for_the_state_it_holds():
    """Two VWs on one host, a shard there and one on another host: where every layer's
    state lies on the local shard (``local``), that shard applies every push and answers
    every pull beside the workers and slows them; spread round-robin (``default``), half that
    work runs on the other host. The shards' work follows their bytes, not an even split."""
    prof = flat_profile({"a": 1.0})
    costs = dataclasses.replace(RuntimeCosts.zero(), hop_s=1e-9, shard_byte_s=1e-7)
    model = CostModel(prof, bw, 0, costs)
    devs = [dev("x", "a"), dev("y", "a")]
    hosts = ("10.0.0.0", "10.0.0.1")
    kw = dict(minibatch=8, staleness=0, cores=2, shard_hosts=hosts, minibatches=64)
    local = predict(model, one_stage(model, devs), placement="local", **kw)
    spread = predict(model, one_stage(model, devs), placement="default", **kw)
    assert min(flat(local.slowdown)) > 1.1 * max(flat(spread.slowdown))
    assert local.sim.job_samples_per_s < spread.sim.job_samples_per_s
