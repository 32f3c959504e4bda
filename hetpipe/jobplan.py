"""From a submitted job to what the runtime executes: stages, placement, initial weights.

The head calls :func:`plan_job` once per job. It checks the job against the cluster and the
live workers (one line per problem, naming the device or key), builds the model once on the
CPU from the job's seed so that every virtual worker starts from the same weights, places
each stage's state on a parameter-server shard, and produces the stage tasks.

Only the tensors :mod:`hetpipe.modelstate` calls *shared* go to the shards (one entry per tied
tensor, frozen parameters included); non-persistent buffers go to their stages with the
assignment; the export restores the names of tied tensors. A tie whose names fall in several
stages lives on the shard of its canonical name's layer; every stage that uses it holds a copy,
pulls it from that one entry, and learns which other stages of its virtual worker hold one
(``StageTask.ties``: the runtime keeps the copies equal, :mod:`hetpipe.pipeline`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import torch

from hetpipe import metrics
from hetpipe.capture import user_state
from hetpipe.config import ClusterConfig
from hetpipe.core.layout import SplitError, StageLayout, VWLayout, VWSpec, validate
from hetpipe.core.schedule import DEVICE_KINDS, fill_counts
from hetpipe.core.units import format_size
from hetpipe.daemon import normal_host
from hetpipe.data import DataSource, MinibatchStream, evaluate, load_data, recalibrate_bn
from hetpipe.data.evaluate import val_batches
from hetpipe.job import JobSpec
from hetpipe.jobcheck import JobFacts
from hetpipe.models import ModelError, build_model, model_loss
from hetpipe.modelstate import LayoutError, StateLayout, layer_of
from hetpipe.planner import place_layers
from hetpipe.replicas import check_group, split_rows
from hetpipe.task import StageTask

__all__ = [
    "JobPlan",
    "JobPlanError",
    "chunk_devices",
    "data_shares",
    "device_memory_problem",
    "one_stage_per_device",
    "plan_job",
    "requested_layouts",
    "runs_several_stages",
    "several_stage_summary",
]


class JobPlanError(ValueError):
    """The job cannot run on this cluster now; the text says why."""


def runs_several_stages(spec: JobSpec) -> bool:
    """Whether a device of the job's own split runs several stages (its name repeats)."""
    return any(len(set(v.devices)) < v.k for v in spec.vws)


def chunk_devices(spec: JobSpec) -> int | None:
    """The device count D a several-stage job's device-level schedule runs on: the distinct
    devices of its virtual workers, what its stages' orders are projected from
    (:func:`hetpipe.core.devschedule.stage_order`) and so what its memory is priced with.
    None where no device repeats, or where the virtual workers' counts differ (each is then
    priced with two stages a device)."""
    counts = {len(set(v.devices)) for v in spec.vws if len(set(v.devices)) < v.k}
    return counts.pop() if len(counts) == 1 else None


def one_stage_per_device(
    spec: JobSpec, cluster: ClusterConfig
) -> tuple[JobSpec, ClusterConfig, dict[str, str]]:
    """The job with each repeated device's later stages on a clone of that device
    (``a#1``, ``a#2``: its type, memory and speed, on its node), the cluster with the
    clones, and each device's name -> the device it stands for: what the planner, which plans
    one stage per device, prices stage by stage (its times as if each stage had the device to
    itself; its memory per stage as it is)."""
    home: dict[str, str] = {}
    vws = []
    for vw in spec.vws:
        names = []
        for d in vw.devices:
            name = d if d not in home else f"{d}#{sum(h == d for h in home.values())}"
            home[name] = d
            names.append(name)
        vws.append(dataclasses.replace(vw, devices=tuple(names)))
    clones: dict[str, list[Any]] = {}
    for name, d in home.items():
        if name != d:
            clones.setdefault(d, []).append(dataclasses.replace(cluster.device(d), name=name))
    nodes = tuple(
        dataclasses.replace(
            node,
            devices=(*node.devices, *(c for d in node.devices for c in clones.get(d.name, ()))),
        )
        for node in cluster.nodes
    )
    several = dataclasses.replace(spec, vws=tuple(vws), several_stages=False)
    return several, dataclasses.replace(cluster, nodes=nodes), home


def device_memory_problem(
    stages: Sequence[tuple[str, str, int]], home: Mapping[str, str], cluster: ClusterConfig
) -> str | None:
    """The first device whose stages' predicted peaks (``(where, device, bytes)`` each, the
    device as :func:`one_stage_per_device` named it) add up past its memory cap, as one line
    naming the device and the figures; None where every device holds its stages."""
    per: dict[str, list[tuple[str, int]]] = {}
    for where, device, need in stages:
        per.setdefault(home.get(device, device), []).append((where, need))
    for device, held in per.items():
        cap = cluster.device(device).memory
        total = sum(n for _, n in held)
        if len(held) > 1 and total > cap:
            parts = ", ".join(f"{w} {format_size(n)}" for w, n in held)
            return (
                f"device {device}: its {len(held)} stages need {format_size(total)} together "
                f"> memory cap {format_size(cap)} (predicted peaks: {parts})"
            )
    return None


def several_stage_summary(predicted: Mapping[str, Any], home: Mapping[str, str]) -> dict[str, Any]:
    """The planner's figures for a several-stage job's split as priced one stage a device
    (:func:`one_stage_per_device`), each stage on the device it runs on (``home``): its
    memory per stage is the job's (each stage holds what its projected order holds); its
    times are each stage's with the device to itself, which a warning says."""
    vws = [
        {
            **vw,
            "stages": [
                {**st, "device": home.get(st["device"], st["device"])} for st in vw["stages"]
            ],
        }
        for vw in predicted.get("vws", ())
    ]
    warning = (
        "several stages a device: predicted times are each stage's with its device to "
        "itself (the planner prices one stage a device); predicted memory is per stage"
    )
    return {**predicted, "vws": vws, "warnings": [*predicted.get("warnings", ()), warning]}


def data_shares(sync: bool, nms: list[int]) -> list[int]:
    """Each virtual worker's share of an epoch's minibatches (``shares`` of
    :class:`hetpipe.data.MinibatchStream`): synchronous VWs of different M run M each an
    iteration, so each takes its M of every block of the epoch's minibatches; VWs that run
    the same amounts deal them in turn (empty: equal shares)."""
    return list(nms) if sync and len(set(nms)) > 1 else []


@dataclass
class JobPlan:
    """Everything the head needs to launch, follow and finish one job."""

    job: str
    spec: JobSpec
    vws: tuple[VWLayout, ...]
    minibatches: int  # per virtual worker
    placement: dict[str, int]  # global state name -> shard
    initial: dict[str, torch.Tensor] | None
    dataset: DataSource  # its validation set only: the head reads no training samples
    predicted: dict[str, Any] = field(default_factory=dict)
    layout: StateLayout | None = None  # None: the plain state_dict, nothing tied or local
    local: dict[str, torch.Tensor] = field(default_factory=dict)  # non-persistent buffers
    # a resumed attempt: each VW's data position (minibatches done before it), and (async)
    # the minibatches each VW still owes, which differ where VWs stopped at other positions
    starts: tuple[int, ...] = ()
    owed: tuple[int, ...] = ()
    # each VW's own wave 0 on the shards' count of waves: past 0 for a VW re-formed after a
    # lost worker, and for one left out the wave past every push it made (hetpipe.head.reform)
    bases: tuple[int, ...] = ()

    @property
    def n_stages(self) -> int:
        return sum(len(v.stages) for v in self.vws)

    def where(self, vw: int, stage: int) -> str:
        return f"vw{vw}/stage{stage} ({self.device_of(vw, stage)})"

    def device_of(self, vw: int, stage: int) -> str:
        return self.vws[vw].stages[stage].device

    def stage_names(self, vw: int, stage: int) -> list[str]:
        """The shared state names the stage holds: those of its layers, and the canonical
        name of every tie one of its layers uses (a copy, where the tie spans stages)."""
        st = self.vws[vw].stages[stage]
        if self.layout is None:
            return [n for n in self.placement if st.first <= _layer(n) < st.last]
        return [n for n in self.placement if self.layout.holds(n, st.first, st.last)]

    def ties(self, vw: int) -> dict[str, list[int]]:
        """The ties of virtual worker ``vw`` that span stages: canonical name -> the stages
        holding a copy, the owner (the stage of the canonical name's layer) first."""
        if self.layout is None:
            return {}
        return self.layout.spanning([st.layers for st in self.vws[vw].stages])

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

    def base_of(self, vw: int) -> int:
        """The shards' wave of virtual worker ``vw``'s own wave 0 in this attempt."""
        return self.bases[vw] if self.bases else 0

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
        """The stage assignments: each stage's layout with its neighbours' and the data
        and shard addresses."""
        out = []
        spec = self.spec.to_dict()

        def peers(st: StageLayout | None) -> list[str]:
            return [] if st is None else [workers[d].address for d in st.devices]

        for v, vw in enumerate(self.vws):
            k = vw.k
            ties = self.ties(v)
            for s, st in enumerate(vw.stages):
                names = self.stage_names(v, s)
                prev = vw.stages[s - 1] if s > 0 else None
                nxt = vw.stages[s + 1] if s < k - 1 else None
                for r in range(len(st.devices)):
                    out.append(
                        StageTask(
                            job=self.job,
                            spec=spec,
                            vw=v,
                            stage=s,
                            k=k,
                            nm=vw.nm,
                            staleness=self.spec.staleness,
                            minibatches=self.minibatches_of(v),
                            num_vws=len(self.vws),
                            layout=st,
                            shards={
                                str(self.placement[n]): shards[self.placement[n]] for n in names
                            },
                            placement={n: self.placement[n] for n in names},
                            start=self.start_of(v),
                            wave_base=self.base_of(v),
                            shares=data_shares(self.spec.sync, [w.nm for w in self.vws]),
                            replica=r,
                            peers=peers(st),
                            prev=prev,
                            prev_peers=peers(prev),
                            next=nxt,
                            next_peers=peers(nxt),
                            ties=ties,
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
        ties hold one value and its ``state_dict()`` lists every name, as torch's does. Built
        from the job's seed, so a captured model's tensors that forward never uses (and so
        never train) hold their initial values.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.spec.seed)
            model = build_model(self.spec.model)
        if self.layout is not None:
            state = self.layout.with_aliases(state)
        model.load_state_dict(state, strict=True)
        return model

    def evaluate(self, state: dict[str, torch.Tensor]) -> float | None:
        """Test accuracy of global weights ``state`` (batch-norm statistics re-estimated
        first where the job asks, ``train.bn_recalibrate``)."""
        model = self.model_of(state)
        self._recalibrate(model)
        return evaluate(model, self.dataset)

    def validate(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        """The validation figures of global weights ``state``: ``val_loss`` and each metric
        of ``train.metrics`` (:mod:`hetpipe.metrics`); empty without a validation set."""
        model = self.model_of(state)
        self._recalibrate(model)
        return self.figures(model)

    def figures(self, model: torch.nn.Module) -> dict[str, float]:
        """``val_loss`` and ``train.metrics`` of ``model`` over the validation set, in the
        job's validation minibatches (:data:`hetpipe.data.evaluate.VAL_BATCH` rows), scored
        with the job's loss."""
        if self.dataset.val is None:
            return {}
        return metrics.evaluate(
            model,
            val_batches(self.dataset),
            model_loss(self.spec.model),
            metrics.resolve(self.spec.metrics),
        )

    def export(self, state: dict[str, torch.Tensor], out_dir: Path) -> tuple[float, float | None]:
        """Write the global weights as one state_dict; return their test accuracy, and (where
        batch-norm statistics were re-estimated before the export) the accuracy with the
        statistics as trained, for comparison (:meth:`export_figures` for every figure)."""
        figures, before = self.export_figures(state, out_dir)
        return figures.get("accuracy"), before  # type: ignore[return-value]

    def export_figures(
        self, state: dict[str, torch.Tensor], out_dir: Path, name: str = "model.pt"
    ) -> tuple[dict[str, float], float | None]:
        """Write the global weights as one state_dict ``out_dir/name``; return their
        validation figures (:meth:`figures`), and (where batch-norm statistics were
        re-estimated before the export) the accuracy with the statistics as trained.

        A captured model's state dict is keyed as the user's own module (ties as it has
        them), so it loads with ``strict=True`` into the module the factory returns."""
        model = self.model_of(state)
        before = None
        if self.spec.bn_recalibrate and any(
            isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()
        ):
            before = evaluate(model, self.dataset)
            self._recalibrate(model)
        self.save(model, out_dir, name)
        return self.figures(model), before

    def save(self, model: torch.nn.Module, out_dir: Path, name: str) -> None:
        """``model``'s state dict as the user's module keys it, written atomically."""
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".{name}.tmp"
        torch.save(user_state(model, model.state_dict()), tmp)
        tmp.replace(out_dir / name)

    def save_state(self, state: dict[str, torch.Tensor], out_dir: Path, name: str) -> None:
        """Global weights ``state`` as a state dict file ``out_dir/name`` (``model_best.pt``),
        batch-norm statistics re-estimated first where the job asks."""
        model = self.model_of(state)
        self._recalibrate(model)
        self.save(model, out_dir, name)

    def _recalibrate(self, model: torch.nn.Module) -> None:
        """Re-estimate batch-norm statistics over ``train.bn_recalibrate`` minibatches of the
        training set (VW 0's order), with the global weights: the one time the head reads
        training samples (those minibatches only), where the job asks for it."""
        if self.spec.bn_recalibrate:
            d = self.spec.data
            source = load_data(d.name, d.args, d.collate)
            stream = MinibatchStream(source, self.spec.minibatch, self.spec.seed)
            recalibrate_bn(model, stream, self.spec.bn_recalibrate)


_layer = layer_of


def _host_of(address: str) -> str:
    return normal_host(urlparse(address).hostname or "")


def _rows(
    cluster: ClusterConfig, layout: StateLayout, st: StageLayout, minibatch: int, key: str
) -> tuple[int, ...]:
    """A replicated stage's row split (in proportion to the devices' speeds), () for a
    stage on one device; a replicated stage holding running statistics (batch norm) is
    refused: each replica would keep its own, and they would drift apart."""
    if not st.replicas:
        return ()
    devices = [cluster.device(d) for d in st.devices]
    try:
        check_group(cluster, devices, minibatch)
    except ValueError as exc:
        raise JobPlanError(f"{key}: {exc}") from None
    stats = [n for n in layout.buffers if st.holds(_layer(n))]
    if stats:
        raise JobPlanError(
            f"{key}: a replicated stage may not hold running statistics "
            f"({stats[0]}: batch norm would keep one per replica)"
        )
    return tuple(split_rows(minibatch, [d.speed for d in devices]))


def place_state(
    state: Mapping[str, torch.Tensor],
    vws: Sequence[VWLayout],
    device_hosts: Mapping[str, str],
    shards: Mapping[int, str],
    placement: str = "local",
) -> dict[str, int]:
    """Each state tensor's shard: the planner's rule for ``placement`` (``train.placement``;
    local: a stage's layers on a shard of its host where there is one, shards balanced by
    bytes; default: layer j on shard j mod S), applied to the job's real tensors.

    The layers are counted from the stages, not from the state's names: layers without state
    of their own (an activation, a head whose only weight is tied to an earlier layer's)
    hold none, and may end the model."""
    if not state:  # nothing for the shards: a model of parameter-free layers
        return {}
    n_layers = max(
        1 + max(_layer(n) for n in state),
        max((st.last for vw in vws for st in vw.stages), default=0),
    )
    layer_bytes = [0] * n_layers
    for n, t in state.items():
        layer_bytes[_layer(n)] += t.numel() * t.element_size()
    shard_list = [SimpleNamespace(index=i, host=_host_of(a)) for i, a in sorted(shards.items())]
    stages = [[(normal_host(device_hosts[s.device]), s.layers) for s in vw.stages] for vw in vws]
    layer_shards = place_layers(placement, shard_list, stages, layer_bytes)
    return {n: layer_shards[_layer(n)] for n in state}


def requested_layouts(
    spec: JobSpec, *, policies: Sequence[VWLayout] | None = None
) -> tuple[VWLayout, ...]:
    """The job's own ``[[vw]]`` split as layouts: Nm as the job gives it, and each layer's
    activations as ``train.activations`` pins them, or as ``policies`` (the planner's
    layouts of this same split) choose where given."""
    out = []
    for v, vw in enumerate(spec.vws):
        if vw.layers is None:
            raise JobPlanError(f"vw[{v}].layers: missing (the split is the planner's to make)")
        nm = spec.nm or vw.k
        if policies is not None:
            chosen = policies[v].stages
            layout = vw.layout(
                nm, recompute=[s.recompute for s in chosen], swap=[s.swap for s in chosen]
            )
        else:
            layout = vw.layout(nm).pinned(spec.activations)
        out.append(layout)
    return tuple(out)


def plan_job(
    spec: JobSpec,
    job_id: str,
    cluster: ClusterConfig,
    workers: Mapping[str, Any],
    shards: Mapping[int, str],
    *,
    vws: Sequence[VWLayout] | None = None,
    predicted: dict[str, Any] | None = None,
    facts: JobFacts | None = None,
) -> JobPlan:
    """Check the job against the cluster and live workers and lay out its run.

    ``vws`` is the layout to run (the planner's, or the job's own split with the planner's
    activation policies); without it the job's own ``[[vw]]`` split runs as it pins it.
    ``predicted`` holds the planner's figures, kept to report them next to the measured ones.
    ``facts``: what the job check built (the model from the job's seed and the data set),
    taken instead of building them again.
    """
    if facts is not None:
        model, dataset, n_train = facts.model, facts.data, facts.n_train
    else:
        try:
            torch.manual_seed(spec.seed)
            model = build_model(spec.model)
        except ModelError as exc:
            raise JobPlanError(f"model: {exc}") from None
        try:
            source = load_data(spec.data.name, spec.data.args, spec.data.collate)
        except ValueError as exc:
            raise JobPlanError(f"data: {exc}") from None
        dataset, n_train = source.without_train(), source.train_len()
    n_layers = len(model)
    try:
        layout = StateLayout.of(model)
    except LayoutError as exc:
        raise JobPlanError(f"model: {exc}") from None
    if vws is None and not spec.vws:
        raise JobPlanError("the job gives no [[vw]] split and no plan was made for it")
    split = tuple(vws) if vws is not None else requested_layouts(spec)
    missing = [i for i in range(len(cluster.ps)) if i not in shards]
    if missing:
        raise JobPlanError(
            f"shard {missing[0]} has not registered with the head: "
            f"is hetpipe-ps --shard {missing[0]} running?"
        )
    try:
        validate(
            split,
            {d.name for d in cluster.devices},
            n_layers,
            known_as=str(cluster.path),
            several=spec.several_stages,
        )
    except SplitError as exc:
        raise JobPlanError(str(exc)) from None
    run_vws = []
    for v, vw in enumerate(split):
        for d in vw.all_devices():
            w = workers.get(d)
            if w is None:
                raise JobPlanError(
                    f"vw[{v}].devices: no live hetpipe-worker for {d} "
                    f"(start it, or run `hetpipe up`)"
                )
            if w.job is not None:
                raise JobPlanError(f"vw[{v}].devices: {d} is busy with job {w.job}")
        limits = [st.in_flight_limit for st in vw.stages]
        vw = vw.with_stages(
            rows=[
                _rows(cluster, layout, st, spec.minibatch, f"vw[{v}].devices[{i}]")
                for i, st in enumerate(vw.stages)
            ],
            in_flight_fill=fill_counts(limits, vw.nm),
        )
        spans = layout.spanning([st.layers for st in vw.stages])
        holders = [s for stages in spans.values() for s in stages]
        if holders and any(st.replicas for st in vw.stages[min(holders) : max(holders) + 1]):
            # a tie's copies are kept equal along the pipeline's links, one device a stage
            try:
                layout.check_split(
                    [st.layers for st in vw.stages],
                    [f"vw{v}/stage{i} ({st.device})" for i, st in enumerate(vw.stages)],
                )
            except LayoutError as exc:
                raise JobPlanError(
                    f"vw[{v}].layers: {exc} (a replicated stage holds no copy of a tie)"
                ) from None
        run_vws.append(vw)
    # the first VW's minibatches per epoch, as the streams deal them (hetpipe.data.stream)
    shares = data_shares(spec.sync, [vw.nm for vw in run_vws]) or [1] * len(run_vws)
    blocks = (n_train // spec.minibatch) // sum(shares) if n_train is not None else 0
    per_epoch = blocks * shares[0]
    if n_train is not None and per_epoch < 1:
        raise JobPlanError(
            f"train.minibatch: {spec.minibatch} leaves no full minibatch per "
            f"virtual worker in {n_train} training samples"
        )
    if n_train is None and not spec.minibatches:
        raise JobPlanError(
            "train.minibatches: the data set is a stream of unknown length; give its number"
        )
    minibatches = spec.minibatches or (spec.epochs or 1) * per_epoch
    if spec.sync and not spec.vws and len(run_vws) > 1:
        # planned synchronous virtual workers share train.nm microbatches per iteration, so
        # train.minibatches counts the job's; the runtime counts the first worker's
        total = spec.minibatches or (spec.epochs or 1) * blocks * sum(shares)
        minibatches = -(-total // sum(v.nm for v in run_vws)) * run_vws[0].nm
    everything = model.state_dict()
    state = {n: everything[n].detach().clone() for n in layout.shared}
    buffers = dict(model.named_buffers())
    local = {n: buffers[n].detach().clone() for n in layout.local}
    hosts = {d.name: d.host for d in cluster.devices}
    placement = place_state(state, run_vws, hosts, shards, spec.placement)
    state_bytes = {
        f"{v}/{s}": sum(
            state[n].numel() * state[n].element_size()
            for n in state
            if layout.holds(n, st.first, st.last)
        )
        for v, vw in enumerate(run_vws)
        for s, st in enumerate(vw.stages)
    }
    if spec.schedule in DEVICE_KINDS and not spec.vws:
        # the planner chose a device-level kind: its split is the job's own, which the
        # stages read their device's order from (hetpipe.devturn, the stage's schedule)
        spec = dataclasses.replace(
            spec,
            vws=tuple(
                VWSpec(
                    tuple(st.device for st in vw.stages),
                    tuple(st.n_layers for st in vw.stages),
                    vw.nm,
                )
                for vw in run_vws
            ),
        )
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
