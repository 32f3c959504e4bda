"""Train on a folder of images: ``root/train/<class>/*.png`` and ``root/val/<class>/*.png``,
read by ``torchvision.datasets.ImageFolder`` (torchvision is an optional extra:
``pip install torchvision``). Each image is decoded, turned grey, resized to ``size`` x
``size`` and, for training, flipped at random: per-sample CPU work that ``data.workers``
loader processes do beside the first stage.

Nothing is downloaded: where the folder is missing the job is refused at submit, in one line
naming the root.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["load"]


def load(root: str, size: int = 8) -> dict[str, Any]:
    """``{"train": ..., "val": ...}`` of the folder ``root`` (``val`` only where it exists)."""
    base = Path(root).expanduser()
    train_dir, val_dir = base / "train", base / "val"
    if not train_dir.is_dir():
        raise FileNotFoundError(
            f"image folder {train_dir} does not exist (root {str(base)!r}: expected "
            f"train/<class>/<image> under it; nothing is downloaded)"
        )
    try:
        from torchvision import datasets, transforms
    except ImportError:
        raise ImportError(
            "this example reads images with torchvision: pip install torchvision"
        ) from None
    common = [transforms.Grayscale(), transforms.Resize((size, size))]
    train = datasets.ImageFolder(
        str(train_dir),
        transforms.Compose([*common, transforms.RandomHorizontalFlip(), transforms.ToTensor()]),
    )
    out: dict[str, Any] = {"train": train}
    if val_dir.is_dir():
        out["val"] = datasets.ImageFolder(
            str(val_dir), transforms.Compose([*common, transforms.ToTensor()])
        )
    return out
