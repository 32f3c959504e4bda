"""Profiling requests: the per-layer profiles of a job's model on every live device type,
measured by idle workers where the run directory has none yet, and the ``profile`` and
``plan`` requests of the CLI that read them.

Each (model, minibatch, type) is measured once per run directory; the emulated types of one
node are measured once, on one of them, and scaled by speed (:func:`computes_on_cores`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

from hetpipe.config import ClusterConfig
from hetpipe.head.registry import Registry, WorkerInfo
from hetpipe.head.states import JobFailed
from hetpipe.job import JobError, JobSpec
from hetpipe.jobcheck import check_job
from hetpipe.planner import ModelProfile, PlanError, ProfileStore
from hetpipe.planner.profile import TieProfile, at_speed
from hetpipe.profiling import (
    call_from,
    computes_on_cores,
    layers_from,
    live_cluster,
    model_key,
    plan_for,
    replica_rows,
)
from hetpipe.security import CodeError
from hetpipe.transport import Channel, RemoteError
from hetpipe.wire import Kind, Message

__all__ = ["MEASURE_TIMEOUT_S", "Profiler"]

MEASURE_TIMEOUT_S = 600.0


class Profiler:
    """The head's profiles: measured on request, kept in ``<run_dir>/profiles.json``."""

    def __init__(self, cluster: ClusterConfig, registry: Registry, run_dir: Path, log: Any) -> None:
        self.cluster = cluster
        self.registry = registry
        self.store = ProfileStore(run_dir / "profiles.json")
        self.channel: Channel | None = None  # the head's, once it starts
        self.log = log
        self._lock = asyncio.Lock()  # one profiling at a time

    async def answer(self, peer: bytes, msg: Message) -> None:
        """Answer ``profile`` (the profiles of every type) or ``plan`` (the plan it would
        run)."""
        assert self.channel is not None
        try:
            spec = JobSpec.from_dict(msg["job"], source="job", strict=True)
            # the job checks start with the code policy (nothing is imported before it)
            facts = await asyncio.get_running_loop().run_in_executor(
                None, lambda: check_job(spec, self.cluster, "job", host="head")
            )
            if msg.kind == Kind.PLAN:
                profile, rows = await self.profiles(spec)
            else:
                profile = await self.profile(spec)
            info: dict[str, Any] = {"profile": profile.to_dict()}
            if msg.kind == Kind.PLAN:
                loop = asyncio.get_running_loop()
                cluster = live_cluster(self.cluster, self.registry.idle())
                n_train = facts.n_train
                plan = await loop.run_in_executor(
                    None, lambda: plan_for(spec, cluster, profile, rows, n_train=n_train)
                )
                info = {"plan": plan.to_dict(), "table": plan.table()}
        except (JobError, CodeError, PlanError, JobFailed) as exc:
            await self.channel.reply_error(peer, str(exc), msg["rid"])
            return
        await self.channel.send(Kind.OK, {"rid": msg["rid"], "info": info}, to=peer)

    async def profiles(self, spec: JobSpec) -> tuple[ModelProfile, dict[int, ModelProfile]]:
        """The job's profile, and its model profiled at the rows its stage replicas may hold
        (:func:`hetpipe.profiling.replica_rows`; stored like every profile). A replica's
        compute is read off the latter against the former, so both are measured back to
        back: where a row profile is missing, the stored full one is measured again, lest
        the planner decide on two different moments' load on a shared host."""
        rows = replica_rows(spec)
        key = model_key(spec)
        types = {w.type for w in self.registry.alive().values()}
        if any(self.store.get(key, r, t) is None for r in rows for t in types):
            self.store.forget(key, spec.minibatch)
        profile = await self.profile(spec)
        return profile, {
            r: await self.profile(dataclasses.replace(spec, minibatch=r)) for r in rows
        }

    async def profile(self, spec: JobSpec) -> ModelProfile:
        """Profiles of the job's model for every device type with a live worker.

        Missing ones are measured by an idle worker of that type and stored, so each
        (model, minibatch, type) is measured once per run directory; the emulated types of
        one node are measured once, on one of them (:func:`computes_on_cores`).
        """
        key = model_key(spec)
        async with self._lock:
            types = sorted({w.type for w in self.registry.alive().values()})
            on_cores: dict[str, tuple[float, dict[str, Any]]] = {}  # node: (speed, measured)
            for dtype in types:
                if self.store.get(key, spec.minibatch, dtype) is not None:
                    continue
                of_type = [w for w in self.registry.alive().values() if w.type == dtype]
                twin = next(
                    (
                        d
                        for d in (self.cluster.device(w.device) for w in of_type)
                        if d.node in on_cores and computes_on_cores(d)
                    ),
                    None,
                )
                if twin is not None:  # its node's cores measured already: over its speed
                    speed, info = on_cores[twin.node]
                    layers, call = at_speed(layers_from(info), call_from(info), speed, twin.speed)
                    self.log.info(
                        "profile from the same cores",
                        model=spec.model.name,
                        type=dtype,
                        device=twin.name,
                    )
                else:
                    worker, info = await self._measure(spec, dtype, of_type)
                    layers, call = layers_from(info), call_from(info)
                    device = self.cluster.device(worker.device)
                    if computes_on_cores(device):
                        on_cores[device.node] = (device.speed, info)
                ties = [TieProfile.from_dict(t) for t in info.get("ties") or ()]
                self.store.put(
                    key,
                    spec.minibatch,
                    dtype,
                    layers,
                    input_bytes=info["input_bytes"],
                    call=call,
                    ties=ties,
                )
            self.store.save()
            if not types:
                raise JobFailed("no live worker: start them (`hetpipe up`)")
            return self.store.model_profile(key, spec.minibatch, types)

    async def _measure(
        self, spec: JobSpec, dtype: str, of_type: list[WorkerInfo]
    ) -> tuple[WorkerInfo, dict[str, Any]]:
        """Profile ``spec``'s model on an idle worker of ``dtype``: the worker, its answer."""
        assert self.channel is not None
        worker = next((w for w in of_type if w.job is None), None)
        if worker is None:
            raise JobFailed(f"no idle worker of type {dtype} to profile {spec.model.name} on")
        self.log.info("profiling", model=spec.model.name, type=dtype, device=worker.device)
        try:
            reply = await self.channel.request(
                Kind.MEASURE,
                {"job": spec.to_dict()},
                to=worker.ident,
                timeout=MEASURE_TIMEOUT_S,
                what=f"worker {worker.device}",
            )
        except (RemoteError, TimeoutError, ConnectionError) as exc:
            raise JobFailed(f"profiling on {worker.device}: {exc}") from None
        return worker, reply["info"]
