"""Discrete-event simulation of virtual workers under the runtime's exact rules.

Why simulate: a split's bottleneck says how fast a *full* pipeline runs, but not how Nm, the
links, and WSP waits between virtual workers (VWs) of different speed shape what a job gets.
The planner compares formations by what this simulator predicts.

Rules inside one VW (the same as the runtime's, see DESIGN "The pipeline inside a VW"):

* Minibatches are numbered p = 0, 1, ...; **admission**: p enters stage 0 only after p - Nm
  finished its backward at stage 0, so at most Nm are in flight.
* A stage runs one task at a time and **prefers a ready backward** over a ready forward;
  forwards run in minibatch order, and so do backwards.
* The **last stage** runs the backward of a minibatch right after its forward (one task).
* Each link between consecutive stages carries activations forward and gradients backward;
  each direction is a FIFO channel that moves one tensor at a time.

Rules across VWs (WSP, DESIGN "WSP across VWs"): wave c of a VW is minibatches
c*Nm .. (c+1)*Nm - 1. A stage **pushes** wave c when it finishes the backward of the wave's
last minibatch (taking ``push_s`` more of its time); a VW's clock is the number of waves every
one of its stages has pushed, the global clock the minimum over VWs. Before the first forward
of wave c >= 1 stage 0 waits until the global clock >= c - 1 - D. A VW that has finished its
minibatches no longer holds others back (its clock counts as infinite), as when the runtime
retires it.

Pulls, when a stage models them (``pull_s > 0``, several VWs): the stage sends the pull of
wave c as soon as the forward before it is done (a non-last stage whose next forward is
admitted), else when that forward is otherwise ready; the answer arrives ``pull_s`` after both
the pull was sent and the global clock allowed it, and the stage then spends ``merge_s``
loading the weights before the forward. Without pulls modelled, stage 0 passes the gate the
moment the clock allows it and no merge is charged (the ideal runtime).

Rates. ``vw_samples_per_s`` is each VW's steady rate: minibatches completed at stage 0 after
the first quarter (the pipeline's fill) and before the last Nm (the drain), divided by the
time they took. ``samples_per_s`` is
their sum, what a long job gets; ``job_samples_per_s`` is every sample of the simulated run
over its makespan (fill and drain included).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SimLink", "SimResult", "SimStage", "SimVW", "main", "simulate"]


@dataclass(frozen=True)
class SimStage:
    """Time of one stage per minibatch (forward, backward) and per wave (push, pull, merge)."""

    fwd_s: float
    bwd_s: float
    push_s: float = 0.0  # busy after the backward of a wave's last minibatch
    merge_s: float = 0.0  # busy before the forward of a wave's first minibatch (wave >= 1)
    pull_s: float = 0.0  # latency of a pull's answer; 0: pulls not modelled


@dataclass(frozen=True)
class SimLink:
    """Transfer time over the link after a stage: activations forward, gradients backward."""

    fwd_s: float = 0.0
    bwd_s: float = 0.0


@dataclass(frozen=True)
class SimVW:
    stages: tuple[SimStage, ...]
    nm: int
    links: tuple[SimLink, ...] = ()  # k - 1 links, or empty for free transfers
    minibatch: int = 1  # samples per minibatch
    name: str = ""

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a VW needs at least one stage")
        if self.nm < 1:
            raise ValueError(f"Nm must be >= 1, got {self.nm}")
        if self.links and len(self.links) != len(self.stages) - 1:
            raise ValueError(f"{len(self.stages)} stages need {len(self.stages) - 1} links")


@dataclass(frozen=True)
class SimResult:
    vw_samples_per_s: tuple[float, ...]
    samples_per_s: float
    job_samples_per_s: float
    makespan_s: float
    vw_finish_s: tuple[float, ...]
    busy: tuple[tuple[float, ...], ...]  # per VW, per stage: busy time / the VW's finish time
    gate_wait_s: tuple[float, ...]  # per VW: time stage 0 had a forward ready but WSP held it
    minibatches: int = 0  # per VW, as simulated

    def to_dict(self) -> dict[str, Any]:
        return {
            "vw_samples_per_s": list(self.vw_samples_per_s),
            "samples_per_s": self.samples_per_s,
            "job_samples_per_s": self.job_samples_per_s,
            "makespan_s": self.makespan_s,
            "vw_finish_s": list(self.vw_finish_s),
            "busy": [list(b) for b in self.busy],
            "gate_wait_s": list(self.gate_wait_s),
            "minibatches": self.minibatches,
        }


@dataclass
class _Stage:
    spec: SimStage
    idle: bool = True
    next_fwd: int = 0  # next minibatch to run forward (forwards are in order)
    arrived: int = 0  # minibatches whose input is here (stage > 0); in order
    grads: deque[int] = field(default_factory=deque)  # backwards ready, in order
    busy_s: float = 0.0
    pushed: int = 0  # waves pushed
    gate_since: float | None = None
    issued: dict[int, float] = field(default_factory=dict)  # wave -> time its pull was sent
    wake_at: float = -1.0  # when a pending pull's answer arrives (a WAKE event is queued)


@dataclass
class _VW:
    spec: SimVW
    stages: list[_Stage]
    link_free_f: list[float]
    link_free_b: list[float]
    done: int = 0  # backwards finished at stage 0 (in order)
    done_at: list[float] = field(default_factory=list)
    gate_wait: float = 0.0

    def clock(self, total: int) -> float:
        if self.done >= total:
            return math.inf
        return min(s.pushed for s in self.stages)


def simulate(vws: Sequence[SimVW], staleness: int, minibatches: int) -> SimResult:
    """Run every VW for ``minibatches`` minibatches under WSP with staleness ``staleness``."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if minibatches < 1:
        raise ValueError(f"minibatches must be >= 1, got {minibatches}")
    N, D = minibatches, staleness
    state = [
        _VW(
            v,
            [_Stage(s) for s in v.stages],
            [0.0] * (len(v.stages) - 1),
            [0.0] * (len(v.stages) - 1),
        )
        for v in vws
    ]
    events: list[tuple[float, int, int, int, int, int]] = []  # (time, seq, kind, vw, stage, p)
    seq = 0
    FREE, ARRIVE_F, ARRIVE_B, WAKE = 0, 1, 2, 3
    running: dict[tuple[int, int], tuple[str, int]] = {}
    glob = 0.0  # global clock
    glob_at = [0.0]  # glob_at[g]: when the global clock reached g

    def push(t: float, kind: int, v: int, s: int, p: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, v, s, p))

    def global_clock() -> float:
        return min(w.clock(N) for w in state)

    def dispatch(now: float, v: int, s: int) -> None:
        w = state[v]
        st = w.stages[s]
        if not st.idle:
            return
        k = len(w.stages)
        last = s == k - 1
        nm = w.spec.nm
        if st.grads and not last:
            if st.gate_since is not None:  # busy with a backward: not waiting meanwhile
                w.gate_wait += now - st.gate_since
                st.gate_since = None
            p = st.grads.popleft()
            st.idle = False
            running[v, s] = ("b", p)
            dur = st.spec.bwd_s + (st.spec.push_s if _ends_wave(p, nm, N) else 0.0)
            st.busy_s += dur
            push(now + dur, FREE, v, s, p)
            return
        p = st.next_fwd
        if p >= N:
            return
        ready = (p < w.done + nm) if s == 0 else (p < st.arrived)
        if not ready:
            return
        c = p // nm
        merge = 0.0
        if p % nm == 0 and c >= 1:
            need = c - 1 - D
            if s == 0 and glob < need:
                if st.gate_since is None:
                    st.gate_since = now
                return
            if st.spec.pull_s > 0:
                issued = st.issued.setdefault(c, now)
                clock_ok = glob_at[min(need, len(glob_at) - 1)] if need >= 0 else 0.0
                opens = max(issued, clock_ok) + st.spec.pull_s
                if now < opens:
                    if s == 0 and st.gate_since is None:
                        st.gate_since = now
                    if st.wake_at != opens:
                        st.wake_at = opens
                        push(opens, WAKE, v, s, p)
                    return
                merge = st.spec.merge_s
        if st.gate_since is not None:
            w.gate_wait += now - st.gate_since
            st.gate_since = None
        st.next_fwd += 1
        st.idle = False
        dur = merge + (st.spec.fwd_s + st.spec.bwd_s if last else st.spec.fwd_s)
        if last and _ends_wave(p, nm, N):
            dur += st.spec.push_s
        running[v, s] = ("fb" if last else "f", p)
        st.busy_s += dur
        push(now + dur, FREE, v, s, p)

    def link(free: list[float], i: int, now: float, dur: float) -> float:
        start = max(now, free[i])
        free[i] = start + dur
        return start + dur

    for v in range(len(state)):
        dispatch(0.0, v, 0)
    now = 0.0
    while events:
        now, _, kind, v, s, p = heapq.heappop(events)
        w = state[v]
        links = w.spec.links
        if kind == ARRIVE_F:
            w.stages[s].arrived += 1
            dispatch(now, v, s)
            continue
        if kind == ARRIVE_B:
            w.stages[s].grads.append(p)
            dispatch(now, v, s)
            continue
        if kind == WAKE:
            dispatch(now, v, s)
            continue
        what, _ = running.pop((v, s))
        st = w.stages[s]
        st.idle = True
        if what == "f":
            dur = links[s].fwd_s if links else 0.0
            push(link(w.link_free_f, s, now, dur), ARRIVE_F, v, s + 1, p)
            nxt = p + 1  # prefetch the pull of the next wave if its forward is admitted
            if nxt < N and nxt % w.spec.nm == 0 and (s > 0 or nxt < w.done + w.spec.nm):
                st.issued.setdefault(nxt // w.spec.nm, now)
        else:  # a backward finished ("b", or the last stage's "fb")
            if s > 0:
                dur = links[s - 1].bwd_s if links else 0.0
                push(link(w.link_free_b, s - 1, now, dur), ARRIVE_B, v, s - 1, p)
            else:
                w.done += 1
                w.done_at.append(now)
            nm = w.spec.nm
            if p % nm == nm - 1:
                st.pushed = p // nm + 1
            if p % nm == nm - 1 or (s == 0 and w.done >= N):
                g = global_clock()
                if g > glob:
                    glob = g
                    while len(glob_at) <= min(g, N):
                        glob_at.append(now)
                    for u in range(len(state)):
                        for j in range(len(state[u].stages)):
                            dispatch(now, u, j)
        dispatch(now, v, s)
    finish = tuple(w.done_at[-1] if w.done_at else 0.0 for w in state)
    makespan = max(finish)
    rates = []
    for w in state:
        # steady window: after the fill (first quarter), before the drain (the last Nm
        # complete with no forwards left to interleave, faster than the steady state)
        lo = N // 4
        hi = max(lo + 1, N - w.spec.nm)
        t0 = w.done_at[lo - 1] if lo > 0 else 0.0
        span = w.done_at[hi - 1] - t0
        rates.append((hi - lo) * w.spec.minibatch / span if span > 0 else math.inf)
    total = sum(N * w.spec.minibatch for w in state)
    return SimResult(
        tuple(rates),
        sum(rates),
        total / makespan if makespan > 0 else math.inf,
        makespan,
        finish,
        tuple(
            tuple(st.busy_s / f if f > 0 else 0.0 for st in w.stages)
            for w, f in zip(state, finish, strict=True)
        ),
        tuple(w.gate_wait for w in state),
        N,
    )


def _ends_wave(p: int, nm: int, n: int) -> bool:
    """Whether minibatch ``p`` is the last of its wave (or of the run): a push follows it."""
    return p % nm == nm - 1 or p == n - 1


# ------------------------------------------------------------------------------- CLI


def _vw_from_json(d: dict[str, Any], i: int) -> SimVW:
    def pair(x: Any, a: str, b: str) -> tuple[float, float]:
        if isinstance(x, dict):
            return float(x[a]), float(x[b])
        f, g = x
        return float(f), float(g)

    def stage(x: Any) -> SimStage:
        if isinstance(x, dict):
            extra = {k: float(x[k]) for k in ("push_s", "merge_s", "pull_s") if k in x}
            return SimStage(float(x["fwd_s"]), float(x["bwd_s"]), **extra)
        return SimStage(*pair(x, "fwd_s", "bwd_s"))

    stages = tuple(stage(x) for x in d["stages"])
    links = tuple(SimLink(*pair(x, "fwd_s", "bwd_s")) for x in d.get("links", ()))
    return SimVW(
        stages, int(d.get("nm", 1)), links, int(d.get("minibatch", 1)), d.get("name", f"vw{i}")
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hetpipe.planner.simulate",
        description="Simulate virtual workers (pipelines under asynchronous 1F1B) coupled by "
        "Wave Synchronous Parallel, and print their predicted throughput.",
        epilog='Input JSON: {"staleness": 0, "minibatches": 64, "vws": [{"nm": 4, '
        '"minibatch": 32, "stages": [[fwd_s, bwd_s], ...], "links": [[fwd_s, bwd_s], ...]}]}',
    )
    ap.add_argument("description", help="JSON file describing the VWs ('-' reads stdin)")
    ap.add_argument("--staleness", "-D", type=int, help="override the file's staleness D")
    ap.add_argument("--minibatches", "-n", type=int, help="override minibatches per VW")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    try:
        if args.description == "-":
            text = sys.stdin.read()
        else:
            with open(args.description) as fh:
                text = fh.read()
        desc = json.loads(text)
        vws = [_vw_from_json(x, i) for i, x in enumerate(desc["vws"])]
        D = args.staleness if args.staleness is not None else int(desc.get("staleness", 0))
        N = args.minibatches if args.minibatches is not None else int(desc.get("minibatches", 64))
        res = simulate(vws, D, N)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"simulate: {args.description}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res.to_dict()))
        return 0
    print(f"{'vw':<8}{'stages':>7}{'Nm':>4}{'samples/s':>12}{'gate wait s':>13}  busy per stage")
    for v, spec in enumerate(vws):
        busy = " ".join(f"{b:.0%}" for b in res.busy[v])
        print(
            f"{spec.name:<8}{len(spec.stages):>7}{spec.nm:>4}{res.vw_samples_per_s[v]:>12.1f}"
            f"{res.gate_wait_s[v]:>13.3f}  {busy}"
        )
    print(
        f"total {res.samples_per_s:.1f} samples/s steady; {res.job_samples_per_s:.1f} over the "
        f"whole run of {res.makespan_s:.3f}s (D={D}, {N} minibatches per VW)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
