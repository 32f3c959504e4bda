"""Where weight prediction's per-minibatch time goes: one stage, in process, no cluster.

A real :class:`hetpipe.stage.StageCompute` holding one stage of the digits CNN split as
``scripts/bench_staleness.py`` splits it (``--k`` uniform stages, Nm = k, minibatch 32, SGD
lr 0.02 momentum 0.9), at its device's own speed (no padding), runs the stage's lock-step
order (:class:`hetpipe.core.staleness.StageTable`: forwards, backwards, an optimizer step after
each backward) on seeded inputs and output gradients, once per arm:

- ``stash``: ``train.weights = "stash"``;
- ``paper``: ``"predict"``, variant ``paper`` (the backward binds its own prediction to the
  forward's graph, :mod:`hetpipe.lateweights`);
- ``consistent``: ``"predict"``, variant ``consistent``;
- with ``--unbound``, ``paper-unbound``: the ``paper`` arm with the late binding switched off
  (no saved-tensor hooks, no release: its backward differentiates the forward's own
  prediction, so its results are not the paper variant's and are neither saved nor checked).
  It is what any cut of the binding machinery (:mod:`hetpipe.lateweights`,
  :meth:`hetpipe.stage.StageCompute._release`) can win at most: ``paper`` minus it.

The arms run interleaved, ``--repeats`` times each (a fresh stage every time), on one thread,
timed by the thread's CPU time (``--clock wall`` for wall-clock time: on a shared host the
CPU time leaves out what other processes take).
Per minibatch the time of its forward, backward and step is summed; each repeat gives the
median over the run's minibatches (``--stat mean``: their mean, which is what throughput
follows: a rare slow minibatch moves the mean, not the median), and the figure printed is
the median over repeats, per stage and arm. Then a breakdown of the prediction's pieces,
timed inclusively around the functions that do them (per minibatch, totals over a run
divided by its minibatches), and with ``--profile`` the top of a cProfile of the ``paper``
arm.

``--save FILE`` writes every arm's final weights and input gradients; ``--check FILE``
compares against such a file bit for bit (a change that must not move any result).
``--retained``: the process keeps freed memory as every daemon does
(:mod:`hetpipe.hostmem`), so a minibatch's new tensors (a prediction is one per pass) land on
warm pages as they do in a cluster.

    python scripts/probe_predict_overhead.py [--stages 0 1] [--minibatches 200]
        [--repeats 5] [--clock cpu|wall] [--stat median|mean] [--unbound] [--profile]
        [--save F | --check F] [--retained] [--json]
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from _bench import emit_json, machine, parser, print_table, retain_freed_as_daemons

import hetpipe.lateweights as lateweights
import hetpipe.stage as stage_mod
from hetpipe.config import DeviceSpec
from hetpipe.core.layout import StageLayout
from hetpipe.core.staleness import StageTable
from hetpipe.core.wsp import wave_of
from hetpipe.job import JobSpec
from hetpipe.models import build_model
from hetpipe.optim import StageOptimizer
from hetpipe.stage import StageCompute
from hetpipe.task import StageTask

ARMS: dict[str, dict[str, Any]] = {
    "stash": {"weights": "stash"},
    "paper": {"weights": "predict", "predict_variant": "paper"},
    "consistent": {"weights": "predict", "predict_variant": "consistent"},
}
MINIBATCH = 32
N_LAYERS = 16  # the digits CNN's
# what the figures are timed with: this thread's CPU time by default (the host is shared:
# time another process takes from this one is not counted), or wall-clock time (--clock wall)
CLOCK: list[Callable[[], float]] = [time.thread_time]
# per minibatch: (forward, backward, step) seconds and the speed -> the figure
FIGURES: dict[str, Callable[[list[float], float], float]] = {
    "total": lambda t, _speed: sum(t),
    "forward": lambda t, _speed: t[0],
    "backward": lambda t, _speed: t[1],
    "step": lambda t, _speed: t[2],
    "padded": lambda t, speed: (t[0] + t[1]) / speed + t[2],
}
# timing-only arms: (the arm whose stage they build, what they switch off while they run)
UNBOUND = {"paper-unbound": "paper"}
DEVICE = DeviceSpec("gpu0", "cpu", "fast", 1 << 34, 1.0, 0, "node0", "127.0.0.1", 96.0)

# (owner, attribute, label): what the breakdown times, inclusively
TIMED: list[tuple[Any, str, str]] = [
    (StageCompute, "_forward_weights", "forward_weights (predict + clone)"),
    (StageCompute, "_predicted", "_predicted"),
    (StageOptimizer, "predict", "optimizer.predict"),
    (StageCompute, "_release", "_release"),
    (StageCompute, "_judge", "_judge (probe)"),
    (lateweights.LateWeights, "layer", "LateWeights.layer (hook set-up)"),
    (lateweights.LateWeights, "_resolve", "LateWeights._resolve (unpack)"),
    (lateweights, "_cast_of", "_cast_of (pack walk)"),
    (StageCompute, "_check_memory", "_check_memory"),
    (StageOptimizer, "step", "optimizer.step"),
]


def even_split(n_layers: int, k: int) -> list[int]:
    base, extra = divmod(n_layers, k)
    return [base + (i < extra) for i in range(k)]


def make_stage(arm: str, stage: int, k: int, minibatches: int) -> StageCompute:
    """Stage ``stage`` of ``k`` of the CNN, weights loaded from the seeded model."""
    arm = UNBOUND.get(arm, arm)
    spec = JobSpec.from_dict(
        {
            "name": "probe",
            "model": {"name": "cnn", "args": {}},
            "data": {"name": "digits"},
            "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.9, "weight_decay": 1e-4},
            "train": {
                "minibatch": MINIBATCH,
                "nm": k,
                "minibatches": minibatches,
                "seed": 0,
                **ARMS[arm],
            },
        },
        source="probe",
    )
    bounds = [0]
    for n in even_split(N_LAYERS, k):
        bounds.append(bounds[-1] + n)
    task = StageTask.standalone(
        "probe",
        spec.to_dict(),
        StageLayout(("probe",), bounds[stage], bounds[stage + 1]),
        stage=stage,
        k=k,
        nm=k,
        minibatches=minibatches,
    )
    compute = StageCompute(task, DEVICE)
    torch.manual_seed(0)
    state = build_model("cnn").state_dict()
    names = compute.state_names()
    compute.load({n: state[n] for n in names}, {n: [] for n in names})
    return compute


def feeds(
    stage: int, k: int, minibatches: int
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], torch.Tensor]:
    """Each minibatch's input and output gradient at ``stage`` (seeded), and the labels."""
    model = build_model("cnn")
    bounds = [0]
    for n in even_split(N_LAYERS, k):
        bounds.append(bounds[-1] + n)
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(MINIBATCH, 1, 8, 8, generator=g)
    with torch.no_grad():
        model.eval()
        x_in = model[: bounds[stage]](x0)
        x_out = model[: bounds[stage + 1]](x0)
    xs = [torch.randn(x_in.shape, generator=g) for _ in range(minibatches)]
    last = stage == k - 1
    gs = [
        None if last else torch.randn(x_out.shape, generator=g) * 1e-2 for _ in range(minibatches)
    ]
    y = torch.randint(0, 10, (MINIBATCH,), generator=g)
    return xs, gs, y


def run(
    compute: StageCompute, xs: list[torch.Tensor], gs: list[torch.Tensor | None], y: torch.Tensor
) -> tuple[list[list[float]], dict[int, torch.Tensor | None]]:
    """The stage's lock-step order; per minibatch its forward, backward and step seconds,
    and its input gradients."""
    table = compute.table or StageTable(
        compute.task.k, compute.task.stage, compute.task.nm, compute.task.minibatches
    )  # stash keeps none
    spent = [[0.0, 0.0, 0.0] for _ in xs]
    grads: dict[int, torch.Tensor | None] = {}
    clock = CLOCK[0]
    for n in range(2 * len(xs)):
        kind, p = table.op(n)
        t0 = clock()
        if kind == "F":
            compute.forward(p, xs[p], y)
            spent[p][0] = clock() - t0
        else:
            grads[p] = compute.backward(p, gs[p])
            t1 = clock()
            compute.step(p)
            spent[p][1:] = [t1 - t0, clock() - t1]
            # the runtime pushes each wave's update (and drops it once applied): keep the
            # accumulators as few, untimed (memory() counts them every pass)
            for w in [w for w in compute.acc if w < wave_of(p, compute.task.nm)]:
                del compute.acc[w]
    return spent, grads


@contextmanager
def unbound() -> Iterator[None]:
    """The late binding off: no layer packs its weights as names, no forward releases them
    (so every graph keeps its forward's weights, as ``consistent`` does)."""
    layer, release = lateweights.LateWeights.layer, StageCompute._release

    def no_layer(_self: Any, _weights: Any) -> AbstractContextManager[Any]:
        return nullcontext()

    def no_release(_self: Any, _params: Any) -> None:
        return None

    lateweights.LateWeights.layer = no_layer  # type: ignore[method-assign]
    StageCompute._release = no_release  # type: ignore[method-assign]
    try:
        yield
    finally:
        lateweights.LateWeights.layer = layer  # type: ignore[method-assign]
        StageCompute._release = release  # type: ignore[method-assign]


def arm_context(arm: str) -> AbstractContextManager[Any]:
    """What the arm runs under: the late binding switched off for a timing-only arm."""
    return unbound() if arm in UNBOUND else nullcontext()


@contextmanager
def timing_hooks(totals: dict[str, float]) -> Iterator[None]:
    """Wrap the functions of :data:`TIMED` with inclusive timers adding into ``totals``."""
    saved = []
    for owner, attr, label in TIMED:
        fn = getattr(owner, attr)
        saved.append((owner, attr, fn))

        def wrapped(*a: Any, _fn: Callable[..., Any] = fn, _label: str = label, **kw: Any) -> Any:
            clock = CLOCK[0]
            t0 = clock()
            try:
                return _fn(*a, **kw)
            finally:
                totals[_label] = totals.get(_label, 0.0) + clock() - t0

        setattr(owner, attr, wrapped)
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--minibatches", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--speed",
        type=float,
        default=0.25,
        help="the emulated speed of the padded figure (bench_staleness's default)",
    )
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="this thread's CPU time (default: robust on a shared host) or wall",
    )
    ap.add_argument(
        "--stat",
        choices=("median", "mean"),
        default="median",
        help="each repeat's figure over its minibatches (mean: what throughput follows)",
    )
    ap.add_argument(
        "--unbound",
        action="store_true",
        help="add the timing-only arm paper-unbound (late binding off)",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile the paper arm")
    ap.add_argument("--save", type=Path, help="write final weights and input gradients")
    ap.add_argument("--check", type=Path, help="compare them bit for bit against --save's")
    ap.add_argument(
        "--retained",
        action="store_true",
        help="keep freed memory as every daemon does ([runtime] retain_freed_mib, "
        "hetpipe.hostmem); default: the C allocator as it starts",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.retained:
        retain_freed_as_daemons()
    CLOCK[0] = time.thread_time if args.clock == "cpu" else time.perf_counter
    assert stage_mod.StageCompute is StageCompute
    arms = [*ARMS, *(UNBOUND if args.unbound else ())]
    over = statistics.median if args.stat == "median" else statistics.mean

    results: dict[str, Any] = {
        "machine": machine(),
        "k": args.k,
        "clock": args.clock,
        "retained": args.retained,
        "minibatches": args.minibatches,
        "repeats": args.repeats,
        "stat": args.stat,
        "median_ms": {},
        "breakdown_ms": {},
    }
    outcome: dict[str, torch.Tensor] = {}
    for st in args.stages:
        xs, gs, y = feeds(st, args.k, args.minibatches)
        # per arm and figure, each repeat's median (or mean) over the run's minibatches (ms)
        runs: dict[str, dict[str, list[float]]] = {arm: {f: [] for f in FIGURES} for arm in arms}
        for r in range(args.repeats):
            for arm in arms:  # interleaved: a disturbance hits every arm alike
                compute = make_stage(arm, st, args.k, args.minibatches)
                with arm_context(arm):
                    spent, grads = run(compute, xs, gs, y)
                for f, fn in FIGURES.items():
                    runs[arm][f].append(over([fn(t, args.speed) for t in spent]) * 1e3)
                if r == 0 and arm not in UNBOUND:  # its results are no arm's to check
                    for name, t in compute.state_dict().items():
                        outcome[f"{st}/{arm}/w/{name}"] = t.clone()
                    for p, g in grads.items():
                        if g is not None:
                            outcome[f"{st}/{arm}/g/{p}"] = g.clone()
        med = {arm: {f: statistics.median(v) for f, v in runs[arm].items()} for arm in arms}
        results["median_ms"][str(st)] = med
        print(
            f"stage {st} of {args.k}: per-minibatch ms, median of {args.repeats} repeats "
            f"(each the {args.stat} of {args.minibatches} minibatches); padded: forward and "
            f"backward at speed {args.speed}, as an emulated device pads them"
        )
        print_table(
            ["arm", *FIGURES, "total vs stash", "padded vs stash"],
            [
                [
                    a,
                    *med[a].values(),
                    med[a]["total"] / med["stash"]["total"],
                    med[a]["padded"] / med["stash"]["padded"],
                ]
                for a in arms
            ],
        )

        breakdown: dict[str, dict[str, float]] = {}
        for arm in ARMS:
            totals: dict[str, float] = {}
            compute = make_stage(arm, st, args.k, args.minibatches)
            with timing_hooks(totals):
                run(compute, xs, gs, y)
            breakdown[arm] = {k: v * 1e3 / args.minibatches for k, v in totals.items()}
        results["breakdown_ms"][str(st)] = breakdown
        labels = [label for _o, _a, label in TIMED]
        print(f"stage {st}: inclusive ms per minibatch (timed wrappers add their own cost)")
        print_table(
            ["function", *ARMS],
            [[label, *(breakdown[a].get(label, 0.0) for a in ARMS)] for label in labels],
        )

        if args.profile:
            compute = make_stage("paper", st, args.k, args.minibatches)
            prof = cProfile.Profile()
            prof.enable()
            run(compute, xs, gs, y)
            prof.disable()
            print(f"stage {st}: cProfile of the paper arm (tottime)")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
        print()

    if args.save is not None:
        torch.save(outcome, args.save)
    if args.check is not None:
        want = torch.load(args.check)
        differ = sorted(n for n in want if n not in outcome or not torch.equal(outcome[n], want[n]))
        differ += sorted(n for n in outcome if n not in want)
        results["bit_identical"] = not differ
        print("bit-identical to", args.check, ":", not differ, differ[:5])
    if args.json:
        emit_json(results)


if __name__ == "__main__":
    main()
