"""One stage's compute, in process: our StageCompute against plain PyTorch on the same layers.

``scripts/bench_sync.py`` (a) runs the digits CNN as 4 unslowed CPU stages against
torch.distributed.pipelining on a host whose cores it saturates, so what each stage's
forward, backward and step cost in CPU decides its ratio. This takes one stage of that split
(``bench_pipeline.MODELS``: microbatch 32, M = 4 microbatches an iteration, SGD with
momentum), and runs, alternately, one iteration at a time:

- ``ours``: a :class:`hetpipe.stage.StageCompute` of the ``1f1b`` schedule, as a worker runs
  it (M forwards and backwards, then the iteration's step);
- ``plain``: the same layers as an ``nn.Sequential`` with ``torch.autograd.backward`` into
  ``.grad`` and ``torch.optim.SGD``, as a pipelining stage runs them.

Inputs and output gradients are seeded random tensors of the stage's shapes; the learning
rate is tiny (1e-6) so neither side's weights drift from their start (the figure is the
compute's cost, not training). Timed by the thread's CPU time; page faults from
``getrusage``. Each allocator setting runs in a fresh process of its own, since a process
cannot take it back: ``default`` (glibc as it starts) and ``retained``
(:func:`hetpipe.hostmem.retain_freed` with the runtime's default, as every daemon starts).
Figures: medians over the iterations after the first ``--iterations`` / 5.

    python scripts/probe_stage_compute.py [--stages 0 1 2 3] [--iterations 100] [--json]
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import statistics
import time
from typing import Any

from _bench import emit_json, machine, parser, print_table, retain_freed_as_daemons
from bench_pipeline import MODELS, STAGES
from probe_predict_overhead import DEVICE

M = 4
MICROBATCH = 32
LR = 1e-6
SETTINGS = ("default", "retained")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _probe(stage: int, iterations: int, setting: str, out: Any) -> None:
    """In a fresh process: both sides of one stage, alternated iteration by iteration."""
    import torch

    from hetpipe.core.layout import StageLayout
    from hetpipe.job import JobSpec
    from hetpipe.models import build_model
    from hetpipe.stage import StageCompute
    from hetpipe.task import StageTask

    if setting == "retained":
        retain_freed_as_daemons()
    torch.set_num_threads(1)  # as a worker runs
    args, data, split = MODELS["cnn"]
    bounds = [0]
    for n in split:
        bounds.append(bounds[-1] + n)
    spec = JobSpec.from_dict(
        {
            "name": "probe",
            "model": {"name": "cnn", "args": args},
            "data": {"name": data},
            "optimizer": {"name": "sgd", "lr": LR, "momentum": 0.9, "weight_decay": 0.0},
            "train": {
                "minibatch": MICROBATCH,
                "nm": M,
                "minibatches": M * (iterations + 1),
                "seed": 0,
                "schedule": "1f1b",
            },
        },
        source="probe",
    )
    task = StageTask.standalone(
        "probe",
        spec.to_dict(),
        StageLayout(("probe",), bounds[stage], bounds[stage + 1]),
        stage=stage,
        k=STAGES,
        nm=M,
        minibatches=M * (iterations + 1),
    )
    torch.manual_seed(0)
    model = build_model("cnn", args)
    compute = StageCompute(task, DEVICE)
    state = model.state_dict()
    names = compute.state_names()
    compute.load({n: state[n] for n in names}, {n: [] for n in names})
    layers = model[bounds[stage] : bounds[stage + 1]]
    opt = torch.optim.SGD(layers.parameters(), lr=LR, momentum=0.9)
    last = stage == STAGES - 1
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(MICROBATCH, 1, 8, 8, generator=g)
    with torch.no_grad():
        model.eval()
        x_in, x_out = model[: bounds[stage]](x0), model[: bounds[stage + 1]](x0)
    model.train()
    xs = [torch.randn(x_in.shape, generator=g) for _ in range(M)]
    grad = None if last else torch.randn(x_out.shape, generator=g) * 1e-2
    y = torch.randint(0, 10, (MICROBATCH,), generator=g)

    def ours(i: int) -> None:
        for p in range(i * M, (i + 1) * M):
            compute.forward(p, xs[p % M], y)
            compute.backward(p, grad)
        compute.step(i)
        compute.acc.clear()  # the runtime's push takes the iteration's update

    def plain(_i: int) -> None:
        for x in xs:
            x = x.detach().requires_grad_(stage > 0)
            out = layers(x)
            if last:
                torch.autograd.backward(torch.nn.functional.cross_entropy(out, y) / M)
            else:
                torch.autograd.backward(out, grad)
        opt.step()
        opt.zero_grad()

    spent: dict[str, list[float]] = {"ours": [], "plain": []}
    faults: dict[str, list[int]] = {"ours": [], "plain": []}
    sides = {"ours": ours, "plain": plain}
    for i in range(iterations):
        for side in ("ours", "plain") if i % 2 else ("plain", "ours"):
            f0, t0 = _faults(), time.thread_time()
            sides[side](i)
            spent[side].append(time.thread_time() - t0)
            faults[side].append(_faults() - f0)
    skip = iterations // 5
    out.put(
        {
            side: {
                "ms_per_microbatch": 1e3 * statistics.median(spent[side][skip:]) / M,
                "faults_per_iteration": statistics.median(faults[side][skip:]),
            }
            for side in sides
        }
    )


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument(
        "--stages", type=int, nargs="+", default=list(range(STAGES)), choices=range(STAGES)
    )
    ap.add_argument("--iterations", type=int, default=100)
    args = ap.parse_args()
    if args.iterations < 5:
        ap.error("--iterations: at least 5")
    ctx = mp.get_context("spawn")
    rows, figures = [], {}
    for stage in args.stages:
        for setting in SETTINGS:
            q = ctx.Queue()
            proc = ctx.Process(target=_probe, args=(stage, args.iterations, setting, q))
            proc.start()
            got = q.get(timeout=1800)
            proc.join(60)
            ratio = got["ours"]["ms_per_microbatch"] / got["plain"]["ms_per_microbatch"]
            figures[f"stage{stage}_{setting}"] = {**got, "ratio": ratio}
            rows.append(
                [
                    stage,
                    setting,
                    got["ours"]["ms_per_microbatch"],
                    got["plain"]["ms_per_microbatch"],
                    ratio,
                    got["ours"]["faults_per_iteration"],
                    got["plain"]["faults_per_iteration"],
                ]
            )
    print(
        f"cnn split {MODELS['cnn'][2]}, microbatch {MICROBATCH}, M = {M}, "
        f"{args.iterations} iterations a side, CPU time of the thread"
    )
    print_table(
        [
            "stage",
            "allocator",
            "ours ms/microbatch",
            "plain ms/microbatch",
            "ours / plain",
            "ours faults/iteration",
            "plain faults/iteration",
        ],
        rows,
    )
    if args.json:
        emit_json({"probe": "stage_compute", "machine": machine(), "stages": figures})


if __name__ == "__main__":
    main()
