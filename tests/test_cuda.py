"""The CUDA path: the same runtime on ``cuda:0`` devices (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import job, start_cluster
from helpers import plain_training

from hetpipe.localcluster import DeviceDef

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cuda_ipc", [True, False], ids=["device-to-device", "via-host"])
def test_transparency_on_cuda(tmp_path, cuda_ipc: bool) -> None:
    """Four stages on cuda:0 give the weights of plain (CPU) training, within 1e-4: with
    activations and gradients shared between the stages' processes by CUDA IPC handle, and
    through host memory (``[runtime] cuda_ipc = false``). Its first stage (Flatten) has no
    parameters: nothing but the stage itself initialises CUDA there."""
    devices = tuple(DeviceDef(f"gpu{i}", "cuda", "8GiB", 1.0, "cuda:0") for i in range(4))
    cluster = start_cluster(tmp_path, devices, cuda_ipc=cuda_ipc)
    try:
        spec = job(
            "cuda",
            model="mlp",
            split=[(["gpu0", "gpu1", "gpu2", "gpu3"], [1, 2, 2, 1])],
            nm=1,
            minibatches=50,
        )
        info = cluster.submit(spec)
        assert info["state"] == "done", info.get("error")
        got = torch.load(info["model_path"], map_location="cpu")
        want = plain_training(spec, 50)
        for name, w in want.items():
            # GPU kernels reduce in another order than the CPU's: a looser bound
            assert (got[name] - w).abs().max().item() <= 1e-4, name
    finally:
        cluster.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("activations", ["swap", "recompute"])
def test_activation_policies_are_transparent_on_cuda(tmp_path, activations: str) -> None:
    """Four stages on cuda:0 whose activations are swapped to pinned host memory on a side
    stream (or recomputed in the backward) give the weights of plain (CPU) training: the
    copies overlap the compute and autograd still differentiates the very same values."""
    devices = tuple(DeviceDef(f"gpu{i}", "cuda", "8GiB", 1.0, "cuda:0") for i in range(4))
    cluster = start_cluster(tmp_path, devices)
    try:
        spec = job(
            f"cuda-{activations}",
            model="mlp",
            split=[(["gpu0", "gpu1", "gpu2", "gpu3"], [1, 2, 2, 1])],
            nm=1,
            minibatches=50,
            train={"activations": activations},
        )
        info = cluster.submit(spec)
        assert info["state"] == "done", info.get("error")
        got = torch.load(info["model_path"], map_location="cpu")
        want = plain_training(spec, 50)
        for name, w in want.items():
            assert (got[name] - w).abs().max().item() <= 1e-4, name
    finally:
        cluster.stop()


@pytest.mark.timeout(300)
def test_replicated_stage_is_transparent_on_cuda(tmp_path) -> None:
    """A middle stage replicated on two devices of cuda:0: its rows are scattered to the
    replicas and their weight gradients summed, and the virtual worker trains the weights
    plain (CPU) training does on the unsplit minibatches."""
    devices = tuple(DeviceDef(f"gpu{i}", "cuda", "8GiB", 1.0, "cuda:0") for i in range(4))
    cluster = start_cluster(tmp_path, devices)
    try:
        spec = job(
            "cuda-replicas",
            model="mlp",
            split=[(["gpu0", ["gpu1", "gpu2"], "gpu3"], [2, 2, 2])],
            nm=1,
            minibatches=40,
        )
        info = cluster.submit(spec)
        assert info["state"] == "done", info.get("error")
        got = torch.load(info["model_path"], map_location="cpu")
        want = plain_training(spec, 40)
        for name, w in want.items():
            assert (got[name] - w).abs().max().item() <= 1e-4, name
    finally:
        cluster.stop()
