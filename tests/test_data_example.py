"""examples/imagefolder: a job training on a folder of images, checked on a folder the test
generates; refused in one line naming the root where the folder is missing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from libmodels import missing

from hetpipe.config import load_cluster
from hetpipe.data import MinibatchStream, load_data
from hetpipe.job import JobError, load_job
from hetpipe.jobcheck import JobFacts, check_job
from hetpipe.localcluster import DeviceDef, cluster_toml
from hetpipe.models import build_model, model_loss

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "imagefolder"


@pytest.fixture
def check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], JobFacts]:
    """``check(root)``: the example's job file, on images under ``root``, checked."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    cpath = tmp_path / "cluster.toml"
    devices = (DeviceDef("gpu0"), DeviceDef("gpu1"))
    cpath.write_text(cluster_toml(devices, allowed_modules=("imagefolder",)))
    cluster = load_cluster(cpath)

    def run(root: str) -> JobFacts:
        text = (EXAMPLE / "job.toml").read_text().replace('"data/images"', repr(root))
        path = tmp_path / "job.toml"
        path.write_text(text.replace("'", '"'))
        return check_job(load_job(path), cluster, str(path))

    return run


def test_a_missing_folder_is_refused_naming_the_root(
    check: Callable[[str], JobFacts], tmp_path: Path
) -> None:
    root = tmp_path / "nowhere"
    with pytest.raises(JobError) as info:
        check(str(root))
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(
        f"{tmp_path / 'job.toml'}: data.name: data 'imagefolder:load': raised "
        f"FileNotFoundError: image folder {root / 'train'} does not exist (root '{root}'"
    ), text


def make_images(root: Path, classes: int = 3, per_class: int = 12) -> None:
    """PNG images of ``classes`` brightness levels in ``root/{train,val}/<class>/``."""
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    for split, n in (("train", per_class), ("val", 4)):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(n):
                level = 60 * c + torch.randint(0, 40, (12, 12), generator=gen)
                Image.fromarray(level.to(torch.uint8).numpy(), mode="L").convert("RGB").save(
                    folder / f"{i}.png"
                )


def test_the_example_trains_on_a_generated_folder(
    check: Callable[[str], JobFacts], tmp_path: Path
) -> None:
    reason = missing("torchvision")  # examples/imagefolder reads with torchvision
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path / "images"
    make_images(root)
    facts = check(str(root))
    assert facts.n_train == 36 and len(facts.data.val) == 12
    source = load_data("imagefolder:load", {"root": str(root)})
    stream = MinibatchStream(source, 6, seed=0, workers=2)
    model = build_model("cnn")
    loss_fn = model_loss("cnn")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with stream.reader(0) as reader:
        for p in range(12):
            x, y = reader.get(p)
            assert x.shape == (6, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
    assert torch.isfinite(loss)
