"""Profiles per device type, measured where the devices are, and plans made from them.

The planner needs, for every device type of the cluster, each layer's forward and backward
time at the job's minibatch size. Only a worker of that type can measure them honestly (an
emulated device pads to its speed; a real GPU is itself), so the head asks one idle worker
per type with a ``measure`` message (:mod:`hetpipe.measure`, on the worker) and keeps the
answers in a readable JSON file in its run directory, keyed by model, minibatch size and
device type, so each is measured once. This module is the head's side: reading answers,
and the plan made from them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from hetpipe.config import ClusterConfig, DeviceSpec
from hetpipe.data import load_data
from hetpipe.job import JobSpec
from hetpipe.optim import StageOptimizer
from hetpipe.planner import (
    CallProfile,
    LayerProfile,
    ModelProfile,
    Plan,
    PlanError,
    PlanInputs,
    explicit_plan,
    make_plan,
    replica_proposals,
    sync_plan,
    weights_mode,
)
from hetpipe.planner.staleness import choose_schedule

__all__ = [
    "computes_on_cores",
    "live_cluster",
    "model_key",
    "plan_for",
    "plan_inputs",
    "replica_rows",
]


def model_key(spec: JobSpec) -> str:
    """What a profile depends on besides minibatch and device type: model, input and the
    compute precision (a float32 profile keeps the key it always had)."""
    key = {
        "model": spec.model.name,
        "args": spec.model.args,
        "data": spec.data.name,
        "data_args": spec.data.args,
    }
    if spec.data.collate:  # a collate shapes the input the first layer is profiled with
        key["data_collate"] = spec.data.collate
    if spec.precision != "fp32":
        key["precision"] = spec.precision
    if spec.code:  # the user's model as submitted: an edited module is profiled anew
        key["code"] = spec.code
    return json.dumps(key, sort_keys=True)


def computes_on_cores(device: DeviceSpec) -> bool:
    """Whether ``device`` computes on its node's CPU cores (emulated, padded to its speed).

    Such devices of one node run the same compute on the same cores, so the head measures
    one and takes the others' profiles from it over their speeds
    (:func:`hetpipe.planner.profile.at_speed`): exact ratios, where types measured one after
    the other would each carry the host's load of their moment."""
    return device.device.startswith("cpu")


def layers_from(info: Mapping[str, Any]) -> tuple[LayerProfile, ...]:
    return tuple(LayerProfile(**d) for d in info["layers"])


def call_from(info: Mapping[str, Any]) -> CallProfile | None:
    """The stage call term a worker measured (None from a worker that measures none)."""
    return CallProfile.from_dict(info["call"]) if info.get("call") is not None else None


def live_cluster(cluster: ClusterConfig, devices: set[str]) -> ClusterConfig:
    """The cluster restricted to ``devices`` (live, idle workers): what a plan may use."""
    nodes = []
    for node in cluster.nodes:
        kept = tuple(d for d in node.devices if d.name in devices)
        if kept:
            nodes.append(dataclasses.replace(node, devices=kept))
    return dataclasses.replace(cluster, nodes=tuple(nodes))


def plan_inputs(
    spec: JobSpec,
    row_profiles: Mapping[int, ModelProfile] | None = None,
    n_train: int | None = None,
) -> PlanInputs:
    """What the planner prices ``spec`` with (also the online re-plan, hetpipe.head.drift)."""
    return PlanInputs(
        minibatch=spec.minibatch,
        staleness=spec.staleness,
        optimizer_state_factor=StageOptimizer.state_factor(spec.optimizer),
        policy=spec.policy,
        num_vws=spec.num_vws,
        nm=spec.nm,
        minibatches=job_minibatches(spec, n_train),
        weights=weights_mode(spec.weights, spec.predict_variant),
        activations=spec.activations,
        max_replicas=spec.max_replicas,
        row_profiles=row_profiles,
        in_flight=spec.in_flight,
        max_nm=spec.max_nm,
        placement=spec.placement,
    )


def plan_for(
    spec: JobSpec,
    cluster: ClusterConfig,
    profile: ModelProfile,
    row_profiles: Mapping[int, ModelProfile] | None = None,
    *,
    n_train: int | None = None,
    chunk_devices: int | None = None,
) -> Plan:
    """The planner's plan for a job without a split, or its prediction for the given split;
    ``row_profiles``: the model profiled at the rows of a replica (:func:`replica_rows`);
    ``n_train``: the training samples, where the caller has loaded the data set already;
    ``chunk_devices``: a device-level schedule's real device count, where the split priced
    stands for one whose devices run several stages
    (:func:`hetpipe.jobplan.one_stage_per_device`)."""
    inputs = plan_inputs(spec, row_profiles, n_train)
    if spec.sync:
        return _planned_sync(spec, cluster, profile, inputs, chunk_devices)
    if spec.schedule == "auto":
        return _auto_plan(spec, cluster, profile, inputs)
    if not spec.vws:  # the planner decides the replicas too (train.max_replicas)
        return make_plan(cluster, profile, inputs)
    plan = explicit_plan(
        cluster,
        profile,
        [(v.devices, v.layers, v.nm or spec.nm) for v in spec.vws],
        inputs,
        groups=[
            [v.group(s) for s in range(len(v.devices))] if v.replicas else None for v in spec.vws
        ],
    )
    orders = [v.all_devices() for v in spec.vws]
    given = [
        (tuple(v.group(s) for s in range(len(v.devices))), v.layers)
        if v.replicas and v.layers
        else None
        for v in spec.vws
    ]
    if spec.max_replicas > 1 or any(given):
        # the explicit plan above predicts the stages' leaders alone; the replicated
        # groupings are priced by the replica DP's model (hetpipe.planner.replicas)
        proposals = replica_proposals(cluster, profile, plan, orders, inputs, given=given)
        plan = dataclasses.replace(plan, details={**plan.details, "replicas": proposals})
    return plan


SYNC_M = 4  # microbatches per iteration of a synchronous job that does not say (train.nm)


def _planned_sync(
    spec: JobSpec,
    cluster: ClusterConfig,
    profile: ModelProfile,
    inputs: PlanInputs,
    chunk_devices: int | None = None,
) -> Plan:
    """The synchronous plan of a job: its own kind and split where it gives them (priced),
    else searched; under ``train.schedule = "auto"`` the search picks gpipe or 1f1b too."""
    given = [(v.devices, v.layers) for v in spec.vws] if spec.sync else []
    return sync_plan(
        cluster,
        profile,
        minibatch=spec.minibatch,
        m=spec.nm or SYNC_M,
        optimizer_state_factor=inputs.optimizer_state_factor,
        kind=spec.schedule if spec.sync else None,
        vws=given or None,
        num_vws=spec.num_vws,
        policy=spec.policy,
        warmup=spec.warmup_forwards,
        placement=spec.placement,
        chunk_devices=chunk_devices,
        # two stages a device only where the job could run that split as its own (job.py's
        # refusals: no re-plan or re-form on a lost worker, no planner-picked activations)
        several_stages=spec.several_stages
        and not spec.vws
        and spec.on_worker_loss == "fail"
        and spec.activations != "auto",
        minibatches=inputs.minibatches,
    )


MAX_PROFILED_REPLICAS = 4  # replica counts profiled at their rows (more: interpolated)


def replica_rows(spec: JobSpec) -> tuple[int, ...]:
    """The minibatch sizes at which a job's model is profiled besides its own, so that the
    planner prices a replica's compute at its rows (:meth:`CostModel.compute_at`): the rows
    of r equal replicas, for r = 2 .. the most a stage may have (``train.max_replicas``, or
    the largest group the job gives; at most :data:`MAX_PROFILED_REPLICAS`). None for a
    synchronous job (no replicas)."""
    if spec.sync:
        return ()
    most = max(
        [spec.max_replicas, *(len(v.group(s)) for v in spec.vws for s in range(len(v.devices)))]
    )
    return tuple(
        sorted(
            {
                spec.minibatch // r
                for r in range(2, min(most, MAX_PROFILED_REPLICAS) + 1)
                if spec.minibatch // r >= 1
            }
        )
    )


def _auto_plan(
    spec: JobSpec, cluster: ClusterConfig, profile: ModelProfile, inputs: PlanInputs
) -> Plan:
    """``train.schedule = "auto"``: the async plan or the synchronous one, whichever the
    planner predicts trains faster (samples per second, an async plan's weighted by the
    staleness rule of :mod:`hetpipe.planner.staleness`, which the reason states)."""
    plans: list[Plan] = []
    errors = []
    try:
        plans.append(make_plan(cluster, profile, inputs))
    except PlanError as exc:
        errors.append(f"async: {exc}")
    try:
        plans.append(_planned_sync(spec, cluster, profile, inputs))
    except PlanError as exc:
        errors.append(f"synchronous: {exc}")
    if not plans:
        raise PlanError("; ".join(errors))
    best, why = choose_schedule(plans, errors)  # the staleness rule weighs async
    return dataclasses.replace(
        best, warnings=(*best.warnings, why), details={**best.details, "schedule_choice": why}
    )


def job_minibatches(spec: JobSpec, n_train: int | None = None) -> int:
    """Minibatches per virtual worker the job will run (the prediction covers the whole job);
    ``n_train``: the training samples, loaded here where not given."""
    if spec.minibatches:
        return spec.minibatches
    vws = len(spec.vws) or spec.num_vws or 1
    train = (
        n_train
        if n_train is not None
        else load_data(spec.data.name, spec.data.args, spec.data.collate).train_len() or 0
    )
    return max(1, (spec.epochs or 1) * (train // spec.minibatch // vws))


def predicted_summary(plan: Plan) -> dict[str, Any]:
    """What the job status shows next to the measured figures."""
    return {
        "samples_per_s": plan.samples_per_s,
        "policy": plan.policy,
        "schedule": plan.schedule,
        "warmup": plan.warmup,
        "iteration_s": plan.iteration_s,
        "vws": [
            {
                "samples_per_s": v.samples_per_s,
                "nm": v.nm,
                # time_s: predicted compute per minibatch, comparable to the measured one
                "stages": [
                    {
                        "device": s.device,
                        "layers": list(s.layers),
                        "time_s": s.time_s,
                        "busy_s": s.busy_s,
                        "slowdown": s.slowdown,
                        "memory": s.memory.total,
                        "memory_cap": s.memory_cap,
                        "memory_terms": s.memory.to_dict(),
                        # the peak of the predicted timeline, beside the bound above
                        "expected_memory": (s.expected_memory.total if s.expected_memory else None),
                        "expected_memory_terms": (
                            s.expected_memory.to_dict() if s.expected_memory else None
                        ),
                        "expected_in_flight": s.expected_in_flight,
                        "in_flight": s.in_flight,
                        "limit": s.limit,
                        "recompute": list(s.recompute),
                        "swap": list(s.swap),
                        "replicas": list(s.replicas),
                        "exchange_s": s.exchange_s,
                    }
                    for s in v.stages
                ],
            }
            for v in plan.vws
        ],
        "warnings": list(plan.warnings),
        "unused": list(plan.unused),
        # train.max_replicas: per VW, the replicated split weighed and why (not) chosen
        "replica_choice": list(plan.details.get("replica_choice", ())),
        # devices the search left out, with the predicted samples/s with and without each
        "left_out": list(plan.details.get("left_out", ())),
    }
