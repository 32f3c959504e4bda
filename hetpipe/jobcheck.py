"""Every check of a job that needs only the job file and the cluster file.

The CLI runs these before it sends a job anywhere, so that code the cluster does not
allow (:mod:`hetpipe.security`, checked first), the user's module missing or differing from
the copy submitted (:mod:`hetpipe.usercode`), a wrong layer split, an unknown device, a
model or data set that cannot be built, or a fault naming a stage that does not exist is
refused at once with one line ``"<file>: <key>: <problem>"`` instead of after a round trip
to the head. The head runs the same function on what it receives (a client need not be
this CLI), so the rule has one home. What needs the live cluster (workers up and idle,
shards registered) stays in :mod:`hetpipe.jobplan`; what needs only the job's own keys (types,
ranges, choices, and a key set where it has no effect) is declared in
:mod:`hetpipe.core.keys` and checked when the job is loaded (:func:`hetpipe.job.load_job`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hetpipe.config import ClusterConfig
from hetpipe.core.devschedule import last_iteration_problem
from hetpipe.core.layout import SplitError, validate
from hetpipe.core.schedule import DEVICE_KINDS
from hetpipe.data import DataError, DataSource, load_data
from hetpipe.data.check import check_fit
from hetpipe.job import JobError, JobSpec
from hetpipe.models import ModelError, build_model, model_loss
from hetpipe.replicas import check_group
from hetpipe.security import CodeError, check_code
from hetpipe.usercode import UserCodeError, check_user_code

__all__ = ["JobFacts", "check_job"]

# ModelError texts that are about the name (the rest are about the arguments)
_NAME_PROBLEMS = (
    "unknown;",
    "expected 'package",
    "cannot import",
    "has no",
    "not callable",
    "model name",
)


@dataclass(frozen=True)
class JobFacts:
    """What the checks learnt and built, for callers that would otherwise do it again: the
    head plans and lays out the job from this model (built from the job's seed: its initial
    weights), so it builds it once per job. Of the data set only the validation set is kept
    (``data``, for the head's accuracy) and the training set's size: the head never reads
    training samples beyond the one the check feeds the model."""

    layers: int  # the model's number of layers
    per_epoch: int  # minibatches per virtual worker and epoch
    model: torch.nn.Sequential
    data: DataSource  # its validation set only
    n_train: int | None  # training samples; None for a stream of unknown length
    # module -> sha256 of the source of each user module the job names, as imported here
    code: dict[str, str] = field(default_factory=dict)


def check_job(
    spec: JobSpec, cluster: ClusterConfig, source: str, *, host: str | None = None
) -> JobFacts:
    """Raise :class:`JobError` (one line naming ``source`` and the key) on any problem.

    The job's own modules are made current on this host first, and compared with the hashes
    it carries (:func:`hetpipe.usercode.check_user_code`); ``host`` names this process in
    what that says (``"head"``)."""

    def fail(key: str, problem: str) -> JobError:
        return JobError(" ".join(f"{source}: {key}: {problem}".split()))

    try:  # first the code policy: nothing below may import a module it does not allow
        check_code(spec, cluster.security.allowed_modules)
    except CodeError as exc:
        raise JobError(f"{source}: {str(exc).removeprefix('job: ')}") from None
    try:  # then the user's own modules: this host's copy, current, as submitted
        code = check_user_code(spec, host)
    except UserCodeError as exc:
        raise fail(exc.key, str(exc)) from None
    try:
        torch.manual_seed(spec.seed)
        model = build_model(spec.model)
        n_layers = len(model)
    except ModelError as exc:
        key = exc.key or (
            "model.name" if any(w in str(exc) for w in _NAME_PROBLEMS) else "model.args"
        )
        raise fail(key, str(exc)) from None
    try:
        loss = model_loss(spec.model)
    except ModelError as exc:
        raise fail(exc.key or "model.loss", str(exc)) from None
    try:  # the data set object (not its samples), and one sample through the model
        data = load_data(spec.data.name, spec.data.args, spec.data.collate)
        check_fit(data, model, loss)
    except DataError as exc:
        raise fail(exc.key, str(exc)) from None
    except ModelError as exc:
        raise fail("model.name", str(exc)) from None
    n_train = data.train_len()

    devices = {d.name for d in cluster.devices}
    if spec.num_vws is not None and spec.num_vws > len(devices):
        raise fail(
            "train.vws",
            f"{spec.num_vws} virtual workers need at least as many "
            f"devices; {cluster.path} has {len(devices)}",
        )
    try:
        validate(
            spec.vws, devices, n_layers, known_as=str(cluster.path), several=spec.several_stages
        )
    except SplitError as exc:
        raise fail(exc.key, exc.problem) from None
    for v, vw in enumerate(spec.vws):
        for i in range(vw.k):
            try:
                check_group(cluster, [cluster.device(d) for d in vw.group(i)], spec.minibatch)
            except ValueError as exc:
                raise fail(f"vw[{v}].devices[{i}]", str(exc)) from None

    num_vws = len(spec.vws) or spec.num_vws
    if n_train is None and not spec.minibatches:
        raise fail(
            "train.minibatches",
            f"data '{spec.data.name}' is a stream of unknown length (an IterableDataset "
            f"without __len__): give train.minibatches, epochs cannot be counted",
        )
    per_epoch = ((n_train or 0) // spec.minibatch) // (num_vws or 1)
    if n_train is None:
        per_epoch = spec.minibatches or 1
    elif per_epoch < 1:
        raise fail(
            "train.minibatch",
            f"{spec.minibatch} leaves no full minibatch per virtual "
            f"worker in {n_train} training samples",
        )
    total = spec.minibatches or (spec.epochs or 1) * per_epoch
    if spec.schedule in DEVICE_KINDS and spec.vws and not spec.minibatches:
        # epochs: the run's length is known only now (the job file checked train.minibatches)
        m = spec.vws[0].nm or spec.nm
        problem = m and last_iteration_problem(
            spec.schedule, len(set(spec.vws[0].devices)), total, m
        )
        if problem:
            raise fail("train.epochs", problem)

    for f, fault in enumerate(spec.faults):
        if num_vws is not None and fault.vw >= num_vws:
            raise fail(
                f"fault[{f}].vw",
                f"{fault.vw}: the job has {num_vws} virtual workers (0..{num_vws - 1})",
            )
        stages = len(spec.vws[fault.vw].devices) if spec.vws else min(n_layers, len(devices))
        if fault.stage >= stages:
            raise fail(
                f"fault[{f}].stage",
                f"{fault.stage}: vw {fault.vw} has {stages} stages (0..{stages - 1})",
            )
        if fault.minibatch >= total:
            raise fail(
                f"fault[{f}].minibatch",
                f"{fault.minibatch}: each virtual worker "
                f"trains {total} minibatches (0..{total - 1})",
            )
    for slow in spec.slowdowns:  # [[fault]] kind = "slow" (named by key: kept apart from stalls)
        if slow.device not in devices:
            raise fail("fault.device", f"no device {slow.device!r} in {cluster.path}")
        if slow.at_minibatch >= total:
            raise fail(
                "fault.at_minibatch",
                f"{slow.at_minibatch}: each virtual worker "
                f"trains {total} minibatches (0..{total - 1})",
            )
    return JobFacts(n_layers, per_epoch, model, data.without_train(), n_train, code)
