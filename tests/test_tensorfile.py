"""Tensor files (checkpoints): what is written reads back bit for bit, and bytes that are
not such a file give one line naming the file, whatever their damage."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from hetpipe import checkpoint, tensorfile


def _blob(tensors: dict[str, torch.Tensor]) -> bytearray:
    return bytearray(b"".join(bytes(p) for p in tensorfile.dumps(tensors)))


def test_every_dtype_and_shape_reads_back_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(64, 300, generator=g),  # large: read without a copy
        "half": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(3, 5, generator=g).bfloat16(),
        "f64": torch.randn(2, generator=g).double(),
        "step": torch.tensor(12.0),  # 0-dim, as optimizers keep their step
        "count": torch.tensor(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "none": torch.empty(0, 4),
        "t": torch.randn(6, 4, generator=g).t(),  # not contiguous
    }
    back = tensorfile.loads(_blob(tensors), "f")
    assert list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name
    back["w"].add_(1)  # read tensors are writable (a resumed stage may update in place)


@pytest.mark.parametrize("damage", ["magic", "truncated", "extra", "count", "header", "sizes"])
def test_bytes_that_are_not_a_tensor_file_give_one_line(damage: str) -> None:
    data = _blob({"w": torch.ones(4, 4), "b": torch.zeros(4)})
    head = len(tensorfile.MAGIC) + 4
    if damage == "magic":
        data[0:1] = b"P"  # e.g. a torch.save zip file
    elif damage == "truncated":
        del data[-3:]
    elif damage == "extra":
        data += b"\0"
    elif damage == "count":
        data[len(tensorfile.MAGIC) : head] = (10**6).to_bytes(4, "little")
    elif damage == "header":
        data[head + 3 * 8] ^= 0xFF  # the wire header's first byte
    else:  # a frame length moved from one frame to the next: the shapes no longer fit
        data[head + 8] += 4
        data[head + 16] -= 4
    with pytest.raises(ValueError, match=r"^somewhere/f: ") as info:
        tensorfile.loads(data, "somewhere/f")
    assert "\n" not in str(info.value)


def test_a_file_with_a_matching_manifest_but_bad_contents_is_not_a_checkpoint(
    tmp_path: Path,
) -> None:
    """Damage the checksums did not catch (a manifest rewritten to match) still gives a
    clear error and the previous checkpoint, not a crash."""
    checkpoint.write(tmp_path, 1, {"w": torch.ones(3)}, {"n": 1})
    newest = checkpoint.write(tmp_path, 2, {"w": torch.ones(3)}, {"n": 2})
    bad = b"HPTENS1\n" + b"\xff" * 20
    (newest / checkpoint.WEIGHTS).write_bytes(bad)
    manifest = json.loads((newest / checkpoint.MANIFEST).read_text())
    manifest["files"][checkpoint.WEIGHTS] = {
        "bytes": len(bad),
        "sha256": hashlib.sha256(bad).hexdigest(),
    }
    (newest / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    skipped: list[str] = []
    ck = checkpoint.latest(tmp_path, skipped)
    assert ck is not None and ck.meta == {"n": 1}
    assert len(skipped) == 1 and str(newest / checkpoint.WEIGHTS) in skipped[0]


def test_a_checkpoint_of_torch_save_files_says_which_version_wrote_it(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints" / "000001"
    path.mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, path / "weights.pt")
    (path / "meta.json").write_text("{}")
    (path / checkpoint.MANIFEST).write_text(
        json.dumps({"seq": 1, "files": {"weights.pt": {}, "meta.json": {}}})
    )
    with pytest.raises(ValueError, match="older hetpipe"):
        checkpoint.verify(path)
