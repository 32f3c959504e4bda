"""Shared fixtures: real daemons on loopback with ephemeral ports, always reaped."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml

# Four emulated devices of three types, like the repository's cluster.toml.
HETERO = (
    DeviceDef("gpu0", "fast", "64MiB", 1.0),
    DeviceDef("gpu1", "medium", "32MiB", 0.5),
    DeviceDef("gpu2", "medium", "32MiB", 0.5),
    DeviceDef("gpu3", "whimpy", "3MiB", 0.25),
)
UNIFORM = tuple(DeviceDef(f"gpu{i}", "fast", "256MiB", 1.0) for i in range(4))


def start_cluster(
    root: Path,
    devices: tuple[DeviceDef, ...],
    shards: int = 2,
    allowed_modules: tuple[str, ...] = (),
    cuda_ipc: bool = True,
    host_shm: bool = True,
    inline_ms: int | None = None,
) -> LocalCluster:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "cluster.toml"
    path.write_text(
        cluster_toml(
            devices,
            shards=shards,
            allowed_modules=allowed_modules,
            cuda_ipc=cuda_ipc,
            host_shm=host_shm,
            inline_ms=inline_ms,
        )
    )
    return LocalCluster(path, root / "run", timeout=60).__enter__()


def user_code_cluster(
    tmp_path_factory: pytest.TempPathFactory,
    *modules: str,
    devices: tuple[DeviceDef, ...] = UNIFORM,
    shards: int = 2,
) -> LocalCluster:
    """``devices`` (four uniform ones) and ``shards`` whose daemons may import the tests' own
    ``modules`` (``usermodels``, ``userdata``, ...): this directory on their ``PYTHONPATH``
    and the modules in ``[security] allowed_modules``."""
    with pytest.MonkeyPatch.context() as mp:
        here = str(Path(__file__).resolve().parent)
        mp.setenv(
            "PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        )
        root = tmp_path_factory.mktemp(modules[0])
        return start_cluster(root, devices, shards=shards, allowed_modules=modules)


@pytest.fixture(scope="module")
def uniform_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four unslowed devices, two shards: shared by the tests of one module."""
    c = start_cluster(tmp_path_factory.mktemp("uniform"), UNIFORM)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def hetero_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """The default cluster's shape: fast, 2x medium, whimpy (3 MiB)."""
    c = start_cluster(tmp_path_factory.mktemp("hetero"), HETERO)
    yield c
    c.stop()


async def running_until(
    head: Any,
    job_id: str,
    reached: Callable[[dict[str, Any]], bool],
    timeout: float,
    every: float = 0.1,
) -> dict[str, Any]:
    """Poll a job (through a head client) until ``reached(info)``; fail at once if it leaves
    queued/planning/running (it will not get there then), or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        info = await head.job(job_id)
        if reached(info):
            return info
        assert info["state"] in ("queued", "planning", "running"), info
        assert time.monotonic() < deadline, f"{job_id}: not there after {timeout} s: {info}"
        await asyncio.sleep(every)


async def until_whole(c: LocalCluster, timeout: float = 60) -> None:
    """Wait until every worker of ``c``'s file is registered and idle and every shard is,
    none lost: a test that killed and restarted a daemon of a shared cluster leaves it so."""
    want = {d.name for d in c.cluster.devices}
    async with c.client() as head:
        deadline = time.monotonic() + timeout
        while True:
            status = await head.cluster()
            idle = {w["device"] for w in status["workers"] if w["state"] == "idle"}
            if (
                idle == want
                and len(status["shards"]) == len(c.cluster.ps)
                and not status["shards_lost"]
            ):
                return
            assert time.monotonic() < deadline, f"not whole after {timeout} s: {status}"
            await asyncio.sleep(0.2)


def job(
    name: str = "t",
    *,
    model: str = "mlp",
    model_args: dict[str, Any] | None = None,
    split: list[tuple[list[str], list[int]]] | None = None,
    nm: int = 1,
    minibatches: int | None = 50,
    epochs: int | None = None,
    minibatch: int = 32,
    lr: float = 0.05,
    momentum: float = 0.9,
    weight_decay: float = 1e-4,
    optimizer: str = "sgd",
    staleness: int = 0,
    seed: int = 0,
    data: str = "digits",
    train: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A job dict in the job file's shape (``train``: more keys of its train table)."""
    extra = train or {}
    train = {"minibatch": minibatch, "nm": nm, "seed": seed, **extra}
    if extra.get("schedule", "async") in ("async", "auto"):  # WSP's D: async only
        train["staleness"] = staleness
    if epochs is not None:
        train["epochs"] = epochs
    else:
        train["minibatches"] = minibatches
    opt: dict[str, Any] = {"name": optimizer, "lr": lr, "weight_decay": weight_decay}
    if optimizer == "sgd":
        opt["momentum"] = momentum
    out: dict[str, Any] = {
        "name": name,
        "model": {"name": model, "args": model_args or {}},
        "data": {"name": data},
        "optimizer": opt,
        "train": train,
    }
    if split:
        out["vw"] = [{"devices": d, "layers": layers} for d, layers in split]
    return out


def sync_job(name: str, kind: str, split: list, m: int = 4, iterations: int = 30, **kw) -> dict:
    """A synchronous job of the builtin mlp: ``iterations`` iterations of ``m`` microbatches
    under schedule ``kind`` on ``split``."""
    return job(
        name,
        model="mlp",
        split=split,
        nm=m,
        minibatches=m * iterations,
        train={"schedule": kind},
        **kw,
    )


def assert_same_weights(got: dict[str, Any], want: dict[str, Any], tol: float = 1e-5) -> None:
    """The same state_dict names; floating values within ``tol`` (max abs difference, taken
    in float64), other values exactly equal."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name, w in want.items():
        if w.is_floating_point():
            diff = (got[name].double() - w.double()).abs().max().item()
            assert diff <= tol, f"{name}: max abs diff {diff:.3g}"
        else:
            assert torch.equal(got[name], w), name


def edited(base: str, old: str, new: str) -> str:
    """``base`` with one exact edit (``old == ""`` appends ``new``)."""
    if not old:
        return base + new
    assert old in base, old
    return base.replace(old, new, 1)


def one_line_error(load: Any, error: type[Exception], path: Path, key: str, problem: str) -> str:
    """``load(path)`` must fail with ONE line naming the file, the key and the problem."""
    with pytest.raises(error) as info:
        load(path)
    text = str(info.value)
    assert "\n" not in text, text
    assert text.startswith(f"{path}: {key}: "), text
    assert problem in text, text
    return text
