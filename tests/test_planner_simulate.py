"""The pipeline/WSP simulator against hand-computed cases, and its CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
