"""What one stage saves at a checkpoint's cut and restores from it.

The state is the stage's weight versions (:class:`hetpipe.versions.WeightVersions`) seen as
plain data and CPU tensors under the names :mod:`hetpipe.checkpoint` stores (``param/``,
``buffer/``, ``local/``, ``opt/<key>/``, ``acc/<wave>/``). The compute
(:meth:`hetpipe.stage.StageCompute.state` and ``load_state``) calls these on its compute
thread; they live apart from it because which tensors a cut holds, and how a resumed stage
takes them back, is the checkpoint's rule, not the compute's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hetpipe.versions import WeightVersions

__all__: list[str] = []


def save(wv: WeightVersions, wave: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The state of the stage holding ``wv`` at the cut ``wave``, taken right after its push
    of ``wave - 1``: plain data, and CPU copies of its tensors.

    Forwards of wave ``wave`` may be in flight (stage 0 admits them before that push); a
    resumed job runs them again, so what they changed (batch-norm statistics, in the
    accumulator of their wave) is taken out of the buffers here: the state is that of the
    stage with its pipeline drained at the cut, and a resumed job differs from one never
    stopped only in that those forwards run again on the newest weights, as after a flush.
    The accumulators kept (pushed, not yet seen applied in a pull) are saved to be checked
    against the shards' cut; nothing of a wave < ``wave`` is unpushed at this point.
    """
    n = wv.num_vws
    later: dict[str, torch.Tensor] = {}  # local changes of waves >= wave, as applied here
    with torch.no_grad():
        for w, acc in wv.acc.items():
            if w < wave:
                continue
            for name, d in acc.items():
                raw = d * n if (name in wv.buffers and d.is_floating_point() and n > 1) else d
                later[name] = later[name] + raw if name in later else raw

        def copy(name: str, t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if name in later:
                t = t - later[name].to(t.dtype)
            return t.to("cpu", copy=True)

        tensors = {f"param/{k}": copy(k, t) for k, t in wv.params.items()}
        tensors.update({f"buffer/{k}": copy(k, t) for k, t in wv.buffers.items()})
        tensors.update({f"local/{k}": copy(k, t) for k, t in wv.local.items()})
        for k, st in wv.optimizer.state.items():
            tensors.update(
                {f"opt/{key}/{k}": t.detach().to("cpu", copy=True) for key, t in st.items()}
            )
        for w, acc in wv.acc.items():
            if w < wave:
                tensors.update(
                    {f"acc/{w}/{k}": t.detach().to("cpu", copy=True) for k, t in acc.items()}
                )
    meta = {
        "wave": wave,
        "version": wv.version,
        "steps_taken": wv.steps_taken,
        "optimizer": wv.optimizer.name,
        "opt_steps": {k: int(v) for k, v in wv.optimizer.steps.items()},
        "kept_waves": sorted(w for w in wv.acc if w < wave),
    }
    return meta, tensors


def restore(
    wv: WeightVersions,
    meta: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    *,
    weights: bool,
    where: str,
) -> None:
    """Start ``wv`` from a checkpointed state (:func:`save`, or optimizer state put together
    per name from several stages of an earlier plan); ``where`` names the stage in errors.

    Optimizer state is taken for every parameter of this stage it names (the step count
    with it). With ``weights`` the local weights, buffers and non-persistent buffers are
    the checkpoint's too, all of them (a stage whose layers moved takes its weights from
    the shards instead). Kept accumulators are not taken: the checkpoint's cut holds every
    one of them (the head checks its applied sets), and the shards of a resumed attempt
    count waves afresh.
    """
    optimizer = wv.optimizer
    steps = meta.get("opt_steps", {})
    if meta.get("optimizer", optimizer.name) != optimizer.name:
        raise ValueError(
            f"{where}: the checkpoint's optimizer is "
            f"{meta.get('optimizer')}, the job's {optimizer.name}"
        )
    params, buffers, local = {}, {}, {}
    for key, t in tensors.items():
        kind, _, rest = key.partition("/")
        if kind == "opt":
            okey, _, name = rest.partition("/")
            if name in wv.param_names:
                optimizer.state.setdefault(name, {})[okey] = t.to(wv.dev, copy=True)
                optimizer.steps[name] = int(steps.get(name, 0))
        elif kind == "param" and rest in wv.param_names:
            params[rest] = t
        elif kind == "buffer" and rest in wv.buffer_names:
            buffers[rest] = t
        elif kind == "local" and rest in wv.local:
            local[rest] = t
    if not weights:
        return
    missing = [n for n in wv.param_names if n not in params] + [
        n for n in wv.buffer_names if n not in buffers
    ]
    if missing:
        raise ValueError(f"{where}: the checkpoint has no {missing[:3]}")
    wv.params = {
        n: params[n].to(wv.dev, copy=True).requires_grad_(n not in wv.layout.frozen)
        for n in wv.param_names
    }
    wv.buffers = {n: buffers[n].to(wv.dev, copy=True) for n in wv.buffer_names}
    wv.local.update({n: t.to(wv.dev, copy=True) for n, t in local.items()})
    wv.version = int(meta.get("version", 0))
    wv.steps_taken = int(meta.get("steps_taken", 0))
