"""Models from well-known libraries, unmodified, trained through a job whose only user code is
a factory function (``tests/libmodels.py``).

torchvision's ``resnet18`` is captured as any ``nn.Module`` (14 blocks), trained at k = 4 on
real daemons, equal to plain PyTorch training of the same module, and its ``model.pt`` loads
strict into a freshly built ``resnet18``. A Hugging Face causal language model (tiny Llama,
its head tied to its embedding) is captured by ``torch.export`` (7 blocks), trained at k = 4
equal to plain PyTorch training, and its ``model.pt`` loads strict into a fresh
``AutoModelForCausalLM.from_config``. The libraries are the ``libs`` extra; each
test skips, saying why, where its library is absent or does not import.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libmodels
import pytest
import torch
from conftest import assert_same_weights, job, user_code_cluster
from helpers import plain_training
from torch import nn

from hetpipe.capture import CaptureError, capture, capture_of, user_state
from hetpipe.cli import unshared
from hetpipe.job import JobSpec
from hetpipe.localcluster import LocalCluster
from hetpipe.models import build_model

HERE = Path(__file__).resolve().parent
STEPS = 8
NO_TORCHVISION = libmodels.missing("torchvision")
NO_TRANSFORMERS = libmodels.missing("transformers")
needs_torchvision = pytest.mark.skipif(NO_TORCHVISION is not None, reason=str(NO_TORCHVISION))
needs_transformers = pytest.mark.skipif(NO_TRANSFORMERS is not None, reason=str(NO_TRANSFORMERS))

# three-channel 16x16 images for the torchvision classifier
IMAGES = {"kind": "image", "input_shape": [3, 16, 16], "classes": 10, "n_train": 512}


def resnet_job(name: str) -> dict[str, Any]:
    """``libmodels:resnet18`` on four stages (14 blocks: conv1..maxpool, the eight basic
    blocks, avgpool and fc), Nm = 1."""
    spec = job(
        name,
        model="libmodels:resnet18",
        split=[([f"gpu{i}" for i in range(4)], [5, 3, 3, 3])],
        nm=1,
        minibatches=STEPS,
        data="synthetic",
    )
    spec["data"]["args"] = dict(IMAGES)
    return spec


@needs_torchvision
def test_resnet18_is_captured_as_torchvision_builds_it() -> None:
    """Its blocks are its natural units; applied in order they give torchvision's output."""
    spec = JobSpec.from_dict(resnet_job("t"))
    seq = build_model(spec.model)
    cap = capture_of(seq)
    assert cap is not None and len(seq) == 14
    assert cap.starts[4:6] == ("layer1.0", "layer1.1") and cap.starts[-1] == "fc"
    x = torch.randn(4, 3, 16, 16)
    seq.eval()
    out = x
    for block in seq:
        out = block(out)
    assert torch.equal(out, cap.source(x))
    assert set(user_state(seq, seq.state_dict())) == set(libmodels.resnet18().state_dict())
    # a split point inside a basic block: its input (for the skip's downsample) crosses the
    # cut beside the branch
    inside = capture(libmodels.resnet18(), ["layer2.0.conv2"])
    assert [len(c) for c in capture_of(inside).carries] == [1, 2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four devices, two shards; the daemons may import ``libmodels``."""
    c = user_code_cluster(tmp_path_factory, "libmodels")
    yield c
    c.stop()


@needs_torchvision
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_torchvision_resnet18_trains_at_k4(cluster: LocalCluster) -> None:
    """k = 4: the exported weights equal plain PyTorch training of the same resnet18 and load
    strict into a freshly built one."""
    spec = resnet_job("torchvision-resnet18")
    info = cluster.submit(spec, timeout=280)
    assert info["state"] == "done", info.get("error")
    got = torch.load(info["model_path"])
    fresh = libmodels.resnet18()
    fresh.load_state_dict(got, strict=True)
    torch.manual_seed(0)
    seq = build_model(JobSpec.from_dict(spec).model)
    initial = user_state(seq, seq.state_dict())
    assert_same_weights(got, user_state(seq, plain_training(spec, STEPS)))
    assert not torch.allclose(got["layer4.1.conv2.weight"], initial["layer4.1.conv2.weight"])


def llama_job(name: str, schedule: str = "1f1b") -> dict[str, Any]:
    """``libmodels:tiny_llama`` on four stages (7 blocks: the embedding, four decoder layers,
    the final norm, the head tied to the embedding, so the tie spans the first and last
    stage), Nm = 1, on ``libmodels:token_ids`` (mappings of input_ids and labels); the loss
    is the one the model returns."""
    spec = job(
        name,
        model="libmodels:tiny_llama",
        split=[([f"gpu{i}" for i in range(4)], [2, 2, 2, 1])],
        nm=1,
        minibatch=4,
        minibatches=STEPS,
        train={"schedule": schedule},
        # each copy of the tie steps on the summed gradient; weight decay would be added by
        # each copy (docs/own-models.md)
        weight_decay=0,
    )
    spec["data"] = {"name": "libmodels:token_ids", "args": {}}
    return spec


@needs_transformers
@pytest.mark.parametrize("build", ["tiny_gpt2", "tiny_llama"])
def test_a_hugging_face_causal_lm_is_captured_by_torch_export(build: str) -> None:
    """torch.fx cannot trace it; torch.export can: its blocks are its natural units, and on a
    batch of another shape than the export's example they give the model's own loss, logits
    and gradients. The state keys are the model's own and load strict into a fresh build."""
    make = getattr(libmodels, build)
    torch.manual_seed(0)
    model = make()
    rng = torch.get_rng_state()
    seq = capture(model)
    assert torch.equal(torch.get_rng_state(), rng)  # builds stay deterministic
    cap = capture_of(seq)
    assert cap is not None
    layers = "transformer.h" if build == "tiny_gpt2" else "model.layers"
    assert [f"{layers}.{i}" for i in range(4)] == [s for s in cap.starts if s.startswith(layers)]
    assert cap.starts[-1] == "lm_head" and cap.carries[0] == ("input_ids", "labels")
    ids = torch.randint(0, 64, (3, 11))
    batch = {"input_ids": ids, "labels": torch.randint(0, 64, (3, 11))}
    want = model(**batch)
    out: Any = batch
    for block in seq:
        out = block(out)
    assert type(out) is type(want)
    assert torch.allclose(out.logits, want.logits, atol=1e-6)
    assert torch.allclose(out.loss, want.loss, atol=1e-6)
    params = list(model.parameters())
    for got, ref in zip(
        torch.autograd.grad(out.loss, params), torch.autograd.grad(want.loss, params), strict=True
    ):
        assert torch.allclose(got, ref, atol=1e-6)
    state = user_state(seq, seq.state_dict())
    assert set(state) == set(model.state_dict())
    make().load_state_dict(state, strict=True)
    # a second build of the same configuration reuses the export, with its own tensors
    again = capture(make())
    assert len(again) == len(seq) and capture_of(again).starts == cap.starts
    assert all(a is not b for a, b in zip(again.parameters(), seq.parameters(), strict=True))


@needs_transformers
def test_a_hugging_face_model_is_captured_on_the_meta_device() -> None:
    """The runtime builds models on the meta device: the export runs there too, and the
    blocks, materialised on the CPU, run where they are placed."""
    with torch.device("meta"):
        seq = build_model(JobSpec.from_dict(llama_job("t")).model)
    assert len(seq) == 7
    seq.to_empty(device="cpu")
    out: Any = {"input_ids": torch.zeros(2, 5, dtype=torch.long)}
    out["labels"] = out["input_ids"]
    for block in seq:
        out = block(out)
    assert out.logits.shape == (2, 5, 64) and out.logits.device.type == "cpu"


@needs_transformers
def test_split_points_cut_a_hugging_face_model_where_named() -> None:
    """``model.split_points`` starts blocks at the named submodules, as for any module."""
    model = libmodels.tiny_llama()
    seq = capture(model, ["model.layers.2", "lm_head"])
    assert capture_of(seq).starts == ("", "model.layers.2", "lm_head")
    ids = torch.randint(0, 64, (2, 6))
    out: Any = {"input_ids": ids, "labels": ids}
    for block in seq:
        out = block(out)
    assert torch.allclose(out.logits, model(input_ids=ids, labels=ids).logits, atol=1e-6)


@needs_transformers
def test_a_batch_the_export_does_not_take_is_refused_in_one_line() -> None:
    """The exported inputs are ``input_ids`` and ``labels``: another key is named."""
    seq = capture(libmodels.tiny_llama())
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(CaptureError) as info:
        seq[0]({"input_ids": ids, "labels": ids, "attention_mask": ids})
    assert "'attention_mask'" in str(info.value) and "\n" not in str(info.value)


@needs_transformers
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hugging_face_llama_trains_at_k4(cluster: LocalCluster, tmp_path: Path) -> None:
    """k = 4, the tie across the first and last stage: the exported weights equal plain
    PyTorch training of the same model and load strict into a fresh
    ``AutoModelForCausalLM.from_config``, from model.pt and as ``hetpipe export`` writes
    them in safetensors (where that package is installed)."""
    spec = llama_job("hf-llama")
    info = cluster.submit(spec, timeout=280)
    assert info["state"] == "done", info.get("error")
    got = torch.load(info["model_path"])
    fresh = libmodels._transformers().AutoModelForCausalLM.from_config(
        libmodels.tiny_llama_config()
    )
    fresh.load_state_dict(got, strict=True)
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    torch.manual_seed(0)
    seq = build_model(JobSpec.from_dict(spec).model)
    initial = user_state(seq, seq.state_dict())
    assert_same_weights(got, user_state(seq, plain_training(spec, STEPS)))
    key = "model.layers.3.mlp.down_proj.weight"
    assert not torch.allclose(got[key], initial[key])
    if importlib.util.find_spec("safetensors") is not None:
        from safetensors.torch import load_file, save_file

        save_file(unshared(got), str(tmp_path / "model.safetensors"))
        fresh.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
        assert_same_weights(fresh.state_dict(), got)


def test_hugging_face_models_are_told_by_their_base_class() -> None:
    """Without transformers installed: a subclass of a class named ``PreTrainedModel`` from
    a ``transformers.`` module takes the torch.export route (this one's forward does not take
    a causal language model's batch: refused in one line); any other module is traced."""

    def model(home: str) -> nn.Module:
        base = type("PreTrainedModel", (nn.Module,), {"__module__": home})

        class Lm(base):  # type: ignore[misc, valid-type]
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(2, 2)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc(x)

        return Lm()

    with pytest.raises(CaptureError, match=r"^torch.export cannot export it: ") as info:
        capture(model("transformers.modeling_utils"))
    assert "\n" not in str(info.value)
    assert len(capture(model("mypkg.models"))) == 1
