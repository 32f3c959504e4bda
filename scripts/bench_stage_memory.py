"""Peak memory per stage under each synchronous schedule: the memory model's prediction
against the bytes the stage really holds.

For each model (``--models``), stage count k (``--stages``) and schedule (``--schedules``:
``1f1b`` the reference, ``zb-h1``, ``zb-h2``, and the device-level ``interleaved-1f1b`` and
``zbv`` at their default two stages a device), the model is split into k stages of equal
layer counts and each stage is run as the runtime runs it: its own
:class:`hetpipe.stage.StageCompute` in the schedule's order for the stage
(:func:`hetpipe.core.schedule.microbatch_order`), M = ``--microbatches`` microbatches of
``--minibatch`` samples an iteration, with the step and its update carried into the next
iteration's until the last one's push, as a virtual worker alone in its job does
(:func:`hetpipe.memprobe.stage_peak`). Per stage:

- ``predicted``: the planner's one memory model, :func:`hetpipe.core.memory.stage_memory_of`
  for that stage's layers, position and schedule, on a profile of the model measured by the
  planner's profiler (:func:`hetpipe.measure.measure_layers`) on this host;
- ``measured``: the most bytes the stage's tensors held at once over its second iteration
  (the first warms up: the optimizer's state, the layers' first measuring forward), from
  every host allocation and free recorded by ``torch.profiler``
  (:mod:`hetpipe.memprobe`): its weights, optimizer state, gradient sum and update, every
  in-flight microbatch's input, graph and saved tensors, the gradients it receives and keeps,
  and each operation's temporaries; nothing the process held before the stage was built;
- ``ratio`` = measured / predicted and ``error`` = |measured - predicted| / measured.

A device-level schedule's devices are measured too, each with its stages built and run
together in the device's order (:func:`hetpipe.memprobe.device_peak`; a neighbour on the same
device hands its tensors over as they are), against the sum of its stages' predictions (what
the runtime checks a device's cap against, :class:`hetpipe.stage.DeviceMemory`).

With ``--json`` the last line holds, per schedule, ``max_abs_error`` (the worst stage of any
model and k; target <= 0.10) and every row, with the predicted terms; the devices'
``device_max_abs_error`` (no target) and their rows.
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from _bench import emit_json, machine, parser, print_table

from hetpipe import memprobe
from hetpipe.core.devschedule import default_devices, placement
from hetpipe.core.memory import stage_memory_of
from hetpipe.core.profile import ModelProfile
from hetpipe.core.schedule import DEVICE_KINDS
from hetpipe.data import MinibatchStream, load_dataset
from hetpipe.job import JobSpec
from hetpipe.measure import measure_layers
from hetpipe.models import build_model
from hetpipe.optim import StageOptimizer

SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zbv")
TARGET = 0.10


def job(
    model: str, schedule: str, m: int, minibatch: int, optimizer: str, cuts: list[int]
) -> JobSpec:
    """A synchronous job of ``model`` on digits under ``schedule`` (M = ``m``), one virtual
    worker split at ``cuts``: one device a stage, or a device-level schedule's default
    placement of two stages a device (:func:`hetpipe.core.devschedule.placement`)."""
    k = len(cuts) - 1
    train: dict[str, Any] = {}
    if schedule in DEVICE_KINDS:
        where = placement(schedule, k, default_devices(schedule, k))
        train["several_stages"] = True
    else:
        where = tuple(range(k))
    opt: dict[str, Any] = {"name": optimizer, "lr": 0.05, "weight_decay": 1e-4}
    if optimizer == "sgd":
        opt["momentum"] = 0.9
    return JobSpec.from_dict(
        {
            "name": "bench-stage-memory",
            "model": {"name": model, "args": {}},
            "data": {"name": "digits"},
            "optimizer": opt,
            "train": {
                "minibatch": minibatch,
                "nm": m,
                "minibatches": 2 * m,
                "seed": 0,
                "schedule": schedule,
                **train,
            },
            "vw": [
                {
                    "devices": [f"gpu{d}" for d in where],
                    "layers": [b - a for a, b in itertools.pairwise(cuts)],
                }
            ],
        }
    )


def cuts_of(n: int, k: int) -> list[int]:
    """``k`` stages of (nearly) equal layer counts over ``n`` layers."""
    return [round(i * n / k) for i in range(k + 1)]


def measure_case(
    model: str, k: int, schedules: list[str], m: int, minibatch: int, optimizer: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every stage of ``model`` split in ``k`` under each schedule, predicted and measured;
    and, for a device-level schedule, every device with its stages run together."""
    torch.manual_seed(0)
    net = build_model(model)
    state = {n: t.detach().clone() for n, t in net.state_dict().items()}
    stream = MinibatchStream(load_dataset("digits"), minibatch, 0, 0, 1)
    batches = [stream.batch(j) for j in range(m)]
    x = batches[0][0]
    torch.manual_seed(0)
    layers = measure_layers(build_model(model), x, repeats=3, warmup=1)
    profile = ModelProfile(model, minibatch, x.numel() * x.element_size(), {"cpu": layers})
    cuts = cuts_of(len(net), k)
    rows, device_rows = [], []
    for kind in schedules:
        spec = job(model, kind, m, minibatch, optimizer, cuts)
        factor = StageOptimizer.state_factor(spec.optimizer)
        rec = memprobe.record(spec, cuts, batches, state)
        for s in range(k):
            want = stage_memory_of(profile, "cpu", (cuts[s], cuts[s + 1]), s, k, m, factor, kind)
            got = memprobe.stage_peak(spec, cuts, s, rec, state)
            rows.append(
                {
                    "model": model,
                    "schedule": kind,
                    "k": k,
                    "m": m,
                    "stage": s,
                    "layers": [cuts[s], cuts[s + 1]],
                    "predicted": want.total,
                    "measured": got.peak,
                    "held_after": got.final,
                    "ratio": got.peak / want.total,
                    "error": abs(got.peak - want.total) / got.peak,
                    "predicted_terms": want.to_dict(),
                }
            )
        if kind not in DEVICE_KINDS:
            continue
        predicted = {r["stage"]: r["predicted"] for r in rows[-k:]}
        for d in range(default_devices(kind, k)):
            mine, got = memprobe.device_peak(spec, cuts, d, rec, state)
            want_total = sum(predicted[s] for s in mine)
            device_rows.append(
                {
                    "model": model,
                    "schedule": kind,
                    "k": k,
                    "m": m,
                    "device": d,
                    "stages": list(mine),
                    "predicted": want_total,
                    "measured": got.peak,
                    "ratio": got.peak / want_total,
                    "error": abs(got.peak - want_total) / got.peak,
                }
            )
    return rows, device_rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--models", default="mlp,cnn", help="builtin models, comma-separated")
    ap.add_argument("--stages", default="2,4", help="stage counts k, comma-separated")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--microbatches", type=int, default=4, help="M per iteration")
    ap.add_argument("--minibatch", type=int, default=32, help="samples per microbatch")
    ap.add_argument("--optimizer", default="sgd", help="sgd (momentum 0.9) or adam")
    args = ap.parse_args()
    schedules = args.schedules.split(",")
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    device_rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        for k in (int(v) for v in args.stages.split(",")):
            got, on_devices = measure_case(
                model, k, schedules, args.microbatches, args.minibatch, args.optimizer
            )
            rows += got
            device_rows += on_devices
    print_table(
        ["model", "schedule", "k", "stage", "layers", "predicted", "measured", "ratio", "error"],
        [
            [
                r["model"],
                r["schedule"],
                r["k"],
                r["stage"],
                f"{r['layers'][0]}-{r['layers'][1] - 1}",
                r["predicted"],
                r["measured"],
                r["ratio"],
                r["error"],
            ]
            for r in rows
        ],
    )
    if device_rows:
        print()
        print_table(
            ["model", "schedule", "k", "device", "stages", "predicted", "measured", "ratio"],
            [
                [
                    r["model"],
                    r["schedule"],
                    r["k"],
                    r["device"],
                    "+".join(map(str, r["stages"])),
                    r["predicted"],
                    r["measured"],
                    r["ratio"],
                ]
                for r in device_rows
            ],
        )
    per = {
        kind: {
            "max_abs_error": max(r["error"] for r in rows if r["schedule"] == kind),
            "max_ratio": max(r["ratio"] for r in rows if r["schedule"] == kind),
            "min_ratio": min(r["ratio"] for r in rows if r["schedule"] == kind),
        }
        for kind in schedules
    }
    print()
    print_table(
        ["schedule", "max_abs_error", "min ratio", "max ratio", "met"],
        [
            [kind, v["max_abs_error"], v["min_ratio"], v["max_ratio"], v["max_abs_error"] <= TARGET]
            for kind, v in per.items()
        ],
    )
    if args.json:
        emit_json(
            {
                "bench": "stage_memory",
                "machine": machine(),
                "args": vars(args),
                "target_max_abs_error": TARGET,
                "schedules": per,
                "max_abs_error": {kind: v["max_abs_error"] for kind, v in per.items()},
                "device_max_abs_error": {
                    kind: max(r["error"] for r in device_rows if r["schedule"] == kind)
                    for kind in schedules
                    if any(r["schedule"] == kind for r in device_rows)
                },
                "rows": rows,
                "device_rows": device_rows,
                "seconds": round(time.monotonic() - started, 1),
            }
        )


if __name__ == "__main__":
    main()
