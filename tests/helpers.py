"""Helpers shared by several test modules: the plain-PyTorch reference a pipeline is compared
with, a finished job's stages.json, WSP's invariant, the planner's repository-shaped inputs and
a stand-in stage compute.

A plain module rather than ``conftest.py``: pytest loads ``conftest.py`` before every test, and
one that fails to import stops the whole run. These helpers import the planner and the
runtime's stage types, so a break there fails only the modules that use them. Fixtures, the
daemons' clusters and the job dict stay in ``conftest.py``. Test modules import ``helpers``
and ``conftest``, never each other (``test_test_layout.py`` checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from hetpipe import log as logmod
from hetpipe.config import (
    ClusterConfig,
    DeviceSpec,
    LinkSpec,
    NetworkSpec,
    NodeSpec,
    RuntimeSpec,
    ShardSpec,
    load_cluster,
)
from hetpipe.core.layout import StageLayout
from hetpipe.data import MinibatchStream, load_data
from hetpipe.head import JobState
from hetpipe.head.recovery import RecoveryPart
from hetpipe.hostcopy import HostCopier, HostCopy
from hetpipe.job import JobSpec
from hetpipe.models import build_model, model_loss
from hetpipe.planner import CostModel, LayerProfile, ModelProfile, Plan, synthetic_profile
from hetpipe.planner.runtime import RuntimeCosts
from hetpipe.seeding import layer_seed
from hetpipe.task import StageTask
from hetpipe.wire import Kind, Message

MiB = 1 << 20
GiB = 1 << 30

# -- the plain-PyTorch reference --------------------------------------------------------------


def optimizer_of(spec: JobSpec, params: Any) -> torch.optim.Optimizer:
    """The torch optimizer of the job's optimizer table, with its settings."""
    o = spec.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(
            params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, nesterov=o.nesterov
        )
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)


def plain_training(
    spec_dict: dict[str, Any],
    steps: int,
    *,
    m: int | list[int] = 1,
    vws: int = 1,
    vw_seeds: int | None = None,
    scheduler: Any = None,
    clip_norm: float | None = None,
    clip_stages: list[int] | None = None,
    scaler: Any = None,
    skipped: list[int] | None = None,
) -> dict[str, torch.Tensor]:
    """The job's model trained by plain PyTorch from the same initial weights, data order and
    optimizer: the state_dict a transparent pipeline must reproduce. The data order is each
    VW's stream (:class:`hetpipe.data.MinibatchStream`, the order its ``DataLoader`` reads).

    ``steps`` optimizer steps, each on the next ``m`` minibatches of every one of ``vws``
    virtual workers' streams (their samples concatenated, mean loss): one minibatch per step
    for an asynchronous job of one virtual worker, an iteration of every virtual worker for a
    synchronous one (minibatch SGD on the iteration's union); ``m`` may be one M per virtual
    worker. With ``vw_seeds`` set (one minibatch per step), every layer runs after
    ``torch.manual_seed(layer_seed(seed, vw_seeds, layer, p))``: how a reference draws the
    dropout masks of virtual worker ``vw_seeds``.

    The training loop people write, optionally: ``scheduler(opt)`` makes a
    ``torch.optim.lr_scheduler`` stepped after every step; ``clip_norm`` clips with
    ``clip_grad_norm_`` (the whole model's norm, or with ``clip_stages``, layers per stage,
    each stage's parameters by their own norm: an async job's rule); ``scaler`` (a
    ``torch.amp.GradScaler`` on "cpu") runs forwards under fp16 autocast with its loss
    scaling, and the steps it skips are appended to ``skipped``.

    One intra-op thread, as the workers use: a different thread count changes the order of
    float reductions, and max-pooling after ReLU amplifies such rounding differences.
    """
    ms = m if isinstance(m, list) else [m] * vws
    assert vw_seeds is None or ms == [1], "vw_seeds: one minibatch per step"
    spec = JobSpec.from_dict(spec_dict)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(spec.seed)
        model = build_model(spec.model)
        data = load_data(spec.data.name, spec.data.args, spec.data.collate)
        shares = ms if len(set(ms)) > 1 else None  # as a synchronous job deals the epoch
        streams = [
            MinibatchStream(data, spec.minibatch, spec.seed, v, vws, shares=shares)
            for v in range(vws)
        ]
        opt = optimizer_of(spec, model.parameters())
        sched = scheduler(opt) if scheduler is not None else None
        bounds = [0, *itertools.accumulate(clip_stages or [len(model)])]
        groups = [  # a tied tensor once (as model.parameters() gives it)
            list({id(p): p for layer in list(model)[a:b] for p in layer.parameters()}.values())
            for a, b in itertools.pairwise(bounds)
        ]

        def clip() -> None:
            for group in groups:
                if clip_norm is not None and group:
                    torch.nn.utils.clip_grad_norm_(group, clip_norm)

        loss_fn = model_loss(spec.model)
        model.train()
        for i in range(steps):
            batches = [
                s.batch(p)
                for s, mv in zip(streams, ms, strict=True)
                for p in range(i * mv, (i + 1) * mv)
            ]
            x = _cat([b[0] for b in batches])
            y = _cat([b[1] for b in batches])
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
                if vw_seeds is None:
                    out = model(x)
                else:
                    out = x
                    for j, layer in enumerate(model):
                        torch.manual_seed(layer_seed(spec.seed, vw_seeds, j, i))
                        out = layer(out)
                loss = loss_fn(out, y)
            if scaler is None:
                loss.backward()
                clip()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                clip()
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                if scaler.get_scale() < before and skipped is not None:
                    skipped.append(i)
            if sched is not None:
                sched.step()
    finally:
        torch.set_num_threads(threads)
    return model.state_dict()


# -- a finished job's stages.json -------------------------------------------------------------


def stages_json(info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The job's stages.json (``info["stages_path"]``): each stage's report (``stats``,
    ``records``, ``replicas``...) by ``vw<V>/stage<S>``."""
    return json.loads(Path(info["stages_path"]).read_text())


def check_device_level(info: dict[str, Any], kind: str, m: int, iterations: int) -> None:
    """A finished job of four stages on two devices under device-level ``kind`` (``m``
    microbatches an iteration): each stage held at its peak what its projected order
    charges, and each device started its stages' forwards in the kind's device order."""
    from hetpipe.core.devschedule import device_order, placement
    from hetpipe.core.schedule import max_in_flight

    for where, st in stages_json(info).items():
        charged = max_in_flight(kind, 4, int(where.split("stage")[1]), m, devices=2)
        assert st["stats"]["peak_in_flight"] == charged, (where, st["stats"]["peak_in_flight"])
    records = stage_records(info)
    where = placement(kind, 4, 2)
    for d in range(2):
        mine = [s for s in range(4) if where[s] == d]
        starts = sorted((r["t_fwd"], s, r["p"]) for s in mine for r in records[f"vw0/stage{s}"])
        want = [
            (s, c * m + j)
            for c in range(iterations)
            for s, op, j in device_order(kind, 4, 2, d, m)
            if op == "F"
        ]
        assert [(s, p) for _t, s, p in starts] == want, d


def stage_records(info: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each stage's per-minibatch records by ``vw<V>/stage<S>``, one dict a minibatch: the
    rows of stages.json named by the stage's ``stats.record_fields``."""
    out = {}
    for where, r in stages_json(info).items():
        fields = r["stats"]["record_fields"]
        out[where] = [dict(zip(fields, row, strict=True)) for row in r["records"]]
    return out


def checked_stash(info: dict[str, Any]) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """A ``train.verify`` job's records, checked: every stage saw every minibatch, and each
    backward differentiated the weights its forward used (their fingerprints); with the
    number of backwards that ran past a newer version (the stash was needed)."""
    records = stage_records(info)
    stashed = 0
    for where, rows in records.items():
        assert [r["p"] for r in rows] == list(range(info["minibatches"])), where
        for r in rows:
            assert r["fwd_fingerprint"] != 0.0, (where, r["p"])  # train.verify took them
            assert r["bwd_fingerprint"] == r["fwd_fingerprint"], (where, r["p"])
            assert r["bwd_version"] >= r["fwd_version"]
            stashed += r["bwd_version"] > r["fwd_version"]
    return records, stashed


def records_by_index(info: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """:func:`stage_records` keyed by ``(vw, stage)``."""
    out = {}
    for where, rows in stage_records(info).items():
        vw, stage = (
            int(x[len(p) :]) for x, p in zip(where.split("/"), ("vw", "stage"), strict=True)
        )
        out[(vw, stage)] = rows
    return out


# -- WSP's invariant --------------------------------------------------------------------------


def check_invariants(
    records: dict[tuple[int, int], list[dict]], nm: dict[int, int], staleness: int
) -> int:
    """DESIGN.md's WSP invariant over every minibatch; return how many forwards were gated."""
    vws = sorted({vw for vw, _ in records})
    # when each VW finished each wave: its last backward at stage 0 (the last to finish)
    finished = {vw: {} for vw in vws}
    for vw in vws:
        for r in records[(vw, 0)]:
            c = r["wave"]
            finished[vw][c] = max(finished[vw].get(c, 0.0), r["t_bwd"])
    gated = 0
    for (vw, stage), rows in records.items():
        for r in rows:
            c, p = r["wave"], r["p"]
            # the weights of wave c include every VW's updates of all waves < c - 1 - D
            assert r["clock"] >= c - 1 - staleness, (vw, stage, r)
            # ... and their own VW's updates up to p - Nm
            if stage == 0 and p >= nm[vw]:
                own = records[(vw, 0)][p - nm[vw]]
                assert own["t_bwd"] <= r["t_fwd"], (vw, p)
            if stage != 0 or p % nm[vw] != 0:
                continue
            # no VW starts wave c before every other VW finished wave c - 2 - D,
            # i.e. it is never more than D + 1 waves ahead of the slowest one
            for other in vws:
                if other == vw or c - 2 - staleness < 0:
                    continue
                done_at = finished[other].get(c - 2 - staleness)
                if done_at is not None:
                    assert done_at <= r["t_fwd"], (vw, c, other)
                    gated += 1
    return gated


# -- the planner's inputs, shaped like the repository's cluster.toml --------------------------


# make_plan's keywords beside repo_cluster() and profile16(), as the planner tests share them.
KW = {"minibatch": 32, "staleness": 0, "optimizer_state_factor": 1}


def repo_cluster(links: tuple[LinkSpec, ...] = ()) -> ClusterConfig:
    """Shaped like cluster.toml: one node; fast 64MiB, medium x2 32MiB, whimpy 3MiB."""
    devs = (
        DeviceSpec("gpu0", "cpu", "fast", 64 * MiB, 1.0, 7200, "node0", "127.0.0.1"),
        DeviceSpec("gpu1", "cpu", "medium", 32 * MiB, 0.5, 7201, "node0", "127.0.0.1"),
        DeviceSpec("gpu2", "cpu", "medium", 32 * MiB, 0.5, 7202, "node0", "127.0.0.1"),
        DeviceSpec("gpu3", "cpu", "whimpy", 3 * MiB, 0.25, 7203, "node0", "127.0.0.1"),
    )
    return ClusterConfig(
        "cluster.toml",
        (ShardSpec(0, "127.0.0.1", 7100), ShardSpec(1, "127.0.0.1", 7101)),
        NetworkSpec(100.0, 10.0, links),
        (NodeSpec("node0", "127.0.0.1", devs),),
        RuntimeSpec(),
    )


# the HetPipe paper's GPUs, type: (memory, relative speed); V = TITAN V, R = TITAN RTX,
# G = RTX 2060, Q = Quadro P4000
GPUS = {"V": (12 * GiB, 14.9), "R": (24 * GiB, 16.3), "G": (6 * GiB, 6.45), "Q": (8 * GiB, 5.3)}


def paper_cluster(types: str = "VRGQ", per_node: int = 4) -> ClusterConfig:
    """One node per letter of ``types``, ``per_node`` GPUs of that type each, a PS shard
    on every node; 10 GB/s inside a node, 1 GB/s between nodes (InfiniBand-class)."""
    nodes = []
    for n, t in enumerate(types):
        host = f"10.0.0.{n}"
        mem, speed = GPUS[t]
        devs = tuple(
            DeviceSpec(f"{t}{n}.{i}", "cpu", t, mem, speed, 0, f"node{n}", host)
            for i in range(per_node)
        )
        nodes.append(NodeSpec(f"node{n}", host, devs))
    shards = tuple(ShardSpec(i, f"10.0.0.{i}", 7100) for i in range(len(nodes)))
    net = NetworkSpec(10e9, 1e9)
    return ClusterConfig("<hetpipe-testbed>", shards, net, tuple(nodes), RuntimeSpec())


@dataclass(frozen=True)
class Dev:
    """A device as the planner reads one: a name, a type, a memory cap and a speed."""

    name: str
    type: str
    memory: int
    speed: float = 1.0


def gpu_cluster(nodes: list[list[tuple[str, float]]], memory: int = GiB) -> ClusterConfig:
    """Nodes of (type, speed) GPUs named g0, g1, ... in order, one shard per node; real
    devices (no emulated core sharing), as the planner sees a cluster of GPUs."""
    out, i = [], 0
    for n, specs in enumerate(nodes):
        devs = []
        for t, s in specs:
            host = f"10.0.0.{n}"
            devs.append(DeviceSpec(f"g{i}", f"cuda:{len(devs)}", t, memory, s, 0, f"n{n}", host))
            i += 1
        out.append(NodeSpec(f"n{n}", f"10.0.0.{n}", tuple(devs)))
    shards = tuple(ShardSpec(j, f"10.0.0.{j}", 7100) for j in range(len(nodes)))
    return ClusterConfig("<t>", shards, NetworkSpec(100.0, 10.0), tuple(out), RuntimeSpec())


def profile16() -> ModelProfile:
    """A synthetic profile of 16 layers on :func:`repo_cluster`'s three device types."""
    return synthetic_profile(
        16,
        {"fast": 1.0, "medium": 0.5, "whimpy": 0.25},
        0,
        param_bytes=(64 << 10, 512 << 10),
        out_bytes=(16 << 10, 128 << 10),
    )


def check_expected(plan: Plan) -> None:
    """Every stage carries its expected peak beside the bound: at most the bound, priced by
    the same model (only the in-flight terms differ; at the bound's count it IS the bound)."""
    for vw in plan.vws:
        for i, s in enumerate(vw.stages):
            e = s.expected_memory
            assert e is not None
            assert 1 <= s.expected_in_flight <= s.in_flight
            if plan.schedule == "async" and i == len(vw.stages) - 1:
                assert s.expected_in_flight == s.in_flight == 1
            if s.expected_in_flight == s.in_flight:
                assert e == s.memory
            else:
                assert e.total < s.memory.total
            assert (e.params, e.optimizer, e.accumulators, e.working) == (
                s.memory.params,
                s.memory.optimizer,
                s.memory.accumulators,
                s.memory.working,
            )


# -- a stage's runner without torch models ----------------------------------------------------


class InlineExecutor(Executor):
    """Runs compute at once on the caller's thread, so the order of events is the test's."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        fut.set_result(fn(*args, **kwargs))
        return fut


class StandInCompute:
    """What a StageRunner calls on a stage's compute, without torch models."""

    def __init__(
        self,
        kind: str,
        k: int,
        stage: int,
        nm: int,
        total: int,
        warmup: int = 0,
        limit: int = 0,
        fill: int = 0,
    ) -> None:
        self.task = StageTask.standalone(
            "j",
            {},
            StageLayout(("gpu0",), 0, 1, in_flight_limit=limit, in_flight_fill=fill),
            stage=stage,
            k=k,
            nm=nm,
            minibatches=total,
        )
        self.spec = SimpleNamespace(
            schedule=kind,
            sync=kind != "async",
            push_every=1,
            checkpoint_every=0,
            eval_every_s=None,
            eval_every=0,  # no validation pass while training
            keep_best=None,
            bn_recalibrate=0,
            metrics=(),  # the job's validation pass: only its loss
            minibatch=1,
            warmup_forwards=warmup,
            order=None,  # train.order unset: the schedule's own order
        )
        self.copier = HostCopier("cpu")
        self.dev, self.speed, self.stalls = "cpu", 1.0, {}  # an unslowed CPU device
        self.slowdowns = ()  # nor slowed by a [[fault]] kind = "slow"
        self.has_state = True
        self.agrees = False  # no step waits for an agreement of the stages
        self.restored = False  # not started from a checkpoint
        self.table = None  # stashes: greedy 1F1B
        self.versions: dict[int, tuple[int, float, int, float]] = {}
        self.stats = SimpleNamespace(
            last_loss=0.0,
            losses=[],
            forward_s=0.0,
            backward_s=0.0,
            peak_bytes=0,
            prediction_quality=[],
            peak_memory={},
            peak_in_flight=0,
        )

    def state_names(self) -> list[str]:
        return []

    def forward(self, p: int, x: Any, y: Any) -> torch.Tensor | None:
        return None if self.task.is_last else torch.zeros(1)

    def backward(self, p: int, grad: Any) -> torch.Tensor | None:
        self.versions[p] = (0, 0.0, 0, 0.0)
        return torch.zeros(1)

    def step(self, i: int, replicas: Any = None) -> None:
        pass

    def read_losses(self, block: bool = False) -> list[tuple[int, float]]:
        return []

    def read_quality(self, block: bool = False) -> None:
        pass

    def push_deltas(self, wave: int, keep: bool) -> HostCopy:
        return HostCopy({})

    def carry(self, wave: int) -> None:
        pass

    def load(self, pulled: Any, applied: Any) -> None:
        pass


class _FakeHead:
    """Takes a worker's replies to the head; a job the worker accepts fails the test."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    async def reply_error(self, _to: object, message: str, _rid: object = None) -> None:
        self.errors.append(message)

    async def send(self, *_args: object, **_kw: object) -> None:
        raise AssertionError("the worker accepted the job")


def worker_errors(
    cluster_file: Path, spec: dict[str, Any], job_id: str, layout: StageLayout
) -> list[str]:
    """What a worker of the file's first device answers, in process, to ``measure`` of
    ``spec`` and to ``assign`` of its stage ``layout`` as job ``job_id``: its refusals."""
    from hetpipe.daemon import Owner
    from hetpipe.worker import Worker

    cluster = load_cluster(cluster_file)
    task = StageTask.standalone(job_id, spec, layout)

    async def go() -> list[str]:
        owner = Owner()
        worker = Worker(cluster, cluster.devices[0], owner, None)
        head = _FakeHead()
        worker.head = head  # type: ignore[assignment]
        try:
            await worker._measure(Message(Kind.MEASURE, {"rid": 1, "job": spec}, {}))
            await worker._assign(
                Message(Kind.ASSIGN, {"rid": 2, "job": job_id, "task": task.to_dict()}, {})
            )
        finally:
            await worker.close()
            await owner.close()
        return head.errors

    return asyncio.run(go())


def stand_in_stream(batch: Any) -> Any:
    """A first stage's data stream that gives ``batch`` for every minibatch, through a
    reader as :meth:`hetpipe.data.MinibatchStream.reader` opens one; it has no validation set."""
    return SimpleNamespace(
        reader=lambda _start: SimpleNamespace(get=lambda _p: batch),
        source=SimpleNamespace(val=None),
    )


def _cat(parts: list[Any]) -> Any:
    """Minibatch parts (Tensors, tuples or dicts of them, or None) joined along their rows."""
    first = parts[0]
    if first is None or len(parts) == 1:
        return first
    if isinstance(first, dict):
        return {k: torch.cat([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple):
        return tuple(torch.cat(col) for col in zip(*parts, strict=True))
    return torch.cat(parts)


def job_toml(spec: dict[str, Any]) -> str:
    """A job dict (as ``conftest.job`` makes) written as the TOML job file a user would
    write: top-level values, one table per section (its nested tables inline), and each list
    of tables (``vw``) as ``[[vw]]`` entries."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        raise TypeError(f"no TOML for {v!r}")

    tops = [f"{k} = {value(v)}" for k, v in spec.items() if not isinstance(v, (dict, list))]
    out = ["\n".join(tops)] if tops else []
    for k, v in spec.items():
        if isinstance(v, dict):
            out.append(f"[{k}]\n" + "\n".join(f"{kk} = {value(x)}" for kk, x in v.items()))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for entry in v:
                out.append(
                    f"[[{k}]]\n" + "\n".join(f"{kk} = {value(x)}" for kk, x in entry.items())
                )
    return "\n\n".join(out) + "\n"


def rss_mb(pid: int) -> float:
    """Process ``pid``'s resident memory in MiB (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class ScheduleInputs:
    """What has arrived at a stage, for driving a :class:`hetpipe.core.schedule.
    StageSchedule` by hand: activations and gradients by minibatch, answered pulls."""

    def __init__(self) -> None:
        self.acts: set[int] = set()
        self.grads: set[int] = set()
        self.answered: set[tuple[int, bool]] = set()

    def has_activation(self, p: int) -> bool:
        return p in self.acts

    def has_gradient(self, p: int) -> bool:
        return p in self.grads

    def pulled(self, c: int, grads: bool) -> bool:
        return (c, grads) in self.answered

    def combined(self, p: int) -> bool:
        return True


def order_dev(
    name: str, dtype: str, memory: int, node: str = "n0", speed: float = 1.0
) -> DeviceSpec:
    """A device as the device-order search reads one (type, memory cap, node, speed)."""
    return DeviceSpec(name, "cpu", dtype, memory, speed, 0, node, "127.0.0.1")


def node_bandwidth(a: DeviceSpec, b: DeviceSpec) -> float:
    """Links that follow node membership: fast inside a node, slow between nodes."""
    return 2e9 if a.node == b.node else 5e7


def random_vw(r: random.Random, layers: int, k: int) -> tuple[ModelProfile, list[DeviceSpec]]:
    """A generated VW for the order searches: a profile of ``layers`` layers on three types
    of speed 1, 0.6 and 0.3, and ``k`` devices of random types on two nodes, each with a
    memory cap of a quarter, a half or one and a half of what the whole model needs."""
    types = {"a": 1.0, "b": 0.6, "c": 0.3}
    prof = synthetic_profile(layers, types, r, param_bytes=(2000, 30000), out_bytes=(1000, 40000))
    need = sum(lp.param_bytes * 5 + lp.saved_bytes * 3 for lp in prof.layers["a"])
    devs = [
        order_dev(
            f"g{i}",
            r.choice("abc"),
            int(need * r.choice((0.25, 0.5, 1.5))),
            f"n{r.randint(0, 1)}",
        )
        for i in range(k)
    ]
    return prof, devs


def random_run(
    schedules: list[Any],
    seed: int,
    max_delay: int,
    on_wait: Callable[[int, Any, Any], None] | None = None,
    on_step: Callable[[int, Any, Any], None] | None = None,
) -> list[list[Any]]:
    """Drive the stages' schedules under a random timing: each step a random stage that can
    act does, and its activation (forward) or gradient (backward) reaches the next or the
    previous stage 0 to ``max_delay`` steps later. A deadlock (no stage can act, nothing on
    the way) fails with what each stage waits for. ``on_wait(s, schedule, wait)`` sees each
    stage's wait, ``on_step(s, schedule, action)`` each action taken. Returns each stage's
    actions in order."""
    from hetpipe.core.schedule import Backward, BackwardInput, Done, Forward, Pull, Wait

    rng = random.Random(seed)
    k = len(schedules)
    inputs = [ScheduleInputs() for _ in schedules]
    flying: list[tuple[int, int, str, int]] = []  # (due, stage, what, p)
    actions: list[list[Any]] = [[] for _ in schedules]
    now = 0
    while not all(s.finished for s in schedules):
        now += 1
        for msg in [f for f in flying if f[0] <= now]:
            flying.remove(msg)
            _due, s, what, p = msg
            (inputs[s].acts if what == "act" else inputs[s].grads).add(p)
        ready = []
        for s, sch in enumerate(schedules):
            a = sch.next(inputs[s])
            if isinstance(a, Pull):
                inputs[s].answered.add((a.c, a.grads))
            if isinstance(a, Wait) and on_wait is not None:
                on_wait(s, sch, a)
            if not isinstance(a, Wait | Done):
                ready.append(s)
        if not ready:
            if not flying:
                waits = {s: sch.next(inputs[s]) for s, sch in enumerate(schedules)}
                raise AssertionError(f"deadlock: {waits}")
            continue
        s = rng.choice(ready)
        a = schedules[s].next(inputs[s])
        schedules[s].done(a)
        actions[s].append(a)
        if on_step is not None:
            on_step(s, schedules[s], a)
        if isinstance(a, Forward) and s + 1 < k:
            flying.append((now + rng.randint(0, max_delay), s + 1, "act", a.p))
        elif isinstance(a, Backward | BackwardInput) and s > 0:
            flying.append((now + rng.randint(0, max_delay), s - 1, "grad", a.p))
    return actions


def collector() -> tuple[list[Message], asyncio.Event, Callable[..., Awaitable[None]]]:
    """A channel handler that keeps what it is given, and an event set at each arrival."""
    got: list[Message] = []
    arrived = asyncio.Event()

    async def on(_peer: bytes | None, msg: Message) -> None:
        got.append(msg)
        arrived.set()

    return got, arrived, on


def hetpipe_cli(
    cluster: Path, run_dir: Path, *args: str, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    """``hetpipe --cluster CLUSTER --run-dir RUN_DIR ARGS`` in a process of its own, from the
    cluster file's folder, with no ``HETPIPE_*`` variable of the test's environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETPIPE_")}
    return subprocess.run(
        [
            *(sys.executable, "-m", "hetpipe.cli"),
            *("--cluster", str(cluster), "--run-dir", str(run_dir)),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cluster.parent,
    )


def daemon_of(pid: int, run_dir: Path) -> bool:
    """Whether ``pid`` is still a daemon of ``run_dir`` (never another process that took the
    number since; a zombie has no command line, so it is none)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return str(run_dir).encode() in cmdline


def stop_up_daemons(cluster: Path, run_dir: Path, pids: dict[str, int]) -> None:
    """After a test of ``hetpipe up``, however it ended: ``hetpipe down`` where the run
    directory still lists daemons, then SIGKILL to any of ``pids`` (and of ``pids.json``)
    still running as a daemon of ``run_dir``."""
    with contextlib.suppress(OSError, ValueError):
        pids.update(json.loads((run_dir / "pids.json").read_text()))
    if (run_dir / "pids.json").exists():
        with contextlib.suppress(Exception):
            hetpipe_cli(cluster, run_dir, "down", timeout=30)
    for pid in pids.values():
        if daemon_of(pid, run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def example_files() -> tuple[list[Path], list[Path]]:
    """The repository's example job files (``examples/*.toml`` and the demo's) and its example
    cluster files (those with ``[[node]]`` tables, such as ``examples/paper_testbed.toml``)."""
    root = Path(__file__).resolve().parent.parent
    jobs: list[Path] = []
    clusters: list[Path] = []
    for path in [*sorted((root / "examples").glob("*.toml")), root / "hetpipe" / "demo.toml"]:
        (clusters if "node" in tomllib.loads(path.read_text()) else jobs).append(path)
    return jobs, clusters


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported as a module (the scripts are no package; each imports
    its siblings, such as ``_bench``, so the folder is on ``sys.path`` while it loads)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


class RecoveryHead(RecoveryPart):
    """The state :class:`hetpipe.head.recovery.RecoveryPart` reads, and nothing else: a run
    directory, the jobs, the queue, a log (its recovery tested on job records alone)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.jobs: dict[str, JobState] = {}
        self.queue: asyncio.Queue[JobState] = asyncio.Queue()
        self.log = logmod.get("test")
        self.cluster = SimpleNamespace(security=SimpleNamespace(allowed_modules=()))
        self._n = 100

    def _new_id(self, name: str) -> str:
        self._n += 1
        return f"{name}-{self._n}"


def cli_status(cluster: Path, run_dir: Path, job_id: str) -> dict[str, Any]:
    """``hetpipe status JOB --json`` through the CLI, as a user runs it."""
    got = hetpipe_cli(cluster, run_dir, "status", job_id, "--json")
    assert got.returncode == 0, got.stdout + got.stderr
    return json.loads(got.stdout)


def cli_until(
    cluster: Path, run_dir: Path, job_id: str, reached: Any, timeout: float
) -> dict[str, Any]:
    """:func:`cli_status` until ``reached(status)`` (failing where the job ends first or
    ``timeout`` s pass)."""
    deadline = time.monotonic() + timeout
    while True:
        info = cli_status(cluster, run_dir, job_id)
        if reached(info):
            return info
        assert info["state"] in ("queued", "planning", "running"), info
        assert time.monotonic() < deadline, info
        time.sleep(0.3)


class UpDown:
    """A cluster file of ``devices`` and two shards on fixed ports (so a head started again
    finds its daemons where the file says), brought up and down through the CLI as a user
    does (``hetpipe up`` / ``down``); ``pids`` collects every daemon it started, for
    :func:`stop_up_daemons`."""

    def __init__(self, tmp_path: Path, devices: Any) -> None:
        from hetpipe.localcluster import DeviceDef, cluster_toml, free_ports

        ports = free_ports(len(devices) + 2)
        defs = tuple(
            DeviceDef(d.name, d.type, d.memory, d.speed, port=p)
            for d, p in zip(devices, ports[2:], strict=True)
        )
        self.cluster = tmp_path / "cluster.toml"
        self.cluster.write_text(cluster_toml(defs, shard_ports=ports[:2]))
        self.run_dir = tmp_path / "run"
        self.pids: dict[str, int] = {}

    def up(self) -> str:
        got = hetpipe_cli(self.cluster, self.run_dir, "up", "--timeout", "60")
        with contextlib.suppress(OSError, ValueError):
            self.pids.update(json.loads((self.run_dir / "pids.json").read_text()))
        assert got.returncode == 0, got.stdout + got.stderr
        return got.stdout

    def down(self) -> None:
        got = hetpipe_cli(self.cluster, self.run_dir, "down")
        assert got.returncode == 0, got.stdout + got.stderr


# two hosts joined by one slow link (the placement and link-sharing tests)
SLOW_GBPS = 0.004  # 4 Mbit/s: 500 000 bytes/s
HOST = {"a": "10.0.0.1", "b": "10.0.0.2"}


def two_hosts(slow_gbps: float = SLOW_GBPS, shards: tuple[str, ...] = ("a", "b")) -> ClusterConfig:
    """Hosts a (a0, a1) and b (b0, b1), one shard on each named host, the a-b link at
    ``slow_gbps`` (every device pair across it overridden, as bench_network writes it)."""
    nodes = tuple(
        NodeSpec(
            n,
            HOST[n],
            tuple(DeviceSpec(f"{n}{i}", "cpu", "fast", GiB, 1.0, 0, n, HOST[n]) for i in range(2)),
        )
        for n in ("a", "b")
    )
    links = tuple(LinkSpec(f"a{i}", f"b{j}", slow_gbps) for i in range(2) for j in range(2))
    return ClusterConfig(
        "two-hosts.toml",
        tuple(ShardSpec(j, HOST[h], 0) for j, h in enumerate(shards)),
        # every task handed to the compute thread: the formations here
        # differ by their links, not by which tasks skip the hand-off
        NetworkSpec(10.0, 10.0, links),
        nodes,
        RuntimeSpec(inline_ms=0),
    )


PARAM = 256 << 10  # bytes of every layer's parameters in placement_profile
LAYERS = 8
SLOW_BPS = SLOW_GBPS * 1e9 / 8


def placement_profile(t: float = 2e-3) -> ModelProfile:
    """Identical layers of ``PARAM`` bytes of parameters and a small activation."""
    lp = LayerProfile(t, 2 * t, PARAM, 0, 4096, 8192, 8192)
    return ModelProfile("flat", 32, 4096, {"fast": (lp,) * LAYERS})


def model_of(cluster: ClusterConfig, costs: RuntimeCosts | None = None) -> CostModel:
    """The planner's cost model of :func:`placement_profile` on ``cluster``'s links."""
    return CostModel(
        placement_profile(), cluster.network.bytes_per_s, 1, costs or RuntimeCosts.zero()
    )


def with_saved_ends(prof, seed: int):
    """``prof`` with measured saved ends, as the profiler records them: each layer saves its
    input, its output, both or neither (a Linear, a ReLU, ...), the rest of its saved bytes
    other tensors."""
    r = random.Random(seed)
    layers = {}
    for dtype, lps in prof.layers.items():
        r.seed(seed)  # every type alike: the ends are the model's, not the device's
        row, inb = [], prof.input_bytes
        for lp in lps:
            s_in = inb if r.random() < 0.5 else 0
            s_out = lp.out_bytes if r.random() < 0.5 else 0
            row.append(
                dataclasses.replace(
                    lp,
                    saved_bytes=s_in + s_out + r.randint(0, 4000),
                    saved_input_bytes=s_in,
                    saved_output_bytes=s_out,
                )
            )
            inb = lp.out_bytes
        layers[dtype] = tuple(row)
    return dataclasses.replace(prof, layers=layers)
