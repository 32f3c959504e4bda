"""The parts a stage's compute owns, on their own: weight versions and wave accumulators,
gradients awaiting the step, prediction probes, checkpoint state, and the read-through names
of :class:`hetpipe.stage.StageCompute`. No model, no process: a two-tensor layout."""

from __future__ import annotations

import torch
from torch import nn

from hetpipe import stagestate
from hetpipe.gradients import Gradients
from hetpipe.hostcopy import HostCopier
from hetpipe.modelstate import StateLayout
from hetpipe.optim import StageOptimizer
from hetpipe.probes import Probes
from hetpipe.stage import StageCompute
from hetpipe.versions import WeightVersions


class _Opt:
    """An optimizer spec: plain SGD."""

    name = "sgd"
    lr = 0.5
    momentum = 0.0
    nesterov = False
    weight_decay = 0.0
    betas = (0.9, 0.999)
    eps = 1e-8


def _versions(num_vws: int = 1, sync: bool = False) -> WeightVersions:
    layout = StateLayout.of(nn.Sequential(nn.BatchNorm1d(2)))
    wv = WeightVersions(
        layout,
        StageOptimizer(_Opt()),
        {},
        "cpu",
        HostCopier("cpu"),
        num_vws=num_vws,
        sync=sync,
    )
    wv.params = {
        "0.weight": torch.ones(2, requires_grad=True),
        "0.bias": torch.zeros(2, requires_grad=True),
    }
    wv.buffers = {
        "0.running_mean": torch.zeros(2),
        "0.running_var": torch.ones(2),
        "0.num_batches_tracked": torch.tensor(0),
    }
    return wv


def test_an_update_is_a_new_version_and_its_delta_joins_its_wave() -> None:
    """The step leaves the old weights untouched, bumps the version and the step count, and
    the update accumulates per wave; carrying a wave adds it into the next one's."""
    wv = _versions()
    old = wv.params
    deltas = wv.update({"0.weight": torch.ones(2)})
    assert deltas is not None and wv.params is not old
    assert torch.equal(old["0.weight"], torch.ones(2))
    assert torch.equal(wv.params["0.weight"], torch.full((2,), 0.5))
    assert (wv.version, wv.steps_taken) == (1, 1)
    assert torch.equal(deltas["0.weight"], torch.full((2,), -0.5))
    # each update is a fresh tensor: the first of a wave becomes its accumulator
    wv.accumulate(0, deltas)
    wv.accumulate(0, {"0.weight": torch.full((2,), -0.5)})
    assert torch.equal(wv.acc[0]["0.weight"], torch.full((2,), -1.0))
    wv.accumulate(1, {"0.weight": torch.full((2,), -0.5)})
    wv.carry(0)
    assert list(wv.acc) == [1] and torch.equal(wv.acc[1]["0.weight"], torch.full((2,), -1.5))
    assert wv.update({}) is None and wv.version == 1  # no gradients: no step


def test_a_merge_readds_the_waves_the_shard_had_not_applied() -> None:
    """A pulled weight plus this stage's unconfirmed updates; a wave confirmed for a name is
    dropped for it."""
    wv = _versions()
    wv.accumulate(0, {"0.weight": torch.full((2,), 1.0)})
    wv.accumulate(1, {"0.weight": torch.full((2,), 2.0)})
    pulled = {"0.weight": torch.zeros(2)}
    wv.load(pulled, {"0.weight": [[0, 1]]})  # the shard had applied wave 0, not 1
    assert torch.equal(wv.params["0.weight"], torch.full((2,), 2.0))
    assert wv.params["0.weight"].requires_grad
    assert list(wv.acc) == [1] and wv.version == 1


def test_sync_pushes_each_virtual_workers_share_of_float_updates() -> None:
    wv = _versions(num_vws=2, sync=True)
    wv.accumulate(0, {"0.weight": torch.full((2,), 4.0), "0.num_batches_tracked": torch.tensor(2)})
    got = wv.push_deltas(0).wait()
    assert torch.equal(got["0.weight"], torch.full((2,), 2.0))
    assert int(got["0.num_batches_tracked"]) == 2  # counters stay summed
    assert 0 in wv.acc  # kept until a pull shows it applied
    wv.push_deltas(0, keep=False)
    assert not wv.acc


def test_gradients_sum_by_samples_and_a_merged_mean_wins() -> None:
    grads = Gradients("cpu", HostCopier("cpu"))
    grads.add({"w": torch.full((2,), 1.0)}, 1)
    grads.add({"w": torch.full((2,), 4.0)}, 3)
    total, samples = grads.to_host()
    assert samples == 4 and torch.equal(total.wait()["w"], torch.full((2,), 13.0))
    assert torch.equal(grads.take_mean()["w"], torch.full((2,), 13.0 / 4))
    assert (grads.sum, grads.samples, grads.merged) == ({}, 0, None)
    grads.add({"w": torch.ones(2)}, 2)
    grads.merge({"w": torch.full((2,), 7.0)})
    assert torch.equal(grads.take_mean()["w"], torch.full((2,), 7.0))


def test_probes_start_in_turn_and_score_the_prediction() -> None:
    """One probe at a time, the next at least ``every`` minibatches after the last started;
    judged once the stage reached its target step: ||hat - now|| / ||stale - now||."""
    probes = Probes("cpu")
    probes.every = 3
    hat, stale = {"w": torch.full((2,), 1.0)}, {"w": torch.zeros(2)}
    probes.offer(0, 2, hat, stale, late=True)
    first = probes.probe
    probes.offer(1, 3, {"w": torch.ones(2)}, stale, late=False)
    assert probes.probe is first  # one outstanding
    now = {"w": torch.full((2,), 2.0)}
    assert probes.judge(now, 1) is None and probes.probe is first  # not there yet
    assert probes.judge(now, 2) is hat and probes.probe is None  # late: released by the stage
    probes.offer(2, 4, hat, stale, late=False)
    assert probes.probe is None  # not its turn: 0 + 3
    probes.offer(3, 5, hat, stale, late=False)
    assert probes.probe is not None
    assert list(probes.read(block=True)) == [0.5]


def test_checkpoint_state_round_trips_through_save_and_restore() -> None:
    wv = _versions()
    deltas = wv.update({"0.weight": torch.ones(2)})
    assert deltas is not None
    wv.accumulate(0, deltas)
    meta, tensors = stagestate.save(wv, 1)
    assert meta["kept_waves"] == [0] and "acc/0/0.weight" in tensors
    back = _versions()
    stagestate.restore(back, meta, tensors, weights=True, where="here")
    assert (back.version, back.steps_taken) == (1, 1)
    for name, t in wv.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    assert not back.acc  # kept accumulators are the cut's, not taken back


def test_stage_compute_names_read_through_to_their_owners() -> None:
    """``StageCompute.params`` and the other names the runtime and tests read are the owning
    objects' attributes, read and set in place."""

    class Stub:
        params = StageCompute.params
        probe_every = StageCompute.probe_every

    stub = Stub()
    stub.wv = _versions()  # type: ignore[attr-defined]
    stub.probes = Probes("cpu")  # type: ignore[attr-defined]
    assert stub.params is stub.wv.params  # type: ignore[attr-defined]
    stub.probe_every = 5
    assert stub.probes.every == 5  # type: ignore[attr-defined]
