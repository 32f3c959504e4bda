"""Layer profiles: measurement on real tensors, the stage call term, the JSON store, synthetic
profiles."""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch import nn

from hetpipe.measure import measure_layers, measure_model
from hetpipe.planner import CallProfile, LayerProfile, ModelProfile, ProfileStore
from hetpipe.planner.profile import at_speed, synthetic_profile


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.BatchNorm1d(32), nn.Linear(32, 4))


def test_measure_layers_counts_bytes_from_real_tensors():
    model = small_model()
    x = torch.randn(8, 16)
    lps = measure_layers(model, x, warmup=1, repeats=2)
    assert len(lps) == 4
    lin0, relu, bn, lin1 = lps
    assert lin0.param_bytes == (16 * 32 + 32) * 4 and lin0.buffer_bytes == 0
    assert relu.param_bytes == 0
    assert bn.param_bytes == 2 * 32 * 4 and bn.buffer_bytes == (32 + 32) * 4 + 8
    assert lin0.out_bytes == 8 * 32 * 4 and lin1.out_bytes == 8 * 4 * 4
    # a linear layer saves its input for the weight gradient (its weight is not counted)
    assert lin0.saved_bytes == 8 * 16 * 4
    assert relu.saved_bytes == 8 * 32 * 4  # its output
    assert all(lp.fwd_s > 0 and lp.bwd_s >= 0 for lp in lps)
    assert lin1.work_bytes == lin1.out_bytes + 8 * 32 * 4


def test_measure_layers_applies_speed_and_loss():
    model = small_model()
    x = torch.randn(8, 16)
    labels = torch.randint(0, 4, (8,))
    lps = measure_layers(
        model,
        x,
        speed=0.25,
        warmup=0,
        repeats=1,
        loss_fn=lambda y: nn.functional.cross_entropy(y, labels),
    )
    assert len(lps) == 4 and lps[-1].bwd_s > 0
    with pytest.raises(ValueError, match="speed"):
        measure_layers(model, x, speed=0)


def test_store_round_trip(tmp_path):
    path = tmp_path / "profiles.json"
    store = ProfileStore(path)
    lps = (LayerProfile(0.001, 0.002, 10, 0, 20, 30, 40),) * 3
    assert store.get("cnn", 32, "fast") is None
    store.put("cnn", 32, "fast", lps, input_bytes=256)
    store.put("cnn", 32, "slow", lps)
    store.save()
    data = json.loads(path.read_text())  # readable JSON
    assert data["models"]["cnn"]["32"]["types"]["fast"][0]["fwd_s"] == 0.001
    again = ProfileStore(path)
    assert again.get("cnn", 32, "fast") == lps
    assert again.get("cnn", 16, "fast") is None
    prof = again.model_profile("cnn", 32)
    assert prof is not None and prof.input_bytes == 256 and set(prof.layers) == {"fast", "slow"}
    assert again.model_profile("cnn", 32, ["fast"]).types == ("fast",)
    # forgetting one minibatch drops every type's profile at it, and only those
    again.put("cnn", 16, "fast", lps)
    again.forget("cnn", 32)
    assert again.get("cnn", 32, "fast") is None and again.get("cnn", 32, "slow") is None
    assert again.get("cnn", 16, "fast") == lps
    path.write_text("not json")
    with pytest.raises(ValueError, match="unreadable"):
        ProfileStore(path)


def test_synthetic_profile_is_deterministic_and_respects_speed():
    a = synthetic_profile(10, {"fast": 1.0, "slow": 0.25}, 3)
    b = synthetic_profile(10, {"fast": 1.0, "slow": 0.25}, random.Random(3))
    assert a == b and a.n_layers() == 10
    fast = sum(lp.fwd_s for lp in a.layers["fast"])
    slow = sum(lp.fwd_s for lp in a.layers["slow"])
    assert 3.0 < slow / fast < 5.0
    assert [lp.param_bytes for lp in a.layers["fast"]] == [
        lp.param_bytes for lp in a.layers["slow"]
    ]


def test_profile_dict_round_trip_and_scaling():
    a = synthetic_profile(5, {"x": 1.0}, 1, minibatch=32)
    assert ModelProfile.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    half = a.scaled(16)
    assert half.minibatch == 16
    assert half.layers["x"][0].fwd_s == pytest.approx(a.layers["x"][0].fwd_s / 2)
    assert half.layers["x"][0].param_bytes == a.layers["x"][0].param_bytes
    with pytest.raises(ValueError, match="layer counts"):
        ModelProfile("m", 1, 1, {"a": a.layers["x"], "b": a.layers["x"][:2]})


def test_measure_layers_times_the_update_of_each_layers_state():
    model = small_model()
    lps = measure_layers(model, torch.randn(8, 16), warmup=1, repeats=3)
    lin0, relu, bn, lin1 = lps
    assert lin0.update_s > 0 and bn.update_s > 0 and lin1.update_s > 0
    assert relu.update_s < lin0.update_s  # nothing to update
    assert all(lp.time_s == lp.fwd_s + lp.bwd_s + lp.update_s for lp in lps)
    # stage 0 needs no gradient of the model input: no input gradient in its working memory
    assert lin0.work_bytes == lin0.out_bytes
    # a given step function is what gets timed
    calls = []

    def step(params, grads):
        calls.append(len(params))
        return {n: p - 0.1 * grads[n] for n, p in params.items()}

    measure_layers(small_model(), torch.randn(8, 16), warmup=0, repeats=2, step=step)
    assert calls and set(calls) == {2}  # the two linear layers' and the norm's weight + bias


def test_old_profiles_without_update_times_still_load():
    d = LayerProfile(0.001, 0.002, 10, 0, 20, 30, 40, 0.0005).to_dict()
    assert LayerProfile.from_dict(d).update_s == 0.0005
    del d["update_s"]
    assert LayerProfile.from_dict(d).update_s == 0.0


def test_measure_model_finds_a_call_term_and_nets_it_out_of_the_layers():
    # many small layers: each layer timed alone pays its own forward and backward call,
    # which one stage of them all pays once
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(8) for m in (nn.Linear(8, 8), nn.ReLU())))
    x = torch.randn(8, 8)
    got = measure_model(model, x, warmup=2, repeats=15)
    assert got.call.fwd_s > 0 and got.call.bwd_s > 0 and got.call.update_s >= 0
    prof = ModelProfile("m", 8, 256, {"cpu": got.layers}, {"cpu": got.call})
    n = len(got.layers)
    whole = prof.stage_times("cpu", 0, n)
    ones = [prof.stage_times("cpu", i, i + 1) for i in range(n)]
    # n one-layer stages pay n calls where one stage of every layer pays one; the first
    # layer's input needs no gradient, so its backward is no call (alone or in a stage)
    net_f = [max(0.0, o.fwd_s - got.call.fwd_s) for o in ones]
    assert whole.fwd_s == pytest.approx(sum(net_f) + got.call.fwd_s)
    assert sum(o.fwd_s for o in ones) > whole.fwd_s
    assert sum(o.bwd_s for o in ones) > whole.bwd_s


def test_measure_model_pads_the_call_term_like_the_layers():
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(6) for m in (nn.Linear(8, 8), nn.ReLU())))
    got = measure_model(model, torch.randn(8, 8), speed=0.25, warmup=1, repeats=9)
    # a call alone costs tens of microseconds on any CPU; padded to 4x, it is over 10 us
    assert got.call.fwd_s > 1e-5 and got.call.bwd_s > 1e-5
    with pytest.raises(ValueError, match="speed"):
        measure_model(model, torch.randn(8, 8), speed=0)


def test_a_profile_at_another_speed_of_the_same_cores_scales_its_times_only():
    lps = (
        LayerProfile(1e-3, 2e-3, 10, 1, 20, 30, 40, 5e-4),
        LayerProfile(4e-3, 6e-3, 0, 0, 8, 0, 16, 0.0),
    )
    call = CallProfile(1e-4, 2e-4, 3e-5)
    # measured on an unslowed device; a 0.25 one pads the same compute to 4x
    got, got_call = at_speed(lps, call, 1.0, 0.25)
    for a, b in zip(lps, got, strict=True):
        assert (b.fwd_s, b.bwd_s, b.update_s) == pytest.approx(
            (4 * a.fwd_s, 4 * a.bwd_s, 4 * a.update_s)
        )
        assert (b.param_bytes, b.buffer_bytes, b.out_bytes, b.saved_bytes, b.work_bytes) == (
            a.param_bytes,
            a.buffer_bytes,
            a.out_bytes,
            a.saved_bytes,
            a.work_bytes,
        )
    assert got_call is not None and (got_call.fwd_s, got_call.bwd_s, got_call.update_s) == (
        pytest.approx((4e-4, 8e-4, 1.2e-4))
    )
    # from a 0.5 device to a 0.25 one: twice; a speed above 1 is never divided by
    assert at_speed(lps, None, 0.5, 0.25)[0][0].fwd_s == pytest.approx(2e-3)
    assert at_speed(lps, None, 0.5, 2.0) == (at_speed(lps, None, 0.5, 1.0)[0], None)
    assert at_speed(lps, call, 1.0, 1.0) == (lps, call)


def test_a_stage_is_its_layers_plus_the_call_term_once():
    lp = LayerProfile(1e-3, 2e-3, 10, 0, 20, 30, 40, 5e-4)
    call = CallProfile(3e-4, 7e-4, 1e-4)
    prof = ModelProfile("m", 8, 20, {"x": (lp,) * 5}, {"x": call})
    for a, b in ((0, 1), (1, 3), (0, 5)):
        t = prof.stage_times("x", a, b)
        n = b - a
        assert t.fwd_s == pytest.approx(n * 1e-3 + 3e-4)
        assert t.bwd_s == pytest.approx(n * 2e-3 + 7e-4)
        assert t.update_s == pytest.approx(n * 5e-4 + 1e-4)
        assert t.time_s == pytest.approx(n * lp.time_s + call.time_s)
    # no term measured for a type: its stages are their layers alone
    bare = ModelProfile("m", 8, 20, {"x": (lp,) * 5})
    assert bare.stage_times("x", 0, 5).time_s == pytest.approx(5 * lp.time_s)
    # the term stays when the profile is scaled to another minibatch
    assert prof.scaled(16).call("x") == call
    with pytest.raises(ValueError, match="unprofiled type"):
        ModelProfile("m", 8, 20, {"x": (lp,)}, {"y": call})


def test_profiles_without_a_call_term_still_load(tmp_path):
    a = synthetic_profile(4, {"x": 1.0, "y": 0.5}, 2, call=(1e-4, 2e-4, 3e-5))
    assert a.call("y") == CallProfile(2e-4, 4e-4, 6e-5)
    assert ModelProfile.from_dict(json.loads(json.dumps(a.to_dict()))) == a
    old = a.to_dict()
    del old["calls"]
    assert ModelProfile.from_dict(old).call("x") == CallProfile()
    assert CallProfile.from_dict({"fwd_s": 1e-4}) == CallProfile(1e-4, 0.0, 0.0)
    # a store written before the term: its types load with none; a measured one round trips
    path = tmp_path / "profiles.json"
    lps = a.layers["x"]
    store = ProfileStore(path)
    store.put("m", 32, "x", lps, input_bytes=64)
    store.save()
    data = json.loads(path.read_text())
    del data["models"]["m"]["32"]["calls"]
    path.write_text(json.dumps(data))
    again = ProfileStore(path)
    assert again.model_profile("m", 32).call("x") == CallProfile()
    again.put("m", 32, "y", a.layers["y"], call=a.call("y"))
    again.save()
    prof = ProfileStore(path).model_profile("m", 32)
    assert prof.call("y") == a.call("y") and prof.call("x") == CallProfile()
    # measured again without a term (an old worker): the stale term goes with the layers
    again.put("m", 32, "y", a.layers["y"])
    assert again.get_call("m", 32, "y") == CallProfile()


def test_measure_layers_says_which_saved_bytes_are_a_layers_input_and_output():
    """A Linear saves its input, a ReLU its output, a Flatten's output is a view of its
    input (held with it): the bytes the memory model counts once (memory.activation_bytes)."""
    x = torch.randn(8, 2, 4)
    net = nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    flat, lin, relu, last = measure_layers(net, x, repeats=1, warmup=0)
    assert (flat.saved_input_bytes, flat.saved_output_bytes) == (0, 8 * 8 * 4)
    assert (lin.saved_input_bytes, lin.saved_output_bytes) == (8 * 8 * 4, 0)
    assert (relu.saved_input_bytes, relu.saved_output_bytes) == (0, 8 * 16 * 4)
    assert (last.saved_input_bytes, last.saved_output_bytes) == (8 * 16 * 4, 0)
    assert all(
        lp.saved_input_bytes + lp.output_saved <= max(lp.saved_bytes, lp.out_bytes)
        for lp in (flat, lin, relu, last)
    )


def test_old_profiles_without_saved_ends_load_as_the_count_before_them(tmp_path):
    """A layer saved before its saved input and output were measured loads with none of
    its saved bytes its input and its whole output saved: nothing corrected; a version-1
    store still loads and is written back as version 2."""
    d = LayerProfile(0.001, 0.002, 10, 0, 20, 30, 40, 0.0, 8, 0).to_dict()
    assert LayerProfile.from_dict(d) == LayerProfile(0.001, 0.002, 10, 0, 20, 30, 40, 0.0, 8, 0)
    del d["saved_input_bytes"], d["saved_output_bytes"]
    old = LayerProfile.from_dict(d)
    assert (old.saved_input_bytes, old.saved_output_bytes) == (0, 20)
    path = tmp_path / "profiles.json"
    v1 = {"version": 1, "models": {"m": {"32": {"input_bytes": 4, "types": {"t": [d]}}}}}
    path.write_text(json.dumps(v1))
    store = ProfileStore(path)
    assert store.get("m", 32, "t") == (old,)
    store.save()
    assert json.loads(path.read_text())["version"] == 2
    path.write_text(json.dumps({**v1, "version": 3}))
    with pytest.raises(ValueError, match="version-2"):
        ProfileStore(path)
