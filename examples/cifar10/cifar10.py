"""Train on CIFAR-10 read by ``torchvision.datasets.CIFAR10`` (torchvision is an optional
extra: ``pip install 'hetpipe[vision]'``). Training images are cropped at random from the
image padded by 4 and flipped at random, then normalised: per-sample CPU work that
``data.workers`` loader processes do beside the first stage.

Nothing is downloaded at run time: ``root`` must hold ``cifar-10-batches-py/`` (the python
version of the data set, as ``torchvision.datasets.CIFAR10(root, download=True)`` leaves it,
fetched once beforehand). Where it is missing the job is refused at submit, in one line naming
the root. The files are checked to exist; ``verify = true`` checks their MD5 sums as well
(every process that loads the set hashes them again).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

__all__ = ["load"]

FOLDER = "cifar-10-batches-py"
FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5")
MEAN = (0.4914, 0.4822, 0.4465)  # per channel, of the training images
STD = (0.2470, 0.2435, 0.2616)


def load(root: str, augment: bool = True, verify: bool = False) -> dict[str, Any]:
    """``{"train": ..., "val": ...}``: the 50,000 training images and the 10,000 test images
    (the validation set) of CIFAR-10 under ``root``."""
    base = Path(root).expanduser()
    missing = [
        n for n in (*FILES, "test_batch", "batches.meta") if not (base / FOLDER / n).is_file()
    ]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10 not found under root {str(base)!r}: no {FOLDER}/{missing[0]} (nothing "
            f"is downloaded; fetch it once: torchvision.datasets.CIFAR10(root, download=True))"
        )
    try:
        from torchvision import datasets, transforms
    except ImportError:
        raise ImportError(
            "this example reads CIFAR-10 with torchvision: pip install 'hetpipe[vision]'"
        ) from None

    reader = datasets.CIFAR10 if verify else __getattr__("CIFAR10Files")
    normalise = [transforms.ToTensor(), transforms.Normalize(MEAN, STD)]
    shape = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    train = reader(
        str(base),
        train=True,
        transform=transforms.Compose([*(shape if augment else []), *normalise]),
    )
    val = reader(str(base), train=False, transform=transforms.Compose(normalise))
    return {"train": train, "val": val}


def __getattr__(name: str) -> Any:
    """``CIFAR10Files``: torchvision's reader checking that its files exist, not their MD5
    sums. Made on first use (torchvision is imported only then) and found by this name, so a
    loader worker process that is spawned, not forked, can unpickle the data set."""
    if name != "CIFAR10Files":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from torchvision import datasets

    class CIFAR10Files(datasets.CIFAR10):
        train_list: ClassVar = [[file, None] for file, _ in datasets.CIFAR10.train_list]
        test_list: ClassVar = [[file, None] for file, _ in datasets.CIFAR10.test_list]
        meta: ClassVar = {**datasets.CIFAR10.meta, "md5": None}

    globals()[name] = CIFAR10Files
    return CIFAR10Files
