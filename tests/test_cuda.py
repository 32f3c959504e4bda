"""The CUDA path: the same runtime on ``cuda:0`` devices (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import job, start_cluster
from helpers import plain_training

from hetpipe.localcluster import DeviceDef

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]

FOUR = ["gpu0", "gpu1", "gpu2", "gpu3"]


def trains_as_plain(tmp_path: Path, spec: dict[str, Any], n: int, **cluster: Any) -> None:
    """``spec`` on four devices of cuda:0 ends with the weights of plain (CPU) training
    after ``n`` minibatches, within 1e-4 (GPU kernels reduce in another order than the
    CPU's: a looser bound than on CPU)."""
    devices = tuple(DeviceDef(name, "cuda", "8GiB", 1.0, "cuda:0") for name in FOUR)
    c = start_cluster(tmp_path, devices, **cluster)
    try:
        info = c.submit(spec)
        assert info["state"] == "done", info.get("error")
        got = torch.load(info["model_path"], map_location="cpu")
        for name, w in plain_training(spec, n).items():
            assert (got[name] - w).abs().max().item() <= 1e-4, name
    finally:
        c.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cuda_ipc", [True, False], ids=["device-to-device", "via-host"])
def test_transparency_on_cuda(tmp_path, cuda_ipc: bool) -> None:
    """Four stages on cuda:0 give the weights of plain (CPU) training, within 1e-4: with
    activations and gradients shared between the stages' processes by CUDA IPC handle, and
    through host memory (``[runtime] cuda_ipc = false``). Its first stage (Flatten) has no
    parameters: nothing but the stage itself initialises CUDA there."""
    spec = job("cuda", model="mlp", split=[(FOUR, [1, 2, 2, 1])], nm=1, minibatches=50)
    trains_as_plain(tmp_path, spec, 50, cuda_ipc=cuda_ipc)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("activations", ["swap", "recompute"])
def test_activation_policies_are_transparent_on_cuda(tmp_path, activations: str) -> None:
    """Four stages on cuda:0 whose activations are swapped to pinned host memory on a side
    stream (or recomputed in the backward) give the weights of plain (CPU) training: the
    copies overlap the compute and autograd still differentiates the very same values."""
    spec = job(
        f"cuda-{activations}",
        model="mlp",
        split=[(FOUR, [1, 2, 2, 1])],
        nm=1,
        minibatches=50,
        train={"activations": activations},
    )
    trains_as_plain(tmp_path, spec, 50)


@pytest.mark.timeout(300)
def test_replicated_stage_is_transparent_on_cuda(tmp_path) -> None:
    """A middle stage replicated on two devices of cuda:0: its rows are scattered to the
    replicas and their weight gradients summed, and the virtual worker trains the weights
    plain (CPU) training does on the unsplit minibatches."""
    split = [(["gpu0", ["gpu1", "gpu2"], "gpu3"], [2, 2, 2])]
    spec = job("cuda-replicas", model="mlp", split=split, nm=1, minibatches=40)
    trains_as_plain(tmp_path, spec, 40)
