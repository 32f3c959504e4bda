"""Several tensors crossing a cut: carries (a tensor or a tuple of tensors) through the stages'
forward and backward, on the wire between them, in the profile the planner prices, and end to
end against plain PyTorch.

The models (``tests/usermodels.py``): ``residual_net``, whose residual blocks are cut into
elements passing ``(branch, skip)``, and ``masked_seq``, whose elements pass a hidden state
with integer position ids and a boolean mask (its first element outputs integers only).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same_weights, job, user_code_cluster
from helpers import InlineExecutor, StandInCompute, plain_training, stand_in_stream

from hetpipe import carry
from hetpipe.config import DeviceSpec
from hetpipe.core.layout import StageLayout
from hetpipe.core.schedule import Forward
from hetpipe.data import MinibatchStream, load_dataset
from hetpipe.job import JobSpec
from hetpipe.localcluster import LocalCluster
from hetpipe.measure import measure_layers
from hetpipe.models import build_model, model_loss
from hetpipe.pipeline import StageRunner
from hetpipe.planner import ModelProfile, ProfileStore
from hetpipe.planner.partition import CostModel
from hetpipe.profiling import model_key
from hetpipe.replicas import gather, piece
from hetpipe.stage import StageCompute
from hetpipe.task import StageTask
from hetpipe.wire import Kind, Message

HERE = Path(__file__).resolve().parent
CPU = DeviceSpec("gpu0", "cpu", "fast", 1 << 30, 1.0, 0, "n", "h")


def stages(
    model: str,
    cuts: list[int],
    *,
    precision: str = "fp32",
    args: dict[str, Any] | None = None,
) -> list[StageCompute]:
    """The stages of ``usermodels:<model>`` cut at ``cuts`` (ascending layer indices), in
    one process, each with the initial weights of ``torch.manual_seed(0)``."""
    spec = JobSpec.from_dict(
        job(
            "unit",
            model=f"usermodels:{model}",
            model_args=args,
            minibatches=4,
            train={"precision": precision},
        )
    )
    torch.manual_seed(0)
    full = build_model(spec.model.name, spec.model.args)
    state = full.state_dict()
    bounds = [0, *cuts, len(full)]
    out = []
    for s, (first, last) in enumerate(itertools.pairwise(bounds)):
        task = StageTask.standalone(
            "unit",
            spec.to_dict(),
            StageLayout(("gpu0",), first, last),
            stage=s,
            k=len(bounds) - 1,
            minibatches=4,
        )
        c = StageCompute(task, CPU)
        names = c.state_names()
        c.load({k: state[k] for k in names}, {k: [] for k in names})
        out.append(c)
    return out


def pipelined(cs: list[StageCompute], p: int, x: Any, y: Any) -> list[Any]:
    """Minibatch ``p`` forward through the stages and back; the carries each stage sent
    forward (the last stage's: None) and the gradients each sent back, stage by stage."""
    sent, back = [], []
    act = x
    for c in cs:
        act = c.forward(p, act, y)
        sent.append(act)
    grad = None
    for c in reversed(cs):
        grad = c.backward(p, grad)
        back.append(grad)
    return [sent, back[::-1]]


def plain_grads(model: str, x: Any, y: Any, args: dict[str, Any] | None = None) -> dict:
    """The weight gradients of plain PyTorch on the same module, weights and minibatch."""
    torch.manual_seed(0)
    m = build_model(f"usermodels:{model}", args or {})
    m.train()
    model_loss(f"usermodels:{model}")(m(x), y).backward()
    return {n: t.grad for n, t in m.named_parameters() if t.grad is not None}


def batch(p: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return MinibatchStream(load_dataset("digits"), 32, 0, 0, 1).batch(p)


def assert_grads_equal(cs: list[StageCompute], p: int, want: dict) -> None:
    got = {n: g for c in cs for n, g in c.pending[p].items()}
    assert set(got) == set(want)
    for n, g in want.items():
        assert torch.allclose(got[n], g, atol=1e-6, rtol=1e-5), n


# -- the names on the wire ------------------------------------------------------------------


def test_carry_names_round_trip_and_refusals() -> None:
    """A bare tensor keeps its one name; a tuple's tensors are ``x.<i>``, a dict target's
    ``y.<key>``, a missing target none; a set of names that forms no carry is refused in
    one line."""
    a, b = torch.ones(2), torch.zeros(2, dtype=torch.long)
    assert carry.names(a, "x") == {"x": a}
    assert list(carry.names((a, b), "x")) == ["x.0", "x.1"]
    assert carry.names(None, "y") == {} and list(carry.names({"labels": b}, "y")) == ["y.labels"]
    x, y = carry.message_parts({**carry.names((a, b), "x"), "y.labels": b}, "act 0")
    assert isinstance(x, tuple) and x[0] is a and x[1] is b and y == {"labels": b}
    assert carry.message_parts({"x": a}, "act 0") == (a, None)
    assert carry.gradient_of({"g.0": a}, "grad 0") == (a,)
    for names, problem in [
        ({"x": a, "x.0": a}, "both 'x' and x.<i>"),
        ({"x.0": a, "x.2": a}, "are not a carry"),
        ({"y": a}, "carries no tensor 'x'"),
        ({"x": a, "z": a}, "neither activation nor target"),
    ]:
        with pytest.raises(ValueError, match=problem) as info:
            carry.message_parts(names, "act 0")
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="not a gradient"):
        carry.gradient_of({"g.0": a, "x": a}, "grad 0")
    assert carry.nbytes((a, b)) == 8 + 16 and carry.float_bytes((a, b)) == 8
    assert carry.samples(None, {"x": torch.ones(5, 3)}) == 5


# -- in process: the stages equal the plain module ------------------------------------------


@pytest.mark.parametrize(
    ("model", "cuts"),
    [
        ("residual_net", [2]),  # after a Branch: (a, skip)
        ("residual_net", [1, 3, 5]),  # a bare tensor, then two tuples
        ("residual_net", [2, 6, 7]),
        ("residual_net", [2, 4]),  # a tuple in, one tensor out
        ("masked_seq", [2]),  # (h, pos, mask): one gradient, for h
        ("masked_seq", [1, 3]),  # stage 1's input is integer and boolean only
    ],
)
def test_stages_equal_the_plain_module(model: str, cuts: list[int]) -> None:
    """Cut anywhere, the stages' weight gradients are plain PyTorch's; a tuple carry goes
    forward as a tuple and its gradient comes back as one tensor per floating tensor."""
    cs = stages(model, cuts)
    x, y = batch()
    sent, back = pipelined(cs, 0, x, y)
    assert_grads_equal(cs, 0, plain_grads(model, x, y))
    assert back[0] is None  # the first stage sends no gradient
    for out, grad in zip(sent[:-1], back[1:], strict=True):
        floats = [t for t in carry.tensors(out) if t.is_floating_point()]
        if isinstance(out, torch.Tensor):
            assert isinstance(grad, torch.Tensor) and grad.shape == out.shape
        elif not floats:  # nothing to differentiate: an empty tensor still answers
            assert isinstance(grad, torch.Tensor) and grad.numel() == 0
        else:
            assert isinstance(grad, tuple)
            assert [g.shape for g in grad] == [t.shape for t in floats]


def test_a_second_minibatch_and_its_step_keep_equal() -> None:
    """Through steps too: after two minibatches and their updates the gradients of a third
    are plain PyTorch's after the same two SGD steps."""
    cs = stages("residual_net", [2, 5], args={"norm": False})
    torch.manual_seed(0)
    m = build_model("usermodels:residual_net", {"norm": False})
    spec = cs[0].spec
    opt = torch.optim.SGD(
        m.parameters(),
        lr=spec.optimizer.lr,
        momentum=spec.optimizer.momentum,
        weight_decay=spec.optimizer.weight_decay,
    )
    for p in range(3):
        x, y = batch(p)
        pipelined(cs, p, x, y)
        opt.zero_grad()
        model_loss("usermodels:residual_net")(m(x), y).backward()
        assert_grads_equal(cs, p, {n: t.grad for n, t in m.named_parameters()})
        for c in cs:
            c.step(p)
        opt.step()


def test_first_input_as_dict_or_tuple_and_target_as_dict_or_none() -> None:
    """The first stage takes the batch as a dict or a tuple, the last stage's loss a dict
    target or none; the gradients are the same module's."""
    x, y = batch()
    want = plain_grads("masked_seq", x, y)
    for p, (inp, target) in enumerate([({"x": x}, {"labels": y}), ((x,), y)]):
        cs = stages("masked_seq", [2])
        pipelined(cs, p, inp, target)
        assert_grads_equal(cs, p, want)
    cs = stages("masked_seq", [2])
    pipelined(cs, 0, {"x": x}, None)  # the model's own loss
    assert_grads_equal(cs, 0, plain_grads("masked_seq", x, None))


def test_bf16_casts_each_floating_tensor() -> None:
    """Under bf16 a carry's floating tensors travel in bfloat16, its integer and boolean ones
    as they are, and the gradients come back in bfloat16."""
    cs = stages("masked_seq", [2], precision="bf16")
    x, y = batch()
    sent, back = pipelined(cs, 0, x, y)
    h, pos, mask = sent[0]
    assert (h.dtype, pos.dtype, mask.dtype) == (torch.bfloat16, torch.int64, torch.bool)
    assert len(back[1]) == 1 and back[1][0].dtype == torch.bfloat16


def test_recomputed_and_swapped_layers_with_tuple_carries() -> None:
    """A stage recomputing or swapping its tuple-carrying layers trains the same gradients."""
    x, y = batch()
    want = plain_grads("residual_net", x, y)
    for policy in ("recompute", "swap"):
        cs = stages("residual_net", [2])
        spec = cs[1].task.spec
        task = StageTask.standalone(
            "unit",
            spec,
            StageLayout(("gpu0",), 2, 8, **{policy: (2, 3, 4)}),
            stage=1,
            k=2,
            minibatches=4,
        )
        c = StageCompute(task, CPU)
        torch.manual_seed(0)
        state = build_model("usermodels:residual_net").state_dict()
        c.load({k: state[k] for k in c.state_names()}, {k: [] for k in c.state_names()})
        cs[1] = c
        pipelined(cs, 0, x, y)
        assert_grads_equal(cs, 0, want)
        # the layers' bytes count every tensor of their carries: BranchMore's input is the
        # tuple (a, skip) of two [32, 32] float32 tensors
        (known,) = c._layer_bytes.values()
        assert known.inputs[:3] == [2 * 32 * 32 * 4, 2 * 32 * 32 * 4, 32 * 32 * 4]


# -- the runner: messages of several tensors ------------------------------------------------


def runner(stage: int = 1, k: int = 3, **task: Any) -> StageRunner:
    compute = StandInCompute("async", k, stage, 1, 4)
    if task:
        import dataclasses

        compute.task = dataclasses.replace(compute.task, **task)

    async def nothing(*_args: Any) -> None:
        pass

    return StageRunner(
        compute,
        InlineExecutor(),
        send=nothing,
        shards={},  # type: ignore[arg-type]
        report=nothing,
        stream=None,
    )


def test_runner_takes_carries_and_refuses_what_forms_none() -> None:
    """An activation of several tensors becomes its tuple carry with its target (a dict, or
    none); a gradient its tuple; names that form no carry are refused in one line."""
    r = runner()
    h, pos = torch.ones(4, 3), torch.arange(4)
    r.on_message(Message(Kind.ACT, {"p": 0}, {"x.0": h, "x.1": pos, "y.labels": pos}))
    x, y = r.acts[0]
    assert isinstance(x, tuple) and x[0] is h and x[1] is pos and y == {"labels": pos}
    r.on_message(Message(Kind.ACT, {"p": 1}, {"x.0": h}))
    assert r.acts[1] == ((h,), None)
    r.on_message(Message(Kind.ACT, {"p": 2}, {"x": h, "y": pos}))  # the plain case
    assert r.acts[2] == (h, pos)
    r.on_message(Message(Kind.GRAD, {"p": 0}, {"g.0": h}))
    assert r.grads[0] == (h,)
    for kind, tensors, problem in [
        (Kind.ACT, {"x.0": h, "x.2": h, "y": pos}, "not a carry"),
        (Kind.ACT, {"x": h, "x.0": h}, "both"),
        (Kind.ACT, {"x": h, "w": h}, "neither activation nor target"),
        (Kind.ACT, {"y": pos}, "carries no tensor 'x'"),
        (Kind.GRAD, {"g": h, "x": h}, "not a gradient"),
        (Kind.GRAD, {}, "carries no tensor 'g'"),
    ]:
        with pytest.raises(ValueError, match=problem) as info:
            r.on_message(Message(kind, {"p": 3}, tensors))
        assert "\n" not in str(info.value) and 3 not in r.acts and 3 not in r.grads


def test_replica_pieces_per_tensor() -> None:
    """Rows are split and gathered per tensor of a carry; a tensor that is not row-major
    travels whole: gathered as one activation, summed as the replicas' gradients."""
    h = torch.arange(32.0).reshape(32, 1)
    whole = torch.arange(5)  # e.g. one sequence's position ids, not per row
    mine = (0, 32)
    parts = {
        lo: (piece(h, mine, lo, hi), piece(whole, mine, lo, hi)) for lo, hi in [(0, 13), (13, 32)]
    }
    ends = {0: 13, 13: 32}
    assert torch.equal(gather({lo: p[0] for lo, p in parts.items()}, ends), h)
    assert torch.equal(gather({lo: p[1] for lo, p in parts.items()}, ends), whole)
    g = {0: torch.ones(5), 13: torch.ones(5)}
    assert torch.equal(gather(g, ends, add=True), torch.full((5,), 2.0))
    r = runner(
        layout=StageLayout(("a", "b"), 0, 1, rows=(0, 21, 32)),
        prev=StageLayout(("p0", "p1"), 0, 1, rows=(0, 13, 32)),
    )
    y = torch.arange(32)

    def act(lo: int, hi: int) -> Message:
        tensors = {"x.0": h[lo:hi], "x.1": whole, "y": y[lo:hi]}
        return Message(Kind.ACT, {"p": 0, "rows": [lo, hi]}, tensors)

    r.on_message(act(13, 21))
    r.on_message(act(0, 13))
    (got_h, got_whole), got_y = r.acts[0]
    assert torch.equal(got_h, h[:21]) and torch.equal(got_whole, whole)
    assert torch.equal(got_y, y[:21])


# -- the planner's per-cut bytes are what the runtime sends ---------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_planned_cut_bytes_are_the_bytes_sent(precision: str) -> None:
    """The profile's ``out_bytes`` of the layer before a cut (what the planner prices the cut
    at) equals the activation bytes the runtime sends there, a cut inside a residual block
    (two tensors) as well as one between blocks."""
    x, y = batch()
    torch.manual_seed(0)
    layers = measure_layers(
        build_model("usermodels:residual_net"), x, repeats=1, warmup=0, precision=precision
    )
    profile = ModelProfile("residual_net", 32, carry.nbytes(x), {"fast": layers})
    # the planner's cost tables: the bytes a stage ending at a cut sends on, per cut
    planned = CostModel(profile, lambda _a, _b: 1.0, 1).costs("fast").outb
    for cut in (1, 2, 3, 5):
        (first, _rest) = stages("residual_net", [cut], precision=precision)
        r = runner(stage=0, k=2)
        r.compute, r.task = first, first.task  # type: ignore[assignment]
        r.stream = stand_in_stream((x, y))  # type: ignore[assignment]
        sent: list[dict[str, torch.Tensor]] = []

        async def send(kind: str, p: int, tensors: dict, *_more: Any, out: list = sent) -> None:
            out.append(tensors)

        r.send = send  # type: ignore[assignment]
        asyncio.run(r._compute_run([Forward(0)]))
        (tensors,) = sent
        acts = {n: t for n, t in tensors.items() if n != "y"}
        assert len(acts) == (2 if cut in (2, 3, 5) else 1), sorted(acts)
        assert sum(carry.nbytes(t) for t in acts.values()) == planned[cut]


# -- end to end, against plain PyTorch ------------------------------------------------------

STEPS = 30
M = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four devices, two shards; the daemons may import ``usermodels``."""
    c = user_code_cluster(tmp_path_factory, "usermodels")
    yield c
    c.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("model", "args", "layers", "schedule"),
    [
        ("residual_net", {}, [2, 6], "async"),  # (a, skip) crosses the cut
        ("residual_net", {}, [2, 3, 2, 1], "async"),
        ("residual_net", {"norm": False}, [3, 5], "1f1b"),
        ("residual_net", {"norm": False}, [2, 1, 3, 2], "1f1b"),
        ("masked_seq", {}, [2, 4], "async"),  # (h, pos, mask)
        ("masked_seq", {}, [1, 1, 2, 2], "async"),  # an integer-only carry too
        ("masked_seq", {}, [1, 2, 1, 2], "1f1b"),
    ],
)
def test_carries_train_plain_pytorchs_weights(cluster, model, args, layers, schedule) -> None:
    """k = 2 and 4, Nm = 1 async and 1f1b: the pipelined weights equal plain PyTorch's."""
    devices = [f"gpu{i}" for i in range(len(layers))]
    sync = schedule != "async"
    spec = job(
        f"carries-{model}-{len(layers)}-{schedule}",
        model=f"usermodels:{model}",
        model_args=args,
        split=[(devices, layers)],
        nm=M if sync else 1,
        minibatches=STEPS * (M if sync else 1),
        train={"schedule": schedule},
    )
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    got = torch.load(info["model_path"])
    assert_same_weights(got, plain_training(spec, STEPS, m=M if sync else 1))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_carries_through_a_replicated_stage(cluster) -> None:
    """A stage replicated on two devices splits and gathers a tuple carry by rows (its
    gradients as well; position ids of one row for the minibatch travel whole) and still
    trains plain PyTorch's weights."""
    spec = job(
        "carries-replicas",
        model="usermodels:masked_seq",
        model_args={"per_row": False},
        split=[(["gpu0", ["gpu1", "gpu2"], "gpu3"], [2, 2, 2])],
        nm=1,
        minibatches=STEPS,
    )
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    assert_same_weights(torch.load(info["model_path"]), plain_training(spec, STEPS))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_planned_job_prices_every_tensor_of_a_cut(cluster) -> None:
    """Without a split, the workers profile the model for the head's planner: the profile's
    bytes after a layer that opens a residual block count the branch and the skip, and the
    planned job trains."""
    spec = job("carries-planned", model="usermodels:residual_net", minibatches=20)
    spec["train"].pop("nm")
    spec["train"]["vws"] = 1
    info = cluster.submit(spec, timeout=280)
    assert info["state"] == "done", info.get("error")
    store = ProfileStore(cluster.run_dir / "profiles.json")
    prof = store.model_profile(model_key(JobSpec.from_dict(spec)), 32)
    assert prof is not None
    one = 32 * 32 * 4  # a [32, 32] float32 activation
    # layers 0 Stem, 1 Branch -> (a, skip), 2 BranchMore -> (a, skip), 3 Join, ...
    assert [lp.out_bytes for lp in prof.layers["fast"][:4]] == [one, 2 * one, 2 * one, one]
    assert prof.input_bytes == 32 * 64 * 4
