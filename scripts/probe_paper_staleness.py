"""Why hetpipe needs more minibatches than data parallelism on the paper's task: the update
rules of both sides replayed in one process, without the runtime, so that each cause can be
switched on and off alone.

One process, one torch thread, the model and the task of ``bench_paper.py`` (the same
builtins, splits, minibatch and SGD settings). Two ways:

- ``dp``: Horovod-style data parallelism with ``--world`` W ranks: every step, W minibatches
  (each its own forward, so batch norm normalises over one minibatch as on a rank) on the
  same weights, their gradients averaged, one SGD step with ``lr x W`` (``--dp-lr-scale``).
  Batch-norm statistics are rank 0's (its minibatch's update only), as DDP with
  ``broadcast_buffers=False`` keeps them.
- ``wsp``: ``--vws`` virtual workers of pipeline depth ``--nm`` under hetpipe's rules
  (DESIGN.md, "The pipeline inside a VW" and "WSP across VWs"), the virtual workers in
  lockstep (equal speeds, as the planner balances them): VW v's minibatch p runs its forward
  and backward on the weights its forward saw (weight stashing) and its optimizer step lands
  Nm - 1 minibatches later, so the forward of p sees its own updates up to p - Nm; the sum of
  a wave's updates goes to the global weights when its last step lands (``--merge sum``, or
  divided by the number of VWs with ``mean``); the pull of wave c leaves after the first step
  of wave c - 1 and is answered at once when the global clock allows it (it always does in
  lockstep: the VWs' waves up to c - 2 are in), and the local weights become the pulled
  global ones plus the VW's own updates not yet pushed. Each VW keeps its own momentum.
  Batch-norm running statistics move the global ones by the VWs' mean change, as the
  runtime does. ``--vws 1 --nm 1`` is plain sequential SGD.

Both evaluate the weights the runtime would (the global weights; DP: rank 0's) on the test
split every ``--eval-every`` minibatches (all ranks or VWs together) and report the first
count at which the test accuracy reaches the target.

    python scripts/probe_paper_staleness.py --model vgg19 --way wsp --vws 4 --nm 4 [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = {  # bench_paper.MODELS' model, task and learning rate
    "vgg19": {"name": "paper_vgg19", "args": {}, "image": 32, "noise": 1.5, "target": 0.8},
    "resnet152": {"name": "paper_resnet152", "args": {}, "image": 8, "noise": 1.0, "target": 0.6},
}
LR = {"vgg19": 0.005, "resnet152": 0.01}

State = dict[str, torch.Tensor]


class Task:
    """The model's structure, its initial weights, and the task's splits."""

    def __init__(
        self, key: str, seed: int, n_train: int, n_test: int, noise: float | None = None
    ) -> None:
        from hetpipe.models import build_model
        from hetpipe.papermodels import paper_images

        spec = MODELS[key] if noise is None else {**MODELS[key], "noise": noise}
        torch.manual_seed(seed)
        self.model = build_model(spec["name"], spec["args"])
        self.params: State = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.buffers: State = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        self.x, self.y = paper_images(n_train, spec["image"], noise=spec["noise"], seed=1)
        self.vx, self.vy = paper_images(n_test, spec["image"], noise=spec["noise"], seed=2)
        self.gen = torch.Generator().manual_seed(seed)
        self.order: list[int] = []
        self.epoch = 0

    def batch(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next minibatch of a random order over the epoch (every consumer draws in
        turn, so the ranks or VWs read disjoint parts of it)."""
        if len(self.order) < mb:
            self.order = torch.randperm(len(self.y), generator=self.gen).tolist()
            self.epoch += 1
        idx, self.order = self.order[:mb], self.order[mb:]
        return self.x[idx], self.y[idx]

    def grad(self, params: State, buffers: State, x: torch.Tensor, y: torch.Tensor) -> State:
        """The gradient at ``params`` (train mode: batch norm on the minibatch's statistics,
        its running statistics updated in ``buffers`` in place)."""
        live = {n: p.detach().requires_grad_() for n, p in params.items()}
        self.model.train()
        out = functional_call(self.model, {**live, **buffers}, (x,))
        loss = F.cross_entropy(out, y)
        grads = torch.autograd.grad(loss, list(live.values()))
        return dict(zip(live, grads, strict=True))

    @torch.no_grad()
    def accuracy(self, params: State, buffers: State) -> float:
        self.model.eval()
        right = 0
        for i in range(0, len(self.vy), 256):
            out = functional_call(self.model, {**params, **buffers}, (self.vx[i : i + 256],))
            right += int((out.argmax(1) == self.vy[i : i + 256]).sum())
        return right / len(self.vy)


def sgd(params: State, grads: State, mom: State, lr: float, momentum: float, wd: float) -> State:
    """torch.optim.SGD's step (L2 decay, momentum, no dampening) out of place; returns the
    update (new - old) and updates ``mom`` in place."""
    deltas = {}
    for n, g in grads.items():
        d = g + wd * params[n] if wd else g
        if momentum:
            if n in mom:
                mom[n].mul_(momentum).add_(d)
            else:
                mom[n] = d.clone()
            d = mom[n]
        deltas[n] = -lr * d
    return deltas


def run_dp(task: Task, a: argparse.Namespace) -> dict[str, Any]:
    params, buffers, mom = dict(task.params), dict(task.buffers), {}
    lr = a.lr * (a.world if a.dp_lr_scale is None else a.dp_lr_scale)
    curve, n = [], 0
    while n < a.max_mb:
        total: State = {}
        keep: State = {}
        for r in range(a.world):
            bufs = {k: b.clone() for k, b in buffers.items()}
            g = task.grad(params, bufs, *task.batch(a.minibatch))
            if r == 0:
                keep = bufs
            for k, t in g.items():
                total[k] = total[k] + t if k in total else t.clone()
        mean = {k: t / a.world for k, t in total.items()}
        deltas = sgd(params, mean, mom, lr, a.momentum, a.weight_decay)
        params = {k: params[k] + deltas.get(k, 0) for k in params}
        buffers = keep
        n += a.world
        if n % a.eval_every < a.world or n >= a.max_mb:
            curve.append([n, task.accuracy(params, buffers)])
            _progress(a, curve)
            if curve[-1][1] >= a.target:
                break
    return {"curve": curve}


def run_wsp(task: Task, a: argparse.Namespace) -> dict[str, Any]:
    V, nm = a.vws, a.nm
    g_params, g_buffers = dict(task.params), dict(task.buffers)
    local = [dict(g_params) for _ in range(V)]
    lbufs = [{k: b.clone() for k, b in g_buffers.items()} for _ in range(V)]
    mom: list[State] = [{} for _ in range(V)]
    acc: list[dict[int, State]] = [{} for _ in range(V)]  # unpushed wave -> its update
    pending: list[dict[int, tuple[State, State]]] = [{} for _ in range(V)]
    curve, n, t = [], 0, 0
    while n < a.max_mb:
        for v in range(V):  # the forward and backward of minibatch t (weights stashed)
            before = {k: b.clone() for k, b in lbufs[v].items()}
            g = task.grad(local[v], lbufs[v], *task.batch(a.minibatch))
            bd = {k: (lbufs[v][k] - before[k]) / V for k in before if before[k].is_floating_point()}
            pending[v][t] = (g, bd)
        j = t - nm + 1  # the minibatch whose step lands now
        if j >= 0:
            c = j // nm
            for v in range(V):
                g, bd = pending[v].pop(j)
                deltas = sgd(local[v], g, mom[v], a.lr, a.momentum, a.weight_decay)
                local[v] = {k: local[v][k] + deltas.get(k, 0) for k in local[v]}
                wave = acc[v].setdefault(c, {})
                for k, d in [*deltas.items(), *bd.items()]:
                    wave[k] = wave[k] + d if k in wave else d
            if j % nm == nm - 1:  # the wave's last step: every VW pushes it
                share = 1.0 / V if a.merge == "mean" else 1.0
                for v in range(V):
                    wave = acc[v].pop(c)
                    for k, d in wave.items():
                        if k in g_params:
                            g_params[k] = g_params[k] + share * d
                        else:
                            g_buffers[k] = g_buffers[k] + d
            if j % nm == 0 and (V > 1 or a.pull_alone):
                # the pull of wave c + 1, merged before its first forward (the next tick)
                for v in range(V):
                    own: State = {}
                    for wave in acc[v].values():
                        for k, d in wave.items():
                            own[k] = own[k] + d if k in own else d
                    local[v] = {k: g_params[k] + own.get(k, 0) for k in g_params}
                    lbufs[v] = {k: g_buffers[k] + own.get(k, 0) for k in g_buffers}
        t += 1
        n += V
        if n % a.eval_every < V or n >= a.max_mb:
            # one VW alone never pulls: its own weights are the model
            weights = (g_params, g_buffers) if V > 1 or a.pull_alone else (local[0], lbufs[0])
            curve.append([n, task.accuracy(*weights)])
            _progress(a, curve)
            if curve[-1][1] >= a.target:
                break
    return {"curve": curve}


def _progress(a: argparse.Namespace, curve: list[list[float]]) -> None:
    if a.progress:
        print(f"  {curve[-1][0]} {curve[-1][1]:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=list(MODELS), default="vgg19")
    ap.add_argument("--way", choices=["dp", "wsp"], default="wsp")
    ap.add_argument("--world", type=int, default=8, help="dp: ranks")
    ap.add_argument("--dp-lr-scale", type=float, default=None, help="dp: lr x this (default W)")
    ap.add_argument("--vws", type=int, default=4, help="wsp: virtual workers")
    ap.add_argument("--nm", type=int, default=4, help="wsp: minibatches in flight per VW")
    ap.add_argument("--merge", choices=["sum", "mean"], default="sum")
    ap.add_argument("--pull-alone", action="store_true", help="wsp, one VW: still pull")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--minibatch", type=int, default=32)
    ap.add_argument("--target", type=float, default=None)
    ap.add_argument("--max-mb", type=int, default=3000)
    ap.add_argument("--eval-every", type=int, default=32, help="minibatches between evals")
    ap.add_argument("--noise", type=float, default=None, help="the task's noise (default: model's)")
    ap.add_argument("--n-train", type=int, default=8192)
    ap.add_argument("--n-test", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", action="store_true", help="print every evaluation")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    a.lr = LR[a.model] if a.lr is None else a.lr
    a.target = MODELS[a.model]["target"] if a.target is None else a.target
    torch.set_num_threads(1)
    task = Task(a.model, a.seed, a.n_train, a.n_test, a.noise)
    t0 = time.perf_counter()
    r = (run_dp if a.way == "dp" else run_wsp)(task, a)
    hit = next((n for n, acc in r["curve"] if acc >= a.target), None)
    out = {
        "probe": "paper_staleness",
        **{k: v for k, v in vars(a).items() if k != "json"},
        "minibatches_to_target": hit,
        "best_accuracy": max(acc for _n, acc in r["curve"]),
        "curve": [[n, round(acc, 3)] for n, acc in r["curve"]],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(
        f"{a.model} noise {a.noise} {a.way} lr {a.lr} momentum {a.momentum}"
        + (f" W {a.world}" if a.way == "dp" else f" VWs {a.vws} Nm {a.nm} {a.merge}")
        + f" seed {a.seed}: {hit} minibatches to {a.target} (best {out['best_accuracy']:.3f}), "
        f"{out['seconds']} s",
        flush=True,
    )
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
