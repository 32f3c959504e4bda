"""From a submitted job to what the runtime executes: stages, placement, initial weights.

The head calls :func:`plan_job` once per job. It checks the job against the cluster and the
live workers (one line per problem, naming the device or key), builds the model once on the
CPU from the job's seed so that every virtual worker starts from the same weights, places
each stage's state on a parameter-server shard, and produces the stage tasks.

Only the tensors :mod:`hetpipe.modelstate` calls *shared* go to the shards (one entry per tied
tensor, frozen parameters included); non-persistent buffers go to their stages with the
assignment; the export restores the names of tied tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import torch

from hetpipe.config import ClusterConfig, ConfigError
from hetpipe.core.schedule import fill_counts
from hetpipe.daemon import normal_host
from hetpipe.data import Dataset, MinibatchStream, evaluate, load_dataset, recalibrate_bn
from hetpipe.job import JobSpec, VWSpec
from hetpipe.models import ModelError, build_model
from hetpipe.modelstate import LayoutError, StateLayout, layer_of
from hetpipe.planner import place_stages
from hetpipe.replicas import check_group, split_rows
from hetpipe.task import StageTask

__all__ = ["JobPlan", "JobPlanError", "RunStage", "RunVW", "plan_job"]


class JobPlanError(ValueError):
    """The job cannot run on this cluster now; the text says why."""


@dataclass(frozen=True)
class RunStage:
    """One stage as the runtime runs it: a device and layers ``first``..``last``-1."""

    device: str
    first: int
    last: int
    recompute: tuple[int, ...] = ()  # global layers whose activations are recomputed
    swap: tuple[int, ...] = ()  # global layers whose activations wait in host memory
    replicas: tuple[str, ...] = ()  # devices replicating the stage beside ``device``
    rows: tuple[int, ...] = ()  # replicated: the minibatch's row bounds per device
    limit: int = 0  # the most minibatches it holds in flight (0: the schedule's maximum)
    fill: int = 0  # forwards before its first backward (hetpipe.core.schedule.fill_counts)

    @property
    def group(self) -> tuple[str, ...]:
        """The stage's devices, leader first (hetpipe.replicas)."""
        return (self.device, *self.replicas)


@dataclass(frozen=True)
class RunVW:
    """One virtual worker: its stages in pipeline order and its Nm."""

    stages: tuple[RunStage, ...]
    nm: int


@dataclass
class JobPlan:
    """Everything the head needs to launch, follow and finish one job."""

    job: str
    spec: JobSpec
    vws: tuple[RunVW, ...]
    minibatches: int  # per virtual worker
    placement: dict[str, int]  # global state name -> shard
    initial: dict[str, torch.Tensor] | None
    dataset: Dataset
    predicted: dict[str, Any] = field(default_factory=dict)
    layout: StateLayout | None = None  # None: the plain state_dict, nothing tied or local
    local: dict[str, torch.Tensor] = field(default_factory=dict)  # non-persistent buffers
    # a resumed attempt: each VW's data position (minibatches done before it), and (async)
    # the minibatches each VW still owes, which differ where VWs stopped at other positions
    starts: tuple[int, ...] = ()
    owed: tuple[int, ...] = ()

    @property
    def n_stages(self) -> int:
        return sum(len(v.stages) for v in self.vws)

    def where(self, vw: int, stage: int) -> str:
        return f"vw{vw}/stage{stage} ({self.device_of(vw, stage)})"

    def device_of(self, vw: int, stage: int) -> str:
        return self.vws[vw].stages[stage].device

    def stage_names(self, vw: int, stage: int) -> list[str]:
        st = self.vws[vw].stages[stage]
        return [n for n in self.placement if st.first <= _layer(n) < st.last]

    def local_state(self, vw: int, stage: int) -> dict[str, torch.Tensor]:
        """Initial values of the non-persistent buffers of one stage (sent with its task)."""
        st = self.vws[vw].stages[stage]
        return {n: t for n, t in self.local.items() if st.first <= layer_of(n) < st.last}

    def shards_used(self) -> list[int]:
        return sorted(set(self.placement.values()))

    def minibatches_of(self, vw: int) -> int:
        """Minibatches (microbatches) virtual worker ``vw`` runs.

        Synchronous schedules exchange gradients every iteration, so every virtual worker
        runs the same number of iterations: ``minibatches`` counts the first one's
        microbatches, and one with another M runs that many iterations of its own M.
        """
        if not self.spec.sync:
            return self.owed[vw] if self.owed else self.minibatches
        return -(-self.minibatches // self.vws[0].nm) * self.vws[vw].nm

    def start_of(self, vw: int) -> int:
        """Minibatches virtual worker ``vw`` ran before this attempt (its data position)."""
        return self.starts[vw] if self.starts else 0

    @property
    def total_minibatches(self) -> int:
        return sum(self.minibatches_of(v) for v in range(len(self.vws)))

    def waves(self, vw: int) -> int:
        return -(-self.minibatches_of(vw) // self.vws[vw].nm)

    def shard_contents(self) -> dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        """Per shard: the ``members`` map of shard_init and the initial weights it holds."""
        assert self.initial is not None, "initial weights already handed to the shards"
        out: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}
        for v, vwp in enumerate(self.vws):
            for s in range(len(vwp.stages)):
                for name in self.stage_names(v, s):
                    shard = self.placement[name]
                    members, weights = out.setdefault(shard, ({}, {}))
                    member = members.setdefault(str(v), {"waves": self.waves(v), "stages": {}})
                    member["stages"].setdefault(str(s), []).append(name)
                    weights[name] = self.initial[name]
        return out

    def release_initial_weights(self) -> None:
        """The shards hold them now; the head need not."""
        self.initial = None

    def tasks(self, shards: Mapping[int, str], workers: Mapping[str, Any]) -> list[StageTask]:
        """The stage assignments, with neighbours' data addresses and shard addresses."""
        out = []
        spec = self.spec.to_dict()
        n = self.spec.minibatch

        def side(st: RunStage | None) -> dict[str, Any]:
            if st is None:
                return {"group": [], "peers": [], "rows": []}
            return {
                "group": list(st.group),
                "peers": [workers[d].address for d in st.group],
                "rows": list(st.rows or (0, n)),
            }

        for v, vwp in enumerate(self.vws):
            k = len(vwp.stages)
            for s, st in enumerate(vwp.stages):
                names = self.stage_names(v, s)
                prev = side(vwp.stages[s - 1] if s > 0 else None)
                nxt = side(vwp.stages[s + 1] if s < k - 1 else None)
                own = side(st)
                for r in range(len(st.group)):
                    out.append(
                        StageTask(
                            job=self.job,
                            spec=spec,
                            vw=v,
                            stage=s,
                            k=k,
                            first=st.first,
                            last=st.last,
                            nm=vwp.nm,
                            staleness=self.spec.staleness,
                            minibatches=self.minibatches_of(v),
                            num_vws=len(self.vws),
                            prev=prev["peers"][0] if s > 0 else None,
                            next=nxt["peers"][0] if s < k - 1 else None,
                            shards={
                                str(self.placement[n]): shards[self.placement[n]] for n in names
                            },
                            placement={n: self.placement[n] for n in names},
                            prev_device=prev["group"][0] if s > 0 else None,
                            next_device=nxt["group"][0] if s < k - 1 else None,
                            recompute=list(st.recompute),
                            swap=list(st.swap),
                            start=self.start_of(v),
                            replica=r,
                            in_flight_limit=st.limit,
                            in_flight_fill=st.fill,
                            **own,
                            **{f"prev_{key}": val for key, val in prev.items()},
                            **{f"next_{key}": val for key, val in nxt.items()},
                        )
                    )
        return out

    def placement_summary(self) -> list[dict[str, Any]]:
        """Per stage: which shard holds its state and how many bytes (reported to the user)."""
        rows = []
        for v, vwp in enumerate(self.vws):
            for s, st in enumerate(vwp.stages):
                names = self.stage_names(v, s)
                rows.append(
                    {
                        "vw": v,
                        "stage": s,
                        "device": st.device,
                        "shards": sorted({self.placement[n] for n in names}),
                        "bytes": self.predicted.get("state_bytes", {}).get(f"{v}/{s}", 0),
                    }
                )
        return rows

    def model_of(self, state: dict[str, torch.Tensor]) -> torch.nn.Sequential:
        """The plain model holding ``state``; ``strict=True`` proves the state is whole.

        The names of tied tensors are filled in from their canonical one, so the model's
        ties hold one value and its ``state_dict()`` lists every name, as torch's does.
        """
        model = build_model(self.spec.model.name, self.spec.model.args)
        if self.layout is not None:
            state = self.layout.with_aliases(state)
        model.load_state_dict(state, strict=True)
        return model

    def evaluate(self, state: dict[str, torch.Tensor]) -> float:
        """Test accuracy of global weights ``state`` (batch-norm statistics re-estimated
        first where the job asks, ``train.bn_recalibrate``)."""
        model = self.model_of(state)
        self._recalibrate(model)
        return evaluate(model, self.dataset)

    def export(self, state: dict[str, torch.Tensor], out_dir: Path) -> tuple[float, float | None]:
        """Write the global weights as one state_dict; return their test accuracy, and (where
        batch-norm statistics were re-estimated before the export) the accuracy with the
        statistics as trained, for comparison."""
        model = self.model_of(state)
        before = None
        if self.spec.bn_recalibrate and any(
            isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()
        ):
            before = evaluate(model, self.dataset)
            self._recalibrate(model)
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), out_dir / "model.pt")
        return evaluate(model, self.dataset), before

    def _recalibrate(self, model: torch.nn.Module) -> None:
        """Re-estimate batch-norm statistics over ``train.bn_recalibrate`` minibatches of the
        training set (VW 0's order), with the global weights."""
        if self.spec.bn_recalibrate:
            stream = MinibatchStream(self.dataset, self.spec.minibatch, self.spec.seed)
            recalibrate_bn(model, stream, self.spec.bn_recalibrate)


_layer = layer_of


def _host_of(address: str) -> str:
    return normal_host(urlparse(address).hostname or "")


def _replicas(
    cluster: ClusterConfig,
    layout: StateLayout,
    vwspec: VWSpec,
    stage: int,
    minibatch: int,
    layers: tuple[int, int],
    key: str,
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A stage's replicas and its row split (in proportion to the devices' speeds), or
    ``((), ())`` for a stage on one device; a replicated stage holding running statistics
    (batch norm) is refused: each replica would keep its own, and they would drift apart."""
    group = vwspec.group(stage)
    if len(group) < 2:
        return (), ()
    devices = [cluster.device(d) for d in group]
    try:
        check_group(cluster, devices, minibatch)
    except ValueError as exc:
        raise JobPlanError(f"{key}: {exc}") from None
    stats = [n for n in layout.buffers if layers[0] <= _layer(n) < layers[1]]
    if stats:
        raise JobPlanError(
            f"{key}: a replicated stage may not hold running statistics "
            f"({stats[0]}: batch norm would keep one per replica)"
        )
    return group[1:], tuple(split_rows(minibatch, [d.speed for d in devices]))


def place_state(
    state: Mapping[str, torch.Tensor],
    vws: Sequence[RunVW],
    device_hosts: Mapping[str, str],
    shards: Mapping[int, str],
) -> dict[str, int]:
    """Each state tensor's shard: the planner's rule (a stage's layers on a shard of its
    host where there is one, shards balanced by bytes), applied to the job's real tensors."""
    if not state:  # nothing for the shards: a model of parameter-free layers
        return {}
    n_layers = 1 + max(_layer(n) for n in state)
    layer_bytes = [0] * n_layers
    for n, t in state.items():
        layer_bytes[_layer(n)] += t.numel() * t.element_size()
    shard_list = [SimpleNamespace(index=i, host=_host_of(a)) for i, a in sorted(shards.items())]
    stages = [
        [(normal_host(device_hosts[s.device]), (s.first, s.last)) for s in vw.stages] for vw in vws
    ]
    layer_shards, _ = place_stages(shard_list, stages, layer_bytes)
    return {n: layer_shards[_layer(n)] for n in state}


def plan_job(
    spec: JobSpec,
    job_id: str,
    cluster: ClusterConfig,
    workers: Mapping[str, Any],
    shards: Mapping[int, str],
    *,
    vws: Sequence[VWSpec] | None = None,
    predicted: dict[str, Any] | None = None,
) -> JobPlan:
    """Check the job against the cluster and live workers and lay out its run.

    ``vws`` is the split to run when the job gives none (the planner's); ``predicted`` the
    planner's figures, kept to report them next to the measured ones.
    """
    try:
        torch.manual_seed(spec.seed)
        model = build_model(spec.model.name, spec.model.args)
    except ModelError as exc:
        raise JobPlanError(f"model: {exc}") from None
    n_layers = len(model)
    try:
        layout = StateLayout.of(model)
    except LayoutError as exc:
        raise JobPlanError(f"model: {exc}") from None
    try:
        dataset = load_dataset(spec.data.name, spec.data.args)
    except ValueError as exc:
        raise JobPlanError(f"data: {exc}") from None
    split = tuple(vws) if vws is not None else spec.vws
    if not split:
        raise JobPlanError("the job gives no [[vw]] split and no plan was made for it")
    missing = [i for i in range(len(cluster.ps)) if i not in shards]
    if missing:
        raise JobPlanError(
            f"shard {missing[0]} has not registered with the head: "
            f"is hetpipe-ps --shard {missing[0]} running?"
        )
    run_vws = []
    for v, vwspec in enumerate(split):
        for d in vwspec.all_devices():
            try:
                cluster.device(d)
            except ConfigError:
                raise JobPlanError(
                    f"vw[{v}].devices: {d!r} is not a device of {cluster.path}"
                ) from None
            w = workers.get(d)
            if w is None:
                raise JobPlanError(
                    f"vw[{v}].devices: no live hetpipe-worker for {d} "
                    f"(start it, or run `hetpipe up`)"
                )
            if w.job is not None:
                raise JobPlanError(f"vw[{v}].devices: {d} is busy with job {w.job}")
        layers = vwspec.layers
        if layers is None:
            raise JobPlanError(f"vw[{v}].layers: missing (the split of the {n_layers} layers)")
        if sum(layers) != n_layers:
            raise JobPlanError(
                f"vw[{v}].layers: {list(layers)} sums to {sum(layers)}, "
                f"the model has {n_layers} layers"
            )
        bounds = [0]
        for n in layers:
            bounds.append(bounds[-1] + n)
        every = tuple(tuple(range(a, b)) for a, b in itertools.pairwise(bounds))
        none = ((),) * len(layers)
        # the planner's choice where it made one, else as train.activations pins it (keep;
        # "auto" without a plan has no choice to apply)
        chosen = vwspec.recompute is not None or vwspec.swap is not None
        recompute = (
            vwspec.recompute
            if vwspec.recompute is not None
            else (every if spec.activations == "recompute" and not chosen else none)
        )
        swap = (
            vwspec.swap
            if vwspec.swap is not None
            else (every if spec.activations == "swap" and not chosen else none)
        )
        nm = vwspec.nm or spec.nm or len(vwspec.devices)
        limits = vwspec.in_flight or (0,) * len(vwspec.devices)
        stages = tuple(
            RunStage(
                d,
                bounds[i],
                bounds[i + 1],
                tuple(recompute[i]),
                tuple(swap[i]),
                *_replicas(
                    cluster,
                    layout,
                    vwspec,
                    i,
                    spec.minibatch,
                    (bounds[i], bounds[i + 1]),
                    f"vw[{v}].devices[{i}]",
                ),
                limit=limit,
                fill=fill,
            )
            for i, (d, limit, fill) in enumerate(
                zip(vwspec.devices, limits, fill_counts(limits, nm), strict=True)
            )
        )
        try:
            layout.check_split(
                [(st.first, st.last) for st in stages],
                [f"vw{v}/stage{i} ({st.device})" for i, st in enumerate(stages)],
            )
        except LayoutError as exc:
            raise JobPlanError(f"vw[{v}].layers: {exc}") from None
        run_vws.append(RunVW(stages=stages, nm=nm))
    stream = MinibatchStream(dataset, spec.minibatch, spec.seed, 0, len(run_vws))
    if stream.per_epoch < 1:
        raise JobPlanError(
            f"train.minibatch: {spec.minibatch} leaves no full minibatch per "
            f"virtual worker in {len(dataset.train_y)} training samples"
        )
    minibatches = spec.minibatches or (spec.epochs or 1) * stream.per_epoch
    if spec.sync and not spec.vws and len(run_vws) > 1:
        # planned synchronous virtual workers share train.nm microbatches per iteration, so
        # train.minibatches counts the job's; the runtime counts the first worker's
        total = spec.minibatches or (spec.epochs or 1) * stream.per_epoch * len(run_vws)
        minibatches = -(-total // sum(v.nm for v in run_vws)) * run_vws[0].nm
    everything = model.state_dict()
    state = {n: everything[n].detach().clone() for n in layout.shared}
    buffers = dict(model.named_buffers())
    local = {n: buffers[n].detach().clone() for n in layout.local}
    hosts = {d.name: d.host for d in cluster.devices}
    placement = place_state(state, run_vws, hosts, shards)
    state_bytes = {
        f"{v}/{s}": sum(
            state[n].numel() * state[n].element_size()
            for n in state
            if st.first <= _layer(n) < st.last
        )
        for v, vw in enumerate(run_vws)
        for s, st in enumerate(vw.stages)
    }
    return JobPlan(
        job=job_id,
        spec=spec,
        vws=tuple(run_vws),
        minibatches=minibatches,
        placement=placement,
        initial=state,
        dataset=dataset,
        predicted={**(predicted or {}), "state_bytes": state_bytes},
        layout=layout,
        local=local,
    )
