"""Models from well-known libraries, unmodified, trained through a job whose only user code is
a factory function (``tests/libmodels.py``).

torchvision's ``resnet18`` is captured as any ``nn.Module`` (14 blocks), trained at k = 4 on
real daemons, equal to plain PyTorch training of the same module, and its ``model.pt`` loads
strict into a freshly built ``resnet18``. A Hugging Face causal language model is refused at
submit in one line (see ``docs/own-models.md``). The libraries are the ``libs`` extra; each
test skips, saying why, where its library is absent or does not import.
"""

from __future__ import annotations

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
from hetpipe.job import JobSpec
from hetpipe.localcluster import LocalCluster
from hetpipe.models import ModelError, build_model

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


@needs_transformers
def test_a_hugging_face_causal_lm_is_refused_in_one_line() -> None:
    """transformers' models take ``**kwargs`` and build their attention masks with control
    flow on shapes, which ``torch.fx`` cannot trace: refused at submit in one line naming the
    model and why, before any trace."""
    spec = JobSpec.from_dict(job("t", model="libmodels:tiny_gpt2"))
    with pytest.raises(ModelError) as info:
        build_model(spec.model)
    text = str(info.value)
    assert "\n" not in text and info.value.key == "model.name", text
    assert "cannot capture GPT2LMHeadModel: Hugging Face transformers models" in text, text


def test_hugging_face_models_are_told_by_their_base_class() -> None:
    """Without transformers installed: a subclass of a class named ``PreTrainedModel`` from
    a ``transformers.`` module is refused up front; any other module is traced."""

    def model(home: str) -> nn.Module:
        base = type("PreTrainedModel", (nn.Module,), {"__module__": home})

        class Lm(base):  # type: ignore[misc, valid-type]
            def __init__(self) -> None:
                super().__init__()
                self.fc = nn.Linear(2, 2)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc(x)

        return Lm()

    with pytest.raises(CaptureError, match=r"^Hugging Face transformers models are not captured"):
        capture(model("transformers.modeling_utils"))
    assert len(capture(model("mypkg.models"))) == 1
