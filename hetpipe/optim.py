"""Out-of-place optimizer steps for weight stashing.

A stage keeps every weight version an in-flight minibatch still needs as separate
tensors, so an update must never write into a parameter: :meth:`StageOptimizer.step`
returns a new weight tensor per parameter and leaves the weights and gradients it was given
untouched. The stage sums ``new - old`` over a wave and pushes that to the parameter server.

Optimizer state (momentum buffers, Adam moments, step counts) is not versioned: there is
one copy per stage, updated in place, exactly as ``torch.optim`` keeps it. The arithmetic
follows ``torch.optim.SGD`` (dampening 0, weight decay as L2 added to the gradient,
optional Nesterov), ``torch.optim.Adam`` (L2 weight decay, bias correction, ``eps``
added outside the square root) and ``torch.optim.AdamW`` (Adam with decoupled weight decay:
the weight shrinks by ``1 - lr * weight_decay`` before the Adam step, the gradient is not
touched).

The new weight is computed with the very expression torch uses (``add``/``addcdiv`` with
``alpha``), so a pipelined stage's weights equal a plain torch run's to the last bit: on
models where a rounding difference gets amplified (ties in max-pooling after ReLU), that is
what keeps a pipeline transparent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = ["OptimizerLike", "StageOptimizer", "grad_stats", "unpredictable"]


class OptimizerLike(Protocol):
    """The fields of ``hetpipe.job.OptimizerSpec`` this module reads."""

    name: str
    lr: float
    momentum: float
    weight_decay: float
    nesterov: bool
    betas: tuple[float, float]
    eps: float


NAMES = ("sgd", "adam", "adamw")


@torch.no_grad()
def grad_stats(grads: Mapping[str, Tensor]) -> tuple[float, bool]:
    """The squared L2 norm of ``grads`` together (float64 on the host) and whether all of
    their values are finite: what a stage contributes to its virtual worker's agreement on
    clipping and on skipping a step (one read back from the device per step).

    Each tensor's norm is taken as ``clip_grad_norm_`` takes it (float32 ``vector_norm``);
    their squares are summed in float64 in the order given. An inf or NaN anywhere makes the
    norm non-finite, so the norm says both.
    """
    if not grads:
        return 0.0, True
    norms = torch.stack([torch.linalg.vector_norm(g.detach()) for g in grads.values()])
    sq = sum(float(n) ** 2 for n in norms.double().tolist())
    return sq, math.isfinite(sq)


def unpredictable(spec: OptimizerLike) -> str:
    """Why :meth:`StageOptimizer.predict` cannot extrapolate this optimizer ("" if it can).

    Prediction follows the optimizer's own smoothed step direction; plain SGD keeps none
    (following the last raw gradient ``s`` times would amplify its noise).
    """
    if str(spec.name).lower() == "sgd" and float(spec.momentum) == 0.0:
        return "plain sgd (no momentum to follow): set optimizer.momentum > 0 or use adam"
    return ""


class StageOptimizer:
    """SGD, Adam or AdamW over one stage's named parameters, returning new weights out of
    place."""

    def __init__(self, spec: OptimizerLike) -> None:
        self.name = str(spec.name).lower()
        self.lr = float(spec.lr)
        self.momentum = float(spec.momentum)
        self.weight_decay = float(spec.weight_decay)
        self.nesterov = bool(spec.nesterov)
        beta1, beta2 = spec.betas
        self.betas = (float(beta1), float(beta2))
        self.eps = float(spec.eps)
        self._check()
        # name -> state tensors (sgd: momentum buffer; adam: exp_avg, exp_avg_sq)
        self.state: dict[str, dict[str, Tensor]] = {}
        self.steps: dict[str, int] = {}

    def _check(self) -> None:
        if self.name not in NAMES:
            raise ValueError(
                f"optimizer: name must be one of {', '.join(NAMES)}, got {self.name!r}"
            )
        if not self.lr >= 0.0:
            raise ValueError(f"optimizer: lr must be >= 0, got {self.lr}")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"optimizer: weight_decay must be >= 0, got {self.weight_decay}")
        if self.name == "sgd":
            if not self.momentum >= 0.0:
                raise ValueError(f"optimizer: momentum must be >= 0, got {self.momentum}")
            if self.nesterov and self.momentum == 0.0:
                raise ValueError("optimizer: nesterov needs momentum > 0")
        else:
            for i, beta in enumerate(self.betas):
                if not 0.0 <= beta < 1.0:
                    raise ValueError(f"optimizer: betas[{i}] must be in [0, 1), got {beta}")
            if not self.eps >= 0.0:
                raise ValueError(f"optimizer: eps must be >= 0, got {self.eps}")

    @staticmethod
    def state_factor(spec: Any) -> int:
        """Copies of optimizer state per parameter: sgd 0 (no momentum) or 1, adam(w) 2."""
        name = str(spec.name).lower()
        if name in ("adam", "adamw"):
            return 2
        if name == "sgd":
            return 1 if float(spec.momentum) != 0.0 else 0
        raise ValueError(f"optimizer: name must be one of {', '.join(NAMES)}, got {spec.name!r}")

    def state_bytes(self) -> int:
        """Bytes held in optimizer state now (grows to its full size after the first step)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values())

    @torch.no_grad()
    def predict(self, params: Mapping[str, Tensor], s: int) -> dict[str, Tensor]:
        """The weights ``s`` updates ahead if every update took the current step direction
        (weight prediction, the SpecTrain technique): new tensors, ``params`` only read.

        SGD with momentum: ``W - s * lr * buf``, ``buf`` the momentum buffer (the smoothed
        gradient the paper extrapolates; with weight decay it already holds the decay term).
        Adam and AdamW go beyond the paper: they follow Adam's own direction
        ``lr * m_hat / (sqrt(v_hat) + eps)`` with the current bias corrections (AdamW also
        shrinks by ``(1 - lr * wd) ** s``), since Adam's step is not ``lr`` times a gradient.
        A name without state yet (no step taken) is returned as it is.
        """
        if s <= 0 or not self.state:
            return dict(params)
        out = dict(params)
        if self.name == "sgd":
            names = [n for n in params if n in self.state]
            if names:
                new = torch._foreach_add(
                    [params[n] for n in names],
                    [self.state[n]["momentum"] for n in names],
                    alpha=-s * self.lr,
                )
                out.update(zip(names, new, strict=True))
            return out
        beta1, beta2 = self.betas
        for name, param in params.items():
            state = self.state.get(name)
            if state is None:
                continue
            step = self.steps[name]
            denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**step) ** 0.5).add_(self.eps)
            base = param
            if self.name == "adamw" and self.weight_decay:
                base = param.mul((1 - self.lr * self.weight_decay) ** s)
            out[name] = torch.addcdiv(
                base, state["exp_avg"], denom, value=-s * self.lr / (1 - beta1**step)
            )
        return out

    @torch.no_grad()
    def step(self, params: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """One step for every name in ``grads`` (a ``None`` gradient is skipped, as torch does).

        Returns ``{name: new weight}``; ``params`` and ``grads`` are only read.
        """
        new: dict[str, Tensor] = {}
        names = []
        for name, grad in grads.items():
            if grad is None:
                continue
            if name not in params:
                raise ValueError(f"optimizer: gradient for unknown parameter {name!r}")
            param = params[name]
            if grad.shape != param.shape:
                raise ValueError(
                    f"optimizer: gradient of {name!r} has shape {tuple(grad.shape)}, "
                    f"parameter has {tuple(param.shape)}"
                )
            names.append(name)
        if self.name == "sgd" and not self.nesterov:
            return self._sgd_all(names, params, grads)
        if self.name != "sgd" and names and len({self.steps.get(n, 0) for n in names}) == 1:
            return self._adam_all(names, params, grads, decoupled=self.name == "adamw")
        for name in names:
            if self.name == "sgd":
                new[name] = self._sgd(name, params[name], grads[name])
            else:
                new[name] = self._adam(
                    name, params[name], grads[name], decoupled=self.name == "adamw"
                )
        return new

    def _sgd_all(
        self, names: list[str], params: Mapping[str, Tensor], grads: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """SGD for all parameters with fused multi-tensor ops: the same arithmetic as
        :meth:`_sgd` element by element, with one kernel launch per step instead of one per
        parameter (small stages are dominated by per-op overhead otherwise)."""
        if not names:
            return {}
        ps = [params[n] for n in names]
        gs = [grads[n] for n in names]
        if self.weight_decay:
            gs = torch._foreach_add(gs, ps, alpha=self.weight_decay)
        if self.momentum:
            fresh = [i for i, n in enumerate(names) if n not in self.state]
            old = [i for i, n in enumerate(names) if n in self.state]
            if old:
                bufs = [self.state[names[i]]["momentum"] for i in old]
                torch._foreach_mul_(bufs, self.momentum)
                torch._foreach_add_(bufs, [gs[i] for i in old])
            for i in fresh:
                self.state[names[i]] = {"momentum": gs[i].clone()}
            gs = [self.state[n]["momentum"] for n in names]
        for n in names:
            self.steps[n] = self.steps.get(n, 0) + 1
        return dict(zip(names, torch._foreach_add(ps, gs, alpha=-self.lr), strict=True))

    def _adam_all(
        self,
        names: list[str],
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        *,
        decoupled: bool,
    ) -> dict[str, Tensor]:
        """Adam or AdamW for parameters at the same step count with fused multi-tensor ops:
        :meth:`_adam`'s expressions element by element (so its bits), a few kernel launches
        per step instead of a few per parameter."""
        beta1, beta2 = self.betas
        ps = [params[n] for n in names]
        gs = [grads[n] for n in names]
        if self.weight_decay and decoupled:
            ps = torch._foreach_mul(ps, 1 - self.lr * self.weight_decay)  # new tensors
        elif self.weight_decay:
            gs = torch._foreach_add(gs, ps, alpha=self.weight_decay)
        for n, p in zip(names, ps, strict=True):
            if n not in self.state:
                self.state[n] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        step = self.steps.get(names[0], 0) + 1
        for n in names:
            self.steps[n] = step
        exp_avg = [self.state[n]["exp_avg"] for n in names]
        exp_avg_sq = [self.state[n]["exp_avg_sq"] for n in names]
        torch._foreach_lerp_(exp_avg, gs, 1 - beta1)
        torch._foreach_mul_(exp_avg_sq, beta2)
        torch._foreach_addcmul_(exp_avg_sq, gs, gs, value=1 - beta2)
        step_size = self.lr / (1 - beta1**step)
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, (1 - beta2**step) ** 0.5)
        torch._foreach_add_(denom, self.eps)
        return dict(
            zip(names, torch._foreach_addcdiv(ps, exp_avg, denom, value=-step_size), strict=True)
        )

    def _sgd(self, name: str, param: Tensor, grad: Tensor) -> Tensor:
        g = grad.add(param, alpha=self.weight_decay) if self.weight_decay else grad
        if self.momentum:
            state = self.state.get(name)
            if state is None:
                buf = g.clone()
                self.state[name] = {"momentum": buf}
            else:
                buf = state["momentum"]
                buf.mul_(self.momentum).add_(g)
            g = g.add(buf, alpha=self.momentum) if self.nesterov else buf
        self.steps[name] = self.steps.get(name, 0) + 1
        return torch.add(param, g, alpha=-self.lr)

    def _adam(self, name: str, param: Tensor, grad: Tensor, *, decoupled: bool) -> Tensor:
        """Adam (L2 decay in the gradient) or, ``decoupled``, AdamW (decay on the weight)."""
        beta1, beta2 = self.betas
        g = grad
        if self.weight_decay and decoupled:
            param = param.mul(1 - self.lr * self.weight_decay)  # a new tensor: out of place
        elif self.weight_decay:
            g = grad.add(param, alpha=self.weight_decay)
        state = self.state.get(name)
        if state is None:
            state = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
            self.state[name] = state
        step = self.steps.get(name, 0) + 1
        self.steps[name] = step
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = self.lr / (1 - beta1**step)
        denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(self.eps)
        return torch.addcdiv(param, exp_avg, denom, value=-step_size)
