"""Transparency on a model written as people write it: an ``nn.Module`` subclass, captured.

``usermodels:small_resnet`` is a ResNet with batch norm (a stem, an ``nn.ModuleList`` of
basic blocks whose forward adds the skip, a pooled head), not an ``nn.Sequential``. hetpipe
captures it into blocks at the job's ``model.split_points``, chosen so that a cut falls
inside a residual block and two tensors (the branch's activation and the skip) cross it.
Trained at k = 2 and 4, asynchronously with Nm = 1 and with the ``1f1b`` schedule, the
weights equal plain PyTorch training of the same module within 1e-5, and ``model.pt`` loads
strict into a fresh instance of the user's class. The planner prices each cut at the bytes
the runtime sends there, both tensors of a cut inside a block.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same_weights, job, user_code_cluster
from helpers import InlineExecutor, plain_training, stand_in_stream
from usermodels import Decoder, SmallResNet

from hetpipe import carry
from hetpipe.capture import capture_of, user_state
from hetpipe.config import DeviceSpec
from hetpipe.core.layout import StageLayout
from hetpipe.core.schedule import Forward
from hetpipe.data import MinibatchStream, load_dataset
from hetpipe.job import JobSpec
from hetpipe.localcluster import LocalCluster
from hetpipe.measure import measure_layers
from hetpipe.models import build_model
from hetpipe.pipeline import StageRunner
from hetpipe.planner import ModelProfile
from hetpipe.planner.partition import CostModel
from hetpipe.stage import StageCompute
from hetpipe.task import StageTask

HERE = Path(__file__).resolve().parent
CPU = DeviceSpec("gpu0", "cpu", "fast", 1 << 30, 1.0, 0, "n", "h")
STEPS = 20

# split points -> the blocks: k = 2 cuts inside layers.1 (before its second convolution);
# k = 4 as well, with the stem and layers.2 + head as stages of their own; the third split
# cuts layers.1 twice, so two of its three cuts carry two tensors
K2 = ("layers.1.conv2",)
K4 = ("layers.0", "layers.1.conv2", "layers.2")
K4_TWICE = ("layers.1.bn1", "layers.1.bn2", "head")


def resnet_job(name: str, points: tuple[str, ...], schedule: str) -> dict[str, Any]:
    """A job of ``small_resnet`` with one stage per block (``len(points) + 1`` stages), Nm = 1."""
    k = len(points) + 1
    spec = job(
        name,
        model="usermodels:small_resnet",
        split=[([f"gpu{i}" for i in range(k)], [1] * k)],
        nm=1,
        minibatches=STEPS,
        train={"schedule": schedule},
    )
    spec["model"]["split_points"] = list(points)
    return spec


def test_the_cuts_carry_the_skip() -> None:
    """The blocks the jobs below train: a cut inside a residual block carries two tensors,
    the branch's activation and the skip; a cut between blocks one."""
    for points, widths in [(K2, [2]), (K4, [1, 2, 1]), (K4_TWICE, [2, 2, 1])]:
        spec = JobSpec.from_dict(resnet_job("t", points, "async"))
        cap = capture_of(build_model(spec.model))
        assert cap is not None and cap.starts == ("", *points)
        assert [len(c) for c in cap.carries[1:]] == widths, cap.carries


def test_blocks_apply_as_the_users_module() -> None:
    """The captured blocks applied in order give the user's module's output and gradients,
    in training mode (batch statistics) and in eval mode (running statistics)."""
    spec = JobSpec.from_dict(resnet_job("t", K4_TWICE, "async"))
    torch.manual_seed(0)
    seq = build_model(spec.model)
    user = capture_of(seq).source
    x = torch.rand(16, 1, 8, 8)
    for train in (True, False):
        seq.train(train)
        out = x
        for block in seq:
            out = block(out)
        assert torch.equal(out, user(x))
    seq.train()
    out = x
    for block in seq:
        out = block(out)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in user.named_parameters()}
    user.zero_grad()
    user(x).square().sum().backward()
    for n, p in user.named_parameters():
        assert torch.allclose(p.grad, grads[n], atol=1e-6), n


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_planned_cut_bytes_are_the_bytes_sent(precision: str) -> None:
    """The profile's ``out_bytes`` of the block before each cut (what the planner prices the
    cut at) equals the bytes the first stage sends there: both tensors of a cut inside a
    residual block, one tensor at a cut between blocks."""
    spec = resnet_job("t", K4_TWICE, "async")
    spec["train"]["precision"] = precision
    job_spec = JobSpec.from_dict(spec)
    x, y = MinibatchStream(load_dataset("digits"), 32, 0, 0, 1).batch(0)
    torch.manual_seed(0)
    model = build_model(job_spec.model)
    layers = measure_layers(model, x, repeats=1, warmup=0, precision=precision)
    profile = ModelProfile("small_resnet", 32, carry.nbytes(x), {"fast": layers})
    planned = CostModel(profile, lambda _a, _b: 1.0, 1).costs("fast").outb
    state = model.state_dict()
    for cut, tensors in [(1, 2), (2, 2), (3, 1)]:
        task = StageTask.standalone(
            "unit", job_spec.to_dict(), StageLayout(("gpu0",), 0, cut), stage=0, k=2
        )
        first = StageCompute(task, CPU)
        names = first.state_names()
        first.load({n: state[n] for n in names}, {n: [] for n in names})
        sent: list[dict[str, torch.Tensor]] = []

        async def send(_kind: str, _p: int, out: dict, *_more: Any, into: list = sent) -> None:
            into.append(out)

        r = StageRunner(
            first,
            InlineExecutor(),
            send=send,
            shards={},  # type: ignore[arg-type]
            report=send,
            stream=stand_in_stream((x, y)),
        )
        asyncio.run(r._compute_run([Forward(0)]))
        (out,) = sent
        acts = {n: t for n, t in out.items() if n != "y"}
        assert len(acts) == tensors, sorted(acts)
        assert sum(carry.nbytes(t) for t in acts.values()) == planned[cut]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four devices, two shards; the daemons may import ``usermodels``."""
    c = user_code_cluster(tmp_path_factory, "usermodels", "userdata")
    yield c
    c.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("points", "schedule"),
    [(K2, "async"), (K2, "1f1b"), (K4, "async"), (K4, "1f1b"), (K4_TWICE, "async")],
    ids=["k2-async", "k2-1f1b", "k4-async", "k4-1f1b", "k4-twice-async"],
)
def test_captured_resnet_trains_plain_pytorchs_weights(
    cluster: LocalCluster, points: tuple[str, ...], schedule: str
) -> None:
    """k = 2 and 4, Nm = 1 async and 1f1b: the pipelined weights, exported in the user's own
    keys, equal plain PyTorch training of the same module, and load strict into a fresh
    ``SmallResNet``."""
    spec = resnet_job(f"captured-{len(points) + 1}-{schedule}-{points[0]}", points, schedule)
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    got = torch.load(info["model_path"])
    torch.manual_seed(0)  # the job's seed: seq holds the initial weights
    seq = build_model(JobSpec.from_dict(spec).model)
    initial = user_state(seq, seq.state_dict())
    want = user_state(seq, plain_training(spec, STEPS))
    assert set(got) == set(SmallResNet().state_dict())
    assert_same_weights(got, want)
    assert not torch.allclose(got["layers.1.conv2.weight"], initial["layers.1.conv2.weight"])
    fresh = SmallResNet()
    fresh.load_state_dict(got, strict=True)
    assert torch.equal(fresh.layers[1].conv2.weight, got["layers.1.conv2.weight"])


# -- a decoder-only transformer: a tie across the first and last stage, a dict batch -----------

# usermodels:decoder's blocks: embed, pos, layers.0, layers.1, layers.2, norm, head; every
# split below puts the embedding and the head it is tied to on the first and last stage
DECODER_SPLITS = {2: [4, 3], 4: [2, 2, 2, 1]}


def decoder_job(k: int, schedule: str) -> dict[str, Any]:
    """``usermodels:decoder`` on ``userdata:tokens`` (mappings of input_ids, attention_mask
    and labels): the model takes the whole mapping and returns its own loss."""
    spec = job(
        f"decoder-{k}-{schedule}",
        model="usermodels:decoder",
        split=[([f"gpu{i}" for i in range(k)], DECODER_SPLITS[k])],
        nm=1,
        minibatch=4,
        minibatches=STEPS,
        train={"schedule": schedule},
        # asynchronously each copy of the tie steps on its own use's gradient: exact for SGD
        # without weight decay, which each copy would add once (docs/own-models.md)
        weight_decay=0,
    )
    spec["model"]["args"] = {"vocab": 50}
    spec["data"] = {"name": "userdata:tokens", "args": {}}
    return spec


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("schedule", ["async", "1f1b"])
def test_tied_decoder_on_dict_batches_trains_plain_pytorchs_weights(
    cluster: LocalCluster, k: int, schedule: str
) -> None:
    """A decoder-only transformer written as an ``nn.Module``: its input embedding tied to
    its output head across the first and last stage, an attention mask and the labels in a
    dict batch, the loss the model returns. The weights equal plain PyTorch training of the
    same module, and ``model.pt`` has the tie as the module does."""
    spec = decoder_job(k, schedule)
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    got = torch.load(info["model_path"])
    torch.manual_seed(0)
    seq = build_model(JobSpec.from_dict(spec).model)
    initial = user_state(seq, seq.state_dict())
    want = user_state(seq, plain_training(spec, STEPS))
    assert_same_weights(got, want)
    assert torch.equal(got["head.weight"], got["embed.weight"])
    assert not torch.allclose(got["embed.weight"], initial["embed.weight"])
    fresh = Decoder(vocab=50)
    fresh.load_state_dict(got, strict=True)
