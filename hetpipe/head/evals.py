"""The head's side of the validation passes virtual worker 0's pipeline runs while the job
trains (:mod:`hetpipe.evalpass`): the figures its last stage reports, taken in the order they
come, and the stages' weights for the best model.

A pass's figures come in a report whose stats hold ``evaluation = {"wave": c, "figures":
{...}, "seconds": s}``; with ``train.keep_best``, each stage's weights at a pass whose figures
improved come in a report holding ``evaluation = {"wave": c, "stage": s}`` and the tensors.
:class:`WorkerEvals` keeps both; :meth:`hetpipe.head.jobs.JobsPart._evaluate_every` takes the
figures one at a time (:meth:`WorkerEvals.next`) into the job's status, ``metrics.jsonl``,
``keep_best`` and ``stop_after_no_gain``, as it does the head's own figures where the workers
cannot run the pass.

Every report of a stage reaches the head before that stage's ``stage_done`` (one connection,
in order), so when the job's stages are all done every figure and weight sent is here; what
is still queued is taken before the job's final figures (:meth:`WorkerEvals.drain`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import torch

from hetpipe.evalpass import on_workers

__all__ = ["WEIGHTS_TIMEOUT_S", "WorkerEvals", "workers_evaluate"]

# how long the head waits for every stage's weights of a pass that improved keep_best
WEIGHTS_TIMEOUT_S = 120.0


def workers_evaluate(spec: Any, plan: Any) -> bool:
    """Whether the job's evaluations while training run on the workers
    (:func:`hetpipe.evalpass.on_workers`, from the job and its plan: the same rule its
    stages apply)."""
    return on_workers(
        sync=spec.sync,
        num_vws=len(plan.vws),
        ties=bool(plan.ties(0)),
        bn_recalibrate=spec.bn_recalibrate,
    )


class WorkerEvals:
    """The figures of one attempt's passes on the workers, and the stages' weights of the
    passes that improved ``train.keep_best`` (virtual worker 0's ``k`` stages)."""

    def __init__(self, k: int, of: Any = None) -> None:
        self.k = k
        self.of = of  # the attempt's plan: a new attempt starts afresh
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.weights: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
        self.arrived = asyncio.Event()
        self.taking: asyncio.Future[None] | None = None  # the evaluation being taken now

    def took(
        self, stage: int, evaluation: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
    ) -> None:
        """Keep a report of a pass (``ValueError``, one line, if malformed)."""
        try:
            wave = int(evaluation["wave"])
            if "figures" in evaluation:
                figures = {str(k): float(v) for k, v in dict(evaluation["figures"]).items()}
                seconds = float(evaluation.get("seconds", 0.0))
                self.queue.put_nowait(
                    {"wave": wave, "figures": figures, "seconds": seconds, "t": time.time()}
                )
                return
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a malformed validation report: {exc}") from None
        if not 0 <= stage < self.k or not tensors:
            raise ValueError(f"weights of stage {stage} of a pass at wave {wave}: not expected")
        self.weights.setdefault(wave, {})[stage] = dict(tensors)
        complete = [w for w, got in self.weights.items() if len(got) == self.k]
        for old in [w for w in self.weights if complete and w < max(complete)]:
            del self.weights[old]  # a later best is whole: the head writes that one
        self.arrived.set()

    def _superseded(self, wave: int) -> bool:
        return any(w > wave for w in self.weights)

    async def state(
        self, wave: int, timeout: float = WEIGHTS_TIMEOUT_S
    ) -> dict[str, torch.Tensor] | None:
        """Every stage's weights of the pass at ``wave``, as one state (by global names);
        those of earlier passes are dropped. None where a later pass's weights have begun to
        come: its figures improved too (the stages' verdicts are the head's), so that is the
        best model to write, and the head, behind the workers, skips this one.
        ``TimeoutError`` naming the stages missing."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(self.weights.get(wave, {})) < self.k:
            if self._superseded(wave):
                self.weights.pop(wave, None)
                return None
            self.arrived.clear()
            left = deadline - loop.time()
            try:
                await asyncio.wait_for(self.arrived.wait(), max(left, 0.0))
            except TimeoutError:
                missing = sorted(set(range(self.k)) - set(self.weights.get(wave, {})))
                raise TimeoutError(
                    f"the best model's weights of wave {wave} did not come from "
                    f"stage(s) {missing} of vw0 in {timeout:.0f} s"
                ) from None
        if self._superseded(wave):
            del self.weights[wave]
            return None
        got = self.weights.pop(wave)
        for old in [w for w in self.weights if w < wave]:
            del self.weights[old]
        state: dict[str, torch.Tensor] = {}
        for s in sorted(got):
            state.update(got[s])
        return state

    async def drain(self) -> list[dict[str, Any]]:
        """The job's end: wait for the evaluation being taken, and return those still
        queued, in order."""
        if self.taking is not None and not self.taking.done():
            await asyncio.wait({self.taking})
        out = []
        while not self.queue.empty():
            out.append(self.queue.get_nowait())
        return out
