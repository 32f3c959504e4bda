"""A stage's compute against its layers' profile, by layer count: the evidence for the call term.

In one process, no cluster: a real :class:`hetpipe.stage.StageCompute` (a middle stage of the
bench_network MLP, minibatch 256, on an emulated device of ``--speed``, padded as the runtime
pads) runs the forward, the backward and the optimizer step of ``n`` consecutive layers, the
work a stage's ``forward``/``backward`` spans time. Its median time per minibatch is set
against the profile two ways:

- ``gross``: the sum of the layers' :func:`~hetpipe.planner.profile.measure_layers` times
  (each layer timed alone: what the planner summed before the call term);
- ``net``: :meth:`ModelProfile.stage_times` from :func:`~hetpipe.planner.profile.measure_model`
  (the layers net of their call, plus the call term once);
- ``net, step unpadded``: the same with the update at the device's real speed, as the runtime
  runs the optimizer step (it pads forwards and backwards only; the profile's update is
  padded, and the async planner charges it so).

Then a least-squares fit of ``stage - predicted = a + (n - 1) b``: ``b`` is the bias per
layer a stage of more layers gets (0 for an unbiased profile), ``a`` what every stage pays
beyond its layers (the runtime's per-task costs, ``RuntimeCosts.task_s``). The last two
fits are of the planner's compute prediction itself (the default
:class:`~hetpipe.planner.runtime.RuntimeCosts`: two tasks' ``task_s`` padded; a stage timed
back to back, and a padded one, pays no ``cold``: :attr:`hetpipe.planner.predict.StageCost.cools`),
from each profile.

    python scripts/probe_call_term.py [--speed 0.1] [--repeats 25] [--sizes 1 2 4 8 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from hetpipe.config import DeviceSpec
from hetpipe.core.layout import StageLayout
from hetpipe.data import load_dataset
from hetpipe.job import JobSpec
from hetpipe.measure import measure_layers, measure_model
from hetpipe.models import build_model, model_loss
from hetpipe.planner.profile import ModelProfile
from hetpipe.planner.runtime import RuntimeCosts
from hetpipe.stage import StageCompute
from hetpipe.task import StageTask

HIDDEN = [128] * 7 + [16] + [128] * 5  # scripts/bench_network.py's model
MINIBATCH = 256


def spec() -> JobSpec:
    return JobSpec.from_dict(
        {
            "name": "probe",
            "model": {"name": "mlp", "args": {"hidden": HIDDEN}},
            "data": {"name": "digits"},
            "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
            "train": {"minibatch": MINIBATCH, "minibatches": 1 << 20, "nm": 1, "staleness": 0},
        },
        source="probe",
    )


def stage(
    job: JobSpec, state: dict[str, torch.Tensor], a: int, b: int, n_layers: int, speed: float
) -> StageCompute:
    """Layers ``[a, b)`` as the middle stage of three, its weights loaded."""
    task = StageTask.standalone(
        "probe", job.to_dict(), StageLayout(("probe",), a, b), stage=1, k=3, minibatches=1 << 20
    )
    c = StageCompute(task, DeviceSpec("d", "cpu", "fast", 1 << 34, speed, 0, "n", "h"))
    names = c.state_names()
    c.load({k: state[k] for k in names}, {k: [] for k in names})
    assert 0 < a < b < n_layers
    return c


def time_stage(
    c: StageCompute, x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor, repeats: int
) -> float:
    """Median padded forward + backward (as the stage's stats count them) + the unpadded
    optimizer step (which the backward's span holds), per minibatch."""
    out = []
    for p in range(repeats + 3):
        f0, b0 = c.stats.forward_s, c.stats.backward_s
        act = c.forward(p, x, y)
        c.copier.to_host({"x": act})
        g = c.backward(p, grad)
        c.copier.to_host({"g": g})
        t0 = time.perf_counter()
        c.step(p)
        step = time.perf_counter() - t0
        c.acc.clear()  # no pushes here: keep the accumulators from growing
        if p >= 3:
            out.append(c.stats.forward_s - f0 + c.stats.backward_s - b0 + step)
    return statistics.median(out)


def fit(rows: list[tuple[int, float, float]]) -> tuple[float, float]:
    """Least squares ``measured - predicted = a + (n - 1) b`` over (n, measured, predicted)."""
    a = np.array([[1.0, n - 1] for n, _, _ in rows])
    d = np.array([m - p for _, m, p in rows])
    (c0, c1), *_ = np.linalg.lstsq(a, d, rcond=None)
    return float(c0), float(c1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speed", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a worker computes (hetpipe-worker --threads 1)
    job = spec()
    data = load_dataset("digits")
    x0, y0 = data.train_x[:MINIBATCH].clone(), data.train_y[:MINIBATCH]
    loss = model_loss("mlp")

    def fresh() -> Any:
        torch.manual_seed(0)
        return build_model("mlp", {"hidden": HIDDEN})

    model = fresh()
    state = model.state_dict()
    n_layers = len(model)
    kw: dict[str, Any] = {
        "speed": args.speed,
        "loss_fn": lambda o: loss(o, y0),
        "repeats": 40,
        "budget_s": 20.0,
    }
    gross = measure_layers(fresh(), x0, **kw)
    got = measure_model(fresh(), x0, **kw)
    net = ModelProfile("mlp", MINIBATCH, 0, {"t": got.layers}, {"t": got.call})
    acts = [x0]
    with torch.no_grad():
        for layer in model:
            acts.append(layer(acts[-1]))
    print(
        f"load average {os.getloadavg()[0]:.2f}; speed {args.speed}; call term "
        f"fwd {got.call.fwd_s * 1e3:.3f} bwd {got.call.bwd_s * 1e3:.3f} "
        f"update {got.call.update_s * 1e3:.3f} ms"
    )
    print(
        f"{'n':>3}{'a':>3}{'stage ms':>10}{'gross ms':>10}{'ratio':>7}{'net ms':>9}{'ratio':>7}"
        f"{'unpadded ms':>13}{'ratio':>7}"
    )
    old: list[tuple[int, float, float]] = []
    new: list[tuple[int, float, float]] = []
    unpadded: list[tuple[int, float, float]] = []
    for n in args.sizes:
        for a in (1, 2):  # a stage starting on a Linear, and one on a ReLU
            b = a + n
            if b >= n_layers:
                continue
            c = stage(job, state, a, b, n_layers, args.speed)
            measured = time_stage(c, acts[a], y0, torch.ones_like(acts[b]), args.repeats)
            g = sum(lp.time_s for lp in gross[a:b])
            times = net.stage_times("t", a, b)
            t = times.time_s
            u = t - times.update_s * (1 - min(1.0, args.speed))
            old.append((n, measured, g))
            new.append((n, measured, t))
            unpadded.append((n, measured, u))
            print(
                f"{n:>3}{a:>3}{measured * 1e3:>10.3f}{g * 1e3:>10.3f}{measured / g:>7.2f}"
                f"{t * 1e3:>9.3f}{measured / t:>7.2f}{u * 1e3:>13.3f}{measured / u:>7.2f}"
            )
    rc = RuntimeCosts()

    def planner(x: float) -> float:
        return x + 2 * rc.task_s / min(1.0, args.speed)

    fits = (
        ("gross (sum of layers)", old),
        ("net + call term", new),
        ("net + call term, step unpadded", unpadded),
        ("the planner's compute from gross", [(n, m, planner(x)) for n, m, x in old]),
        ("the planner's compute from net", [(n, m, planner(x)) for n, m, x in new]),
    )
    for name, rows in fits:
        a0, b1 = fit(rows)
        print(f"fit vs {name}: stage - predicted = {a0 * 1e3:.3f} ms + (n - 1) x {b1 * 1e3:.3f} ms")
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
