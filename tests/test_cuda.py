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
