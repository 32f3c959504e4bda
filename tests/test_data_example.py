"""examples/imagefolder and examples/cifar10: jobs training on a folder of images and on
CIFAR-10 through ``torchvision.datasets``, each checked on files the test generates (a folder
of PNG images; a CIFAR-10 directory of pickled batches, as torchvision reads it) and refused in
one line naming the root where the files are missing."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from libmodels import missing

from hetpipe.config import load_cluster
from hetpipe.data import DataError, MinibatchStream, load_data
from hetpipe.job import JobError, load_job
from hetpipe.jobcheck import JobFacts, check_job
from hetpipe.localcluster import DeviceDef, cluster_toml
from hetpipe.models import build_model, model_loss

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "imagefolder"


def checker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, example: str, root: str
) -> Callable[[str], JobFacts]:
    """``check(root)``: the job file of ``examples/<example>`` (its module ``example``), its
    data root ``root`` replaced by the given one, checked at submit."""
    monkeypatch.syspath_prepend(str(EXAMPLES / example))
    cpath = tmp_path / "cluster.toml"
    devices = (DeviceDef("gpu0"), DeviceDef("gpu1"))
    cpath.write_text(cluster_toml(devices, allowed_modules=(example,)))
    cluster = load_cluster(cpath)

    def run(where: str) -> JobFacts:
        text = (EXAMPLES / example / "job.toml").read_text()
        assert f"root = {root}" in text
        path = tmp_path / "job.toml"
        path.write_text(text.replace(f"root = {root}", f'root = "{where}"'))
        return check_job(load_job(path), cluster, str(path))

    return run


@pytest.fixture
def check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], JobFacts]:
    """``check(root)``: the image-folder example's job file, on images under ``root``."""
    return checker(tmp_path, monkeypatch, "imagefolder", '"data/images"')


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


# -- examples/cifar10 -------------------------------------------------------------------------


@pytest.fixture
def check_cifar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], JobFacts]:
    """``check(root)``: the CIFAR-10 example's job file, on the data set under ``root``."""
    return checker(tmp_path, monkeypatch, "cifar10", '"data"')


def make_cifar10(root: Path, per_batch: int = 26, test: int = 8) -> None:
    """A tiny CIFAR-10 in the format torchvision reads: ``root/cifar-10-batches-py/`` with
    five pickled training batches and a test batch (``data``: uint8 rows of 3 x 32 x 32
    values, channel-major; ``labels``) and ``batches.meta`` (``label_names``)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)

    def batch(name: str, n: int, first: int) -> None:
        labels = [(first + i) % 10 for i in range(n)]
        data = torch.randint(0, 256, (n, 3 * 32 * 32), generator=gen, dtype=torch.uint8)
        for i, y in enumerate(labels):  # a class is a brightness level: learnable
            data[i] = (data[i].int() // 4 + 20 * y).to(torch.uint8)
        entry = {"batch_label": name, "labels": labels, "data": data.numpy()}
        (folder / name).write_bytes(pickle.dumps(entry))

    for k in range(1, 6):
        batch(f"data_batch_{k}", per_batch, k * per_batch)
    batch("test_batch", test, 0)
    names = ["airplane", "automobile", "bird", "cat", "deer"]
    names += ["dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": names}))


def test_cifar10_missing_is_refused_naming_the_root(
    check_cifar: Callable[[str], JobFacts], tmp_path: Path
) -> None:
    root = tmp_path / "nowhere"
    with pytest.raises(JobError) as info:
        check_cifar(str(root))
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(
        f"{tmp_path / 'job.toml'}: data.name: data 'cifar10:load': raised "
        f"FileNotFoundError: CIFAR-10 not found under root '{root}': no "
        "cifar-10-batches-py/data_batch_1 (nothing is downloaded"
    ), text


def test_the_cifar10_example_trains_on_a_generated_data_set(
    check_cifar: Callable[[str], JobFacts], tmp_path: Path
) -> None:
    """The job file checks at submit on the generated files (130 training images: two of
    the job's minibatches of 64; 8 test images as its validation set) and its model trains
    on minibatches read through the loader with two worker processes; ``verify`` checks
    torchvision's MD5 sums, which generated files do not match."""
    reason = missing("torchvision")  # examples/cifar10 reads with torchvision
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path / "cifar"
    make_cifar10(root)
    facts = check_cifar(str(root))
    assert facts.n_train == 130 and len(facts.data.val) == 8
    source = load_data("cifar10:load", {"root": str(root)})
    x, y = source.val[3]
    assert x.shape == (3, 32, 32) and y == 3
    stream = MinibatchStream(source, 4, seed=0, workers=2)
    spec = load_job(EXAMPLES / "cifar10" / "job.toml")
    model = build_model(spec.model)
    loss_fn = model_loss(spec.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with stream.reader(0) as reader:
        for p in range(10):
            x, y = reader.get(p)
            assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32
            assert y.dtype == torch.int64
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
    assert torch.isfinite(loss)
    with pytest.raises(DataError, match="Dataset not found or corrupted"):
        load_data("cifar10:load", {"root": str(root), "verify": True})
