"""The pipeline/WSP simulator against hand-computed cases, and its CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from hetpipe.core.memory import expected_in_flight
from hetpipe.core.schedule import max_in_flight
from hetpipe.planner.simulate import SimLink, SimStage, SimVW, main, simulate


def vw(times, nm, links=(), minibatch=1):
    return SimVW(tuple(SimStage(f, b) for f, b in times), nm, tuple(links), minibatch)


def test_one_stage_takes_n_times_f_plus_b():
    r = simulate([vw([(1.0, 2.0)], nm=3)], staleness=0, minibatches=10)
    assert r.makespan_s == pytest.approx(30.0)
    assert r.vw_samples_per_s[0] == pytest.approx(1 / 3)
    assert r.busy[0][0] == pytest.approx(1.0)


def test_nm_one_runs_minibatches_one_at_a_time():
    times = [(1.0, 2.0), (0.5, 1.0), (2.0, 1.0)]
    links = [SimLink(0.1, 0.2), SimLink(0.3, 0.4)]
    r = simulate([vw(times, nm=1, links=links)], staleness=0, minibatches=10)
    per = sum(f + b for f, b in times) + 0.1 + 0.2 + 0.3 + 0.4
    assert r.makespan_s == pytest.approx(10 * per)


def test_a_balanced_pipeline_fills_at_nm_equal_k():
    k, n, f, b = 4, 40, 1.0, 2.0
    for nm in (4, 8):
        r = simulate([vw([(f, b)] * k, nm=nm)], staleness=0, minibatches=n)
        assert r.makespan_s == pytest.approx((n + k - 1) * (f + b))
        assert r.vw_samples_per_s[0] == pytest.approx(1 / (f + b))
    # with fewer in flight the pipeline cannot fill: Nm minibatches per round trip
    r = simulate([vw([(f, b)] * k, nm=2)], staleness=0, minibatches=n)
    assert r.vw_samples_per_s[0] == pytest.approx(2 / (k * (f + b)))


def test_the_bottleneck_stage_sets_the_rate():
    r = simulate([vw([(1, 1), (3, 3), (1, 1)], nm=3)], staleness=0, minibatches=60)
    assert r.vw_samples_per_s[0] == pytest.approx(1 / 6)
    assert r.busy[0][1] > 0.95 > r.busy[0][0]


def test_wsp_with_d0_holds_a_fast_vw_to_the_slow_ones_pace():
    fast = vw([(1.0, 2.0)] * 2, nm=2, minibatch=10)
    slow = vw([(4.0, 8.0)] * 2, nm=2, minibatch=10)
    alone = simulate([fast], 0, 64).vw_samples_per_s[0]
    r = simulate([fast, slow], staleness=0, minibatches=64)
    assert r.vw_samples_per_s[0] == pytest.approx(r.vw_samples_per_s[1], rel=0.05)
    assert r.vw_samples_per_s[0] < alone / 3
    assert r.gate_wait_s[0] > 0 and r.gate_wait_s[1] == 0
    # a huge staleness bound decouples them
    free = simulate([fast, slow], staleness=1000, minibatches=64)
    assert free.vw_samples_per_s[0] == pytest.approx(alone)
    assert free.gate_wait_s[0] == 0


def test_staleness_bounds_how_far_ahead_a_vw_runs():
    # fast: a wave (2 minibatches) takes 4s; slow: 16s. 40 minibatches = 20 waves each.
    # Wave c of the fast VW starts once the slow one pushed waves 0..c-2-D, i.e. at
    # 16 * (c - 1 - D); its last wave (c = 19) then ends 4s later.
    fast = vw([(1.0, 1.0)], nm=2)
    slow = vw([(4.0, 4.0)], nm=2)
    for D in (0, 1, 2, 5):
        r = simulate([fast, slow], staleness=D, minibatches=40)
        assert r.vw_finish_s == (16 * (18 - D) + 4, 320.0)
        assert r.gate_wait_s[0] == pytest.approx(r.vw_finish_s[0] - 80.0)  # idle = waiting


def test_links_add_latency_but_not_busy_time():
    times = [(1.0, 1.0)] * 2
    r = simulate([vw(times, nm=8, links=[SimLink(0.5, 0.5)])], staleness=0, minibatches=64)
    assert r.vw_samples_per_s[0] == pytest.approx(0.5, rel=0.01)


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        SimVW((SimStage(1, 1), SimStage(1, 1)), 2, (SimLink(),) * 2)
    with pytest.raises(ValueError):
        simulate([vw([(1, 1)], 1)], staleness=-1, minibatches=4)


def test_cli(tmp_path, capsys):
    desc = {
        "staleness": 0,
        "minibatches": 16,
        "vws": [{"nm": 2, "minibatch": 4, "stages": [[1, 2], [1, 2]], "links": [[0.1, 0.1]]}],
    }
    path = tmp_path / "sim.json"
    path.write_text(json.dumps(desc))
    assert main([str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["samples_per_s"] > 0 and len(out["busy"][0]) == 2
    assert main([str(path)]) == 0
    assert "samples/s" in capsys.readouterr().out
    assert main([str(tmp_path / "missing.json")]) == 2


def test_cli_help_runs_as_a_module():
    r = subprocess.run(
        [sys.executable, "-m", "hetpipe.planner.simulate", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "staleness" in r.stdout


def test_a_push_per_wave_takes_stage_time():
    # one stage, Nm = 4: every fourth minibatch also pushes for 2 s
    r = simulate([SimVW((SimStage(1.0, 1.0, push_s=2.0),), 4)], staleness=0, minibatches=8)
    assert r.makespan_s == pytest.approx(8 * 2.0 + 2 * 2.0)


def test_pulls_wait_their_answer_and_merge_before_the_wave():
    # two alike one-stage VWs, Nm = 2: each wave after the first waits for its pull's answer
    # (0.5 s after the forward that wanted it: a last stage cannot send it earlier), then
    # merges for 0.25 s
    st = SimStage(1.0, 0.0, merge_s=0.25, pull_s=0.5)
    r = simulate([SimVW((st,), 2), SimVW((st,), 2)], staleness=0, minibatches=6)
    assert r.makespan_s == pytest.approx(6 * 1.0 + 2 * (0.5 + 0.25))
    # a first stage of two sends the pull of the next wave after its last forward: the answer
    # is there by the time the wave's first forward is admitted
    vw = SimVW((SimStage(1.0, 1.0, pull_s=0.5), SimStage(1.0, 0.0)), 2)
    ideal = SimVW((SimStage(1.0, 1.0), SimStage(1.0, 0.0)), 2)
    a = simulate([vw, vw], staleness=0, minibatches=8)
    b = simulate([ideal, ideal], staleness=0, minibatches=8)
    assert a.makespan_s == pytest.approx(b.makespan_s)


def test_cli_reads_per_wave_costs(tmp_path, capsys):
    desc = {"vws": [{"nm": 2, "stages": [{"fwd_s": 1, "bwd_s": 1, "push_s": 1}]}]}
    path = tmp_path / "vws.json"
    path.write_text(json.dumps(desc))
    assert main([str(path), "--json", "-n", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["makespan_s"] == pytest.approx(4 * 2 + 2 * 1)


def test_a_handoff_is_paid_once_whatever_joins_it():
    """One stage (first and last) of M = 2: a microbatch's forward and backward go to the
    compute thread together, the iteration's step and push with its last backward: two
    hand-offs per iteration, whatever the actions in them cost."""
    stage = SimStage(0.0, 0.0, push_s=0.25, step_s=0.5, handoff_s=1.0)
    sim = simulate([SimVW((stage,), 2, schedule="1f1b")], 0, 8)
    assert sim.iteration_s[0] == pytest.approx(2 * 1.0 + 0.5 + 0.25)


# ------------------------------------------------------------- minibatches held at once
# peak_in_flight: per stage, the most minibatches between a forward's start and its
# backward's end under the simulated timing (the count the expected peak memory is priced at)


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("times", [(1.0, 1.5), (0.2, 0.3)])
def test_a_uniform_pipeline_holds_three_more_per_stage_back_from_the_last(k, times):
    """Every stage forwards in 1 and differentiates in 1.5 (no links): stage s < k - 1 holds
    ``min(Nm, 3 (k - 1 - s) + 1)``, the last one 1. By hand: stage 0 admits Nm at once and
    forward p starts at stage s at s + p (the forwards run back to back until the first
    gradient returns). The last stage runs F0 at k - 1, B0 until k + 1.5; the gradient then
    reaches each earlier stage mid-forward (forwards end on whole numbers), waits for that
    forward (0.5) and takes 1.5 there: stage k - 1 - j gets it at k + 2 j - 0.5, by when it
    has started forwards 0 .. 3 j (s + p < k + 2 j - 0.5 with s = k - 1 - j). No two events
    of a stage coincide, so the count does not rest on how ties are broken. With Nm = k the
    stage j before the last holds min(k, 3 j + 1), so the one before the last 4 of k where
    k > 4; a larger Nm leaves more stages short of the Nm the bound charges. Times scaled
    by a constant change nothing."""
    f, b = times
    for nm in (1, 2, k, 2 * k, 3 * k):
        r = simulate([vw([(f, b)] * k, nm=nm)], staleness=0, minibatches=8 * nm + 8)
        want = (*(min(nm, 3 * (k - 1 - s) + 1) for s in range(k - 1)), 1)
        assert r.peak_in_flight == (want,), (nm, r.peak_in_flight)
        bound = tuple(max_in_flight("async", k, s, nm) for s in range(k))
        assert all(x <= y for x, y in zip(want, bound, strict=True))


def test_a_stage_before_a_much_slower_one_holds_the_bound():
    """A 20x slower successor: every admitted minibatch is forwarded before the first
    gradient returns, so the stages before it hold Nm, the schedule's maximum."""
    for times in ([(1, 1), (20, 20)], [(1, 1), (1, 1), (20, 20)]):
        r = simulate([vw(times, nm=4)], staleness=0, minibatches=32)
        assert r.peak_in_flight == ((4,) * (len(times) - 1) + (1,),)


def test_a_slow_head_holds_two_and_its_fast_successors_one():
    """Stage 0 takes 20 per forward and per backward, the others 1: minibatch 0's round
    trip through the rest (4) ends while stage 0 runs forward 1 (from 20 to 40), so at 40
    the ready backward of 0 goes first, then that of 1 (back at 42): stage 0 holds two at
    most, forwards and backwards in pairs. Each later stage finishes a minibatch's round
    trip long before the next arrives: one."""
    r = simulate([vw([(20, 20), (1, 1), (1, 1)], nm=4)], staleness=0, minibatches=32)
    assert r.peak_in_flight == ((2, 1, 1),)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("seed", range(6))
def test_a_synchronous_order_holds_its_own_count_under_the_simulated_timing(kind, seed):
    """gpipe and 1f1b run a fixed order: whatever the stage times, each stage holds what
    max_in_flight gives for that order (gpipe M, 1f1b its warm-up plus one)."""
    rng = random.Random(seed)
    k, m = rng.randint(1, 5), rng.randint(1, 6)
    warmup = rng.randint(0, 2) if kind == "1f1b" else 0
    times = [(rng.uniform(0.1, 2.0), rng.uniform(0.1, 2.0)) for _ in range(k)]
    sim = SimVW(tuple(SimStage(f, b) for f, b in times), m, schedule=kind, warmup=warmup)
    r = simulate([sim], staleness=0, minibatches=3 * m)
    assert r.peak_in_flight == (
        tuple(max_in_flight(kind, k, s, m, warmup=warmup) for s in range(k)),
    )


@pytest.mark.parametrize("seed", range(30))
def test_no_simulated_stage_holds_more_than_the_bound(seed):
    """Random small async jobs (stages, Nm, stage and link times, one or two virtual workers
    under WSP): every stage holds at least one and at most max_in_flight, the last exactly
    one; so the expected count never exceeds the one the caps are checked with."""
    rng = random.Random(seed)
    vws = []
    for _ in range(rng.randint(1, 2)):
        k, nm = rng.randint(1, 5), rng.randint(1, 8)
        times = [(rng.uniform(0.05, 3.0), rng.uniform(0.05, 3.0)) for _ in range(k)]
        links = [SimLink(rng.uniform(0, 1), rng.uniform(0, 1)) for _ in range(k - 1)]
        vws.append(vw(times, nm, links))
    r = simulate(vws, staleness=rng.randint(0, 2), minibatches=rng.randint(1, 40))
    for v, spec in enumerate(vws):
        k = len(spec.stages)
        peaks = r.peak_in_flight[v]
        bound = [max_in_flight("async", k, s, spec.nm) for s in range(k)]
        assert all(1 <= p <= b for p, b in zip(peaks, bound, strict=True)), (peaks, bound)
        assert peaks[-1] == 1
        for s in range(k):
            assert expected_in_flight(peaks[s], s, k, spec.nm) == peaks[s]


def test_expected_in_flight_is_the_bound_where_the_order_is_fixed():
    """A fixed order (gpipe, 1f1b, async on the lock-step order) holds its own count under
    every timing, so the expected count is the bound whatever was simulated; where it
    depends on timing a count outside 1 .. bound is a broken simulation, refused."""
    assert (
        expected_in_flight(2, 0, 3, 8, weights="latest")
        == 5
        == max_in_flight("async", 3, 0, 8, fixed=True)
    )
    assert expected_in_flight(1, 1, 3, 4, schedule="gpipe") == 4
    assert expected_in_flight(3, 1, 3, 4) == 3
    for held, stage in ((9, 0), (2, 2), (0, 0)):
        with pytest.raises(ValueError, match="simulated"):
            expected_in_flight(held, stage, 3, 8)
