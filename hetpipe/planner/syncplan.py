"""Planning synchronous pipelines (gpipe, 1f1b): partition, device mapping and microbatch
order chosen together to minimise the predicted time of one iteration.

A synchronous iteration is a flush: M microbatches go forward and back through the stages in
a fixed per-stage order (:func:`hetpipe.core.schedule.microbatch_order`), then every stage steps
its optimizer once. Its time is not the bottleneck stage's alone: with few microbatches the
fill and drain (every stage's forward and backward once, every link crossed twice) weigh as
much as the slowest stage's M - 1 further microbatches, so a fast pipeline may use fewer,
faster devices, and the device *mapping* matters through the actual link between each pair
of consecutive devices (an arbitrary bandwidth matrix: ``[[network.link]]`` overrides and
the intra/inter-node defaults).

Search (:func:`plan_sync`):

1. cuts for a fixed mapping and order: a min-max dynamic program gives the least bottleneck
   B*; min-sum programs under caps B* x (1, 1.1, 1.25, 1.5, 2, 3, inf) trade the fill and
   drain against the bottleneck; each candidate is timed exactly by the simulator's rules
   (:func:`hetpipe.planner.simulate.iteration_time`),
   and the best is refined by moving single cuts while that helps;
2. mappings: for every pipeline length, the fastest devices chained along their fastest
   links (greedy from several starts, then 2-opt), then a local search over the mapping
   (swap two stages' devices, replace one by an unused device, drop one, add one), within a
   time budget;
3. orders: every candidate is timed with each allowed order (gpipe; 1f1b, and with
   ``warmup = "auto"`` 1f1b with each extra warm-up of :func:`warmup_ladder`, the orders
   between the two); the fastest is kept;
4. several virtual workers (:func:`search_formations`): groups of devices formed by the
   asynchronous planner's policies (:mod:`.formation`), each group's pipeline searched as
   above for every M it may get, the iteration's M shared out so that the slowest group is
   as fast as it can be (:func:`split_microbatches`), plus the gradient exchange through
   the shards (:meth:`SyncModel.exchange_s`). :func:`sync_plan` compares them with one
   virtual worker by the simulated iteration time.

5. two stages a device (:func:`hetpipe.planner.chunksearch.choose_chunks`): one searched
   virtual worker's devices priced again holding two stages each under ``interleaved-1f1b``
   and ``zbv``; where the job lets a device run several stages (``several_stages``) and the
   kind is left to the planner, the plan is the fastest such kind where it is predicted
   faster by more than :data:`~hetpipe.planner.chunksearch.MARGIN`, else it is suggested.

The costs are :mod:`.syncmodel`'s, the search (1, 2, 4) :mod:`.syncsearch`'s; this module
makes the plan the runtime executes (:func:`sync_plan`).

Every stage must fit its device's memory cap under the chosen kind (gpipe holds all M
microbatches' activations, 1f1b at most k - position; no weight stashing). :func:`exhaustive`
enumerates every mapping, partition and order, to check the search on small instances.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from hetpipe.core.layout import StageLayout, VWSpec
from hetpipe.core.profile import ModelProfile
from hetpipe.core.schedule import DEVICE_KINDS, SYNC_KINDS
from hetpipe.planner.runtime import RuntimeCosts
from hetpipe.planner.syncmodel import INF, SyncChoice, SyncModel, warmup_ladder
from hetpipe.planner.syncsearch import search_formations, search_sync

__all__ = ["sync_plan"]

PREDICT_ITERATIONS = 12  # iterations the final prediction simulates
RERANK = 5  # the fastest pipelines of the search ranked again with the hosts' sharing


# -- plans the runtime executes ----------------------------------------------------------------


def _explicit(
    model: SyncModel,
    given: Sequence[tuple[tuple[int, ...], tuple[tuple[int, int], ...] | None]],
    warnings: list[str],
) -> list[SyncChoice]:
    """The job's own virtual workers (devices, and cuts or None for the best ones), all in
    the one order of :attr:`SyncModel.orders` whose slowest virtual worker is fastest (the
    runtime runs one order per job). Given cuts over a memory cap are priced anyway, in the
    first order, with a warning per stage over its cap."""
    best: list[SyncChoice] | None = None
    for kind, warmup in model.orders:
        row = []
        for devs, cuts in given:
            if cuts is None:
                row.append(model.choice(devs, kind, warmup))
            else:
                row.append(
                    SyncChoice(devs, cuts, kind, model.evaluate(devs, cuts, kind, warmup), warmup)
                )
        if all(c is not None and c.iteration_s < INF for c in row) and (
            best is None
            or max(c.iteration_s for c in row)  # type: ignore[union-attr]
            < max(c.iteration_s for c in best)
        ):
            best = row  # type: ignore[assignment]
    if best is not None:
        return best
    from hetpipe.planner.plans import PlanError

    kind, warmup = model.orders[0]
    out = []
    for v, (devs, cuts) in enumerate(given):
        if cuts is None:
            c = model.choice(devs, kind, warmup)
            if c is None:
                names = [model.devices[i].name for i in devs]
                raise PlanError(f"vw {v}: the model fits on no split of {names}")
            out.append(c)
            continue
        for pos, (i, (a, b)) in enumerate(zip(devs, cuts, strict=True)):
            need = model.memory(i, a, b, pos, len(devs), kind, warmup=warmup).total
            if need > model.devices[i].memory:
                warnings.append(
                    f"vw {v}: {model.devices[i].name} needs {need} bytes, "
                    f"over its cap {model.devices[i].memory}"
                )
        out.append(SyncChoice(devs, cuts, kind, model.unchecked(devs, cuts, kind, warmup), warmup))
    return out


def sync_plan(
    cluster: Any,
    profile: ModelProfile,
    *,
    minibatch: int,
    m: int,
    optimizer_state_factor: int,
    kind: str | None = None,
    vws: Sequence[tuple[Sequence[str], Sequence[int] | None]] | None = None,
    num_vws: int | None = None,
    policy: str = "auto",
    costs: RuntimeCosts | None = None,
    budget_s: float = 5.0,
    warmup: int | None = 0,
    placement: str = "local",
    chunk_devices: int | None = None,
    several_stages: bool = False,
    minibatches: int | None = None,
) -> Any:
    """A :class:`~hetpipe.planner.plans.Plan` for a synchronous job of ``m`` microbatches per
    iteration: searched (``kind`` None picks gpipe or 1f1b), or priced for the given ``vws``
    (devices in order, layers per stage or None for the best cuts; each runs ``m``).
    ``warmup``: 1f1b's extra warm-up forwards (:func:`hetpipe.core.schedule.microbatch_order`);
    None: the planner picks the order from :func:`warmup_ladder` too. ``placement``: where
    the shards keep each layer's state (``train.placement``), as the plan reports it.
    ``chunk_devices``: a device-level kind's device count for a split whose devices run
    several stages (:class:`SyncModel`). ``several_stages`` (``train.several_stages`` of a
    job that leaves the schedule to the planner, ``kind`` None): where the searched plan is
    one virtual worker and its devices running two stages each under a device-level kind
    are predicted faster by more than :data:`~.chunksearch.MARGIN`, the plan is that kind's
    (:func:`~.chunksearch.choose_chunks`; ``minibatches``: the job's, so that its last
    iteration can run); else the kinds are priced beside it as a suggestion.

    Searched, one virtual worker or several (``num_vws``: exactly that many; None: whichever
    is predicted faster): several are formed by the asynchronous planner's policies
    (:mod:`.formation`: NP, ED, HD), each gets its own pipeline, and the iteration's ``m``
    microbatches are shared out so that the virtual workers end their parts together (the
    faster get more); the iteration then waits for the gradient exchange. The few fastest
    candidates on an idle host are ranked again with the hosts' sharing simulated."""
    from hetpipe.planner.costs import check_devices, check_profile
    from hetpipe.planner.formation import candidate_formations
    from hetpipe.planner.placement import place_plan
    from hetpipe.planner.plan import _at_minibatch, _cost_model, _power, _shard_hosts
    from hetpipe.planner.plans import Plan, PlanError, PlanInputs, StagePlan, VWPlan, check_split
    from hetpipe.planner.predict import predict

    if m < 1:
        raise PlanError(f"microbatches per iteration must be >= 1, got {m}")
    check_devices(tuple(cluster.devices), cluster.network.bytes_per_s)
    check_profile(profile)
    warnings: list[str] = []
    # a job whose device-level kind this planner chose, planned again (a resumed attempt):
    # its spec names the kind but no split, so the one-stage pipeline is searched as before
    # and its devices given two stages each under that kind, whatever the margin
    again = kind if kind in DEVICE_KINDS and not vws and chunk_devices is None else None
    if again:
        kind, num_vws, several_stages = None, 1, True
    profile = _at_minibatch(profile, minibatch, warnings)
    usable = [d for d in cluster.devices if d.type in profile.layers]
    if not usable:
        raise PlanError("no device has a profile")
    model = SyncModel(
        profile,
        usable,
        cluster.network.bytes_per_s,
        m,
        optimizer_state_factor,
        (costs or RuntimeCosts()).with_runtime(cluster),
        (kind,) if kind else SYNC_KINDS,
        (warmup,) if warmup is not None else warmup_ladder(m),
        shards=len(_shard_hosts(cluster)),
        chunk_devices=chunk_devices,
    )
    index = {d.name: i for i, d in enumerate(usable)}
    cm = _cost_model(
        cluster, profile, PlanInputs(minibatch, 0, optimizer_state_factor, costs=costs)
    )

    def _predict(vws: Sequence[SyncChoice], ms: Sequence[int]) -> tuple[float, Any]:
        """Iteration time with the runtime's costs, the gradient exchange and the sharing of
        each host's cores, simulated (the search ranks with the idle-host costs alone)."""
        parts = [
            (
                tuple(usable[i] for i in c.devices),
                cm.describe([usable[i] for i in c.devices], c.cuts, mv),
            )
            for c, mv in zip(vws, ms, strict=True)
        ]
        pred = predict(
            cm,
            parts,
            minibatch=minibatch,
            staleness=0,
            shard_hosts=_shard_hosts(cluster),
            minibatches=PREDICT_ITERATIONS * ms[0],
            schedule=vws[0].kind,
            warmup=vws[0].warmup,
            devices=chunk_devices,
        )
        # the ties' gradient sums along each pipeline's links (SyncModel.tie_exchange_s)
        ties = max(model.tie_exchange_s(c.devices, c.cuts) for c in vws)
        return max(*pred.sim.iteration_s, 1e-12) + ties, pred

    chosen: list[SyncChoice] = []
    ms: tuple[int, ...] = ()
    exchange = 0.0
    if vws:
        check_split(
            [VWSpec(tuple(n), tuple(x) if x is not None else None) for n, x in vws],
            {d.name for d in cluster.devices},
            profile.n_layers(),
        )
        given = []
        for v, (names, layers) in enumerate(vws):
            try:
                devs = tuple(index[n] for n in names)
            except KeyError as e:
                raise PlanError(f"vw {v}: no profile for device {e.args[0]!r}") from None
            cuts = (
                None
                if layers is None
                else tuple(itertools.pairwise(itertools.accumulate(layers, initial=0)))
            )
            given.append((devs, cuts))
        chosen = _explicit(model, given, warnings)
        ms = (m,) * len(chosen)
        exchange = (
            max(model.exchange_s(c.devices, c.cuts, len(chosen)) for c in chosen)
            if len(chosen) > 1
            else 0.0
        )
        how = "explicit"
    else:
        several = num_vws is None or num_vws > 1
        single = num_vws in (None, 1)
        cands: list[tuple[str, tuple[SyncChoice, ...], tuple[int, ...], float]] = []
        if single:
            found = search_sync(model, budget_s / 2 if several else budget_s)
            cands += [("sync", (c,), (m,), 0.0) for c in found[:RERANK]]
        if several:
            try:
                forms = candidate_formations(
                    usable, policy, num_vws if num_vws != 1 else None, _power(profile)
                )
            except ValueError as e:
                raise PlanError(str(e)) from None
            groups = [
                (f.policy, [tuple(index[d.name] for d in g) for g in f.groups]) for f in forms
            ]
            formed = search_formations(model, groups, budget_s / 2 if single else budget_s)
            cands += [(f.policy, f.vws, f.ms, f.exchange_s) for f in formed[:RERANK]]
        if not cands:
            if single:
                raise PlanError(
                    "the model fits on no pipeline of the usable devices under the "
                    "synchronous schedules' memory"
                )
            raise PlanError(
                f"no formation of {num_vws} synchronous virtual workers fits (each "
                f"needs a pipeline that fits and at least one of the {m} "
                f"microbatches per iteration)"
            )
        # the few fastest on an idle host, ranked again with the sharing of the hosts' cores
        how, best, ms, exchange = min(cands, key=lambda x: _predict(x[1], x[2])[0])
        chosen = list(best)
        if how != "sync":
            why = "predicted faster than one" if num_vws is None else "as asked (train.vws)"
            warnings.append(
                f"{len(chosen)} synchronous virtual workers ({how}), microbatches "
                f"per iteration {list(ms)}: {why}"
            )
    chunk_rows, choice = None, None
    if kind is None and several_stages and len(chosen) == 1 and not vws:
        # the planner may put two stages on each device: the device-level kind where it is
        # predicted faster by more than the margin
        from hetpipe.planner.chunksearch import choose_chunks

        chunk_rows, picked, choice = choose_chunks(
            model, chosen[0], budget_s / 4, total=minibatches, only=again
        )
        if again and picked is None:
            raise PlanError(f"{again}: its two stages a device no longer run here ({choice})")
        warnings.append(f"schedule chosen: {choice}")
        if picked is not None:
            # the hosts' sharing, which the chunk model (idle host) leaves out, priced as it
            # stretches the one-stage-a-device pipeline on the same devices: so the plan is
            # weighed against an async one (schedule auto) on the same footing
            stretch = _predict(chosen, (m,))[0] / max(chosen[0].iteration_s, 1e-12)
            return _device_plan(
                cluster,
                profile,
                model,
                cm,
                usable,
                picked,
                minibatch=minibatch,
                placement=placement,
                warnings=warnings,
                stretch=stretch,
                details={
                    "searched_iteration_s": picked.iteration_s,
                    "evaluations": model.evaluations,
                    "microbatches": [m],
                    "exchange_s": 0.0,
                    "chunk_candidates": chunk_rows,
                    "chunk_choice": choice,
                },
            )
    elif kind in (None, *SYNC_KINDS) and len(chosen) == 1 and not (vws and vws[0][1] is not None):
        # the same devices with two stages each (device-level kinds), priced beside it: a
        # suggestion (the runtime runs them from a job's own several-stage split only)
        from hetpipe.planner.chunksearch import chunk_report

        chunk_rows, suggestion = chunk_report(model, chosen[0], budget_s / 4)
        warnings += [suggestion] if suggestion else []
    kinds = {(c.kind, c.warmup) for c in chosen}
    if len(kinds) > 1:
        raise PlanError(f"virtual workers would run different orders {sorted(kinds)}")
    warm = chosen[0].warmup
    searched = max(c.iteration_s for c in chosen) + exchange
    iteration, pred = _predict(chosen, ms)
    layer_shards, stage_shards = place_plan(
        cluster,
        profile,
        [[(usable[i], ab) for i, ab in zip(c.devices, c.cuts, strict=True)] for c in chosen],
        placement,
    )
    plans = []
    for v, (c, mv) in enumerate(zip(chosen, ms, strict=True)):
        k = len(c.devices)
        stages = []
        for pos, (i, (a, b)) in enumerate(zip(c.devices, c.cuts, strict=True)):
            # the order fixes what a stage holds, whatever the timing: the expected peak is
            # the bound (hetpipe.core.memory.expected_in_flight)
            mem = model.memory(i, a, b, pos, k, c.kind, mv, warm)
            n = model.flight(pos, k, c.kind, mv, warm)
            stages.append(
                StagePlan(
                    StageLayout((usable[i].name,), a, b),
                    usable[i].type,
                    pred.compute_s(v, pos),
                    mem,
                    usable[i].memory,
                    stage_shards[v][pos],
                    pred.busy_s(v, pos, mv),
                    pred.slowdown[v][pos],
                    expected_memory=mem,
                    expected_in_flight=n,
                    in_flight=n,
                )
            )
        plans.append(
            VWPlan(
                tuple(stages),
                mv,
                mv * minibatch / iteration,
            )
        )
    used = {n for p in plans for n in p.devices}
    unused = tuple(d.name for d in cluster.devices if d.name not in used)
    details = {
        "iteration_s": iteration,
        "searched_iteration_s": searched,
        "kind": chosen[0].kind,
        "warmup": warm,
        "slowdown": [list(x) for x in pred.slowdown],
        "evaluations": model.evaluations,
        "microbatches": list(ms),
        "exchange_s": exchange,
        "tie_bytes": [model.tie_bytes(c.cuts) for c in chosen],
        **({"chunk_candidates": chunk_rows} if chunk_rows else {}),
        **({"chunk_choice": choice} if choice else {}),
        "orders": {
            str(s): [
                f"{op}{j}"
                for op, j in model.order(chosen[0].kind, len(chosen[0].devices), s, ms[0], warm)
            ]
            for s in range(len(chosen[0].devices))
        },
    }
    return Plan(
        tuple(plans),
        sum(p.samples_per_s for p in plans),
        how,
        unused,
        tuple(warnings),
        tuple(layer_shards),
        minibatch,
        0,
        profile.model,
        details,
        chosen[0].kind,
        iteration,
        warm,
    )


def _device_plan(
    cluster: Any,
    profile: ModelProfile,
    model: SyncModel,
    cm: Any,
    usable: Sequence[Any],
    c: Any,
    *,
    minibatch: int,
    placement: str,
    warnings: list[str],
    stretch: float,
    details: dict[str, Any],
) -> Any:
    """The plan of one virtual worker whose devices run two stages each under a device-level
    kind (``c``, a :class:`~.chunksearch.ChunkChoice`): its stages in the kind's placement,
    its cuts and predicted iteration time from the chunk search (idle host; times
    ``stretch``, the hosts' sharing as it stretches the one-stage-a-device pipeline), each stage's
    memory by the one memory model under the kind's order projected from its devices (the
    stages of one device together within its cap, as the search checked), and each stage's
    compute as :func:`~hetpipe.planner.predict.predict` has it with its device to itself."""
    from hetpipe.planner.placement import place_plan
    from hetpipe.planner.plan import _shard_hosts
    from hetpipe.planner.plans import Plan, StagePlan, VWPlan
    from hetpipe.planner.predict import predict

    k, m = len(c.devices), model.m
    D = len(set(c.devices))
    devs = [usable[i] for i in c.devices]
    pred = predict(
        cm,
        [(tuple(devs), cm.describe(devs, c.cuts, m))],
        minibatch=minibatch,
        staleness=0,
        shard_hosts=_shard_hosts(cluster),
        minibatches=PREDICT_ITERATIONS * m,
        schedule=c.kind,
        warmup=0,
        devices=D,
    )
    layer_shards, stage_shards = place_plan(
        cluster, profile, [[(d, ab) for d, ab in zip(devs, c.cuts, strict=True)]], placement
    )
    stages = []
    for pos, (i, (a, b)) in enumerate(zip(c.devices, c.cuts, strict=True)):
        mem = model.memory(i, a, b, pos, k, c.kind, m, 0)
        n = model.flight(pos, k, c.kind, m, 0)
        stages.append(
            StagePlan(
                StageLayout((usable[i].name,), a, b),
                usable[i].type,
                pred.compute_s(0, pos),
                mem,
                usable[i].memory,
                stage_shards[0][pos],
                pred.busy_s(0, pos, m),
                pred.slowdown[0][pos],
                expected_memory=mem,
                expected_in_flight=n,
                in_flight=n,
            )
        )
    iteration = float(c.iteration_s) * stretch
    vw = VWPlan(tuple(stages), m, m * minibatch / iteration)
    used = set(vw.devices)
    return Plan(
        (vw,),
        vw.samples_per_s,
        "sync",
        tuple(d.name for d in cluster.devices if d.name not in used),
        tuple(warnings),
        tuple(layer_shards),
        minibatch,
        0,
        profile.model,
        {
            "iteration_s": iteration,
            "kind": c.kind,
            "warmup": 0,
            "slowdown": [list(x) for x in pred.slowdown],
            "tie_bytes": [model.tie_bytes(c.cuts)],
            "chunk_devices": D,
            **details,
            "orders": {
                str(s): [f"{op}{j}" for op, j in model.order(c.kind, k, s, m, 0)] for s in range(k)
            },
        },
        c.kind,
        iteration,
        0,
    )
