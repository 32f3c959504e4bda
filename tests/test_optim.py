"""Out-of-place optimizer steps agree with torch.optim and never write into their inputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hetpipe.optim import StageOptimizer

SHAPES = {"w": (10, 5), "b": (5,), "k": (3, 4, 2)}


def spec(**fields: object) -> SimpleNamespace:
    """A duck-typed optimizer spec with OptimizerSpec's defaults."""
    base = {
        "name": "sgd",
        "lr": 0.05,
        "momentum": 0.0,
        "weight_decay": 0.0,
        "nesterov": False,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
    }
    return SimpleNamespace(**{**base, **fields})


def run_both(opt_spec: SimpleNamespace, steps: int = 100) -> float:
    """Max abs difference between StageOptimizer's weights and torch.optim's after ``steps``."""
    gen = torch.Generator().manual_seed(0)
    ours = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    ref = {k: v.clone().requires_grad_() for k, v in ours.items()}
    if opt_spec.name == "sgd":
        torch_opt: torch.optim.Optimizer = torch.optim.SGD(
            ref.values(),
            lr=opt_spec.lr,
            momentum=opt_spec.momentum,
            weight_decay=opt_spec.weight_decay,
            nesterov=opt_spec.nesterov,
        )
    else:
        torch_opt = (torch.optim.AdamW if opt_spec.name == "adamw" else torch.optim.Adam)(
            ref.values(),
            lr=opt_spec.lr,
            betas=opt_spec.betas,
            eps=opt_spec.eps,
            weight_decay=opt_spec.weight_decay,
        )
    opt = StageOptimizer(opt_spec)
    for _ in range(steps):
        grads = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
        for k, p in ref.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        new = opt.step(ours, grads)
        assert new.keys() == ours.keys()
        ours = new
    return max(float((ours[k] - ref[k].detach()).abs().max()) for k in ours)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_matches_torch(nesterov: bool) -> None:
    opt_spec = spec(name="sgd", lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=nesterov)
    assert run_both(opt_spec) <= 1e-6


def test_plain_sgd_matches_torch() -> None:
    assert run_both(spec(name="sgd", lr=0.1, weight_decay=1e-3)) <= 1e-6


@pytest.mark.parametrize("weight_decay", [0.0, 1e-4])
def test_adam_matches_torch(weight_decay: float) -> None:
    opt_spec = spec(name="adam", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    assert run_both(opt_spec) <= 1e-5


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2, 0.3])
def test_adamw_matches_torch(weight_decay: float) -> None:
    """Decoupled decay, built with torch's own expressions: equal to the last bit."""
    opt_spec = spec(name="adamw", lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    assert run_both(opt_spec) == 0.0


def test_adamw_decay_is_not_adams() -> None:
    """AdamW's decay is on the weight, not in the gradient: the two optimizers differ."""
    fields = {"lr": 1e-2, "weight_decay": 0.3}
    gen = torch.Generator().manual_seed(3)
    params = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    grads = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    a = StageOptimizer(spec(name="adam", **fields)).step(params, grads)
    aw = StageOptimizer(spec(name="adamw", **fields)).step(params, grads)
    assert max(float((a[k] - aw[k]).abs().max()) for k in a) > 1e-4


@pytest.mark.parametrize(
    "opt_spec",
    [
        spec(name="sgd"),
        spec(name="sgd", momentum=0.9, weight_decay=1e-4),
        spec(name="sgd", momentum=0.9, nesterov=True),
        spec(name="adam", weight_decay=1e-4),
        spec(name="adamw", weight_decay=1e-2),
    ],
)
def test_inputs_never_modified(opt_spec: SimpleNamespace) -> None:
    gen = torch.Generator().manual_seed(1)
    params = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    opt = StageOptimizer(opt_spec)
    for _ in range(3):
        grads = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
        p_before = {k: v.clone() for k, v in params.items()}
        g_before = {k: v.clone() for k, v in grads.items()}
        p_ptrs = {k: v.data_ptr() for k, v in params.items()}
        g_ptrs = {k: v.data_ptr() for k, v in grads.items()}
        new = opt.step(params, grads)
        for k, v in params.items():
            assert v.data_ptr() == p_ptrs[k] and torch.equal(v, p_before[k])
        for k, v in grads.items():
            assert v.data_ptr() == g_ptrs[k] and torch.equal(v, g_before[k])
        state_ptrs = {t.data_ptr() for s in opt.state.values() for t in s.values()}
        for k, w in new.items():
            assert w.shape == params[k].shape
            assert w.data_ptr() not in {p_ptrs[k], g_ptrs[k], *state_ptrs}
        # the next version is a new tensor; the old one stays alive unchanged
        params = new


def test_state_bytes_and_factor() -> None:
    params = {k: torch.zeros(s) for k, s in SHAPES.items()}
    grads = {k: torch.ones(s) for k, s in SHAPES.items()}
    param_bytes = sum(p.numel() * 4 for p in params.values())
    for opt_spec, factor in [
        (spec(name="sgd"), 0),
        (spec(name="sgd", momentum=0.9), 1),
        (spec(name="adam"), 2),
        (spec(name="adamw"), 2),
    ]:
        assert StageOptimizer.state_factor(opt_spec) == factor
        opt = StageOptimizer(opt_spec)
        assert opt.state_bytes() == 0
        opt.step(params, grads)
        assert opt.state_bytes() == factor * param_bytes


def test_none_gradient_is_skipped() -> None:
    params = {"a": torch.ones(2), "b": torch.ones(2)}
    new = StageOptimizer(spec(lr=0.5)).step(params, {"a": torch.ones(2), "b": None})
    assert list(new) == ["a"] and torch.equal(new["a"], torch.full((2,), 0.5))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"name": "rmsprop"}, "name"),
        ({"lr": -1.0}, "lr"),
        ({"nesterov": True}, "nesterov"),
        ({"momentum": -0.1}, "momentum"),
        ({"name": "adam", "betas": (1.0, 0.9)}, "betas"),
        ({"weight_decay": -1.0}, "weight_decay"),
    ],
)
def test_bad_spec(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StageOptimizer(spec(**fields))


def test_bad_gradients() -> None:
    opt = StageOptimizer(spec())
    with pytest.raises(ValueError, match="unknown parameter"):
        opt.step({"a": torch.ones(2)}, {"z": torch.ones(2)})
    with pytest.raises(ValueError, match="shape"):
        opt.step({"a": torch.ones(2)}, {"a": torch.ones(3)})


def _trained(opt_spec: SimpleNamespace, steps: int = 5) -> tuple[StageOptimizer, dict]:
    gen = torch.Generator().manual_seed(1)
    params = {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}
    opt = StageOptimizer(opt_spec)
    for _ in range(steps):
        params = opt.step(params, {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()})
    return opt, params


def test_predict_sgd_follows_the_momentum_buffer() -> None:
    opt, params = _trained(spec(momentum=0.9, weight_decay=1e-3))
    ahead = opt.predict(params, 3)
    for k, w in params.items():
        assert torch.equal(ahead[k], torch.add(w, opt.state[k]["momentum"], alpha=-3 * 0.05))
        assert ahead[k] is not w
    # nothing stale, or no step taken yet: the very same tensors
    assert all(opt.predict(params, 0)[k] is w for k, w in params.items())
    fresh = StageOptimizer(spec(momentum=0.9))
    assert all(fresh.predict(params, 4)[k] is w for k, w in params.items())


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_predict_adam_follows_its_own_step(name: str) -> None:
    """Adam's prediction is s times its bias-corrected step direction (not lr x gradient);
    with s = 1 and a repeated last step direction it is where Adam's next step would go if
    the moments did not move."""
    opt, params = _trained(spec(name=name, lr=0.01, weight_decay=0.1))
    ahead = opt.predict(params, 2)
    b1, b2 = opt.betas
    for k, w in params.items():
        st, n = opt.state[k], opt.steps[k]
        denom = (st["exp_avg_sq"].sqrt() / (1 - b2**n) ** 0.5) + opt.eps
        base = w * (1 - 0.01 * 0.1) ** 2 if name == "adamw" else w
        want = base - 2 * 0.01 / (1 - b1**n) * st["exp_avg"] / denom
        assert torch.allclose(ahead[k], want, rtol=1e-6, atol=1e-7)


def test_prediction_needs_a_direction() -> None:
    from hetpipe.optim import unpredictable

    assert "plain sgd" in unpredictable(spec())
    assert unpredictable(spec(momentum=0.9)) == ""
    assert unpredictable(spec(name="adam")) == ""


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_prediction_lands_nearer_the_weights_s_updates_later(name: str) -> None:
    """On a real descent (a least-squares fit, noisy minibatch gradients) the weights
    predicted s updates ahead are nearer the weights actually reached s updates later than
    the current ones are, for every s a pipeline of up to 8 stages asks."""
    gen = torch.Generator().manual_seed(1)
    x, w_true = torch.randn(512, 10, generator=gen), torch.randn(10, 3, generator=gen)
    y = x @ w_true + 0.1 * torch.randn(512, 3, generator=gen)
    opt = StageOptimizer(spec(name=name, lr=0.01 if name == "sgd" else 0.02, momentum=0.9))
    params = {"w": torch.zeros(10, 3)}
    trajectory = []
    for _ in range(120):
        idx = torch.randint(0, 512, (32,), generator=gen)
        w = params["w"].detach().requires_grad_()
        loss = ((x[idx] @ w - y[idx]) ** 2).mean()
        (grad,) = torch.autograd.grad(loss, w)
        trajectory.append(
            (
                {"w": w.detach()},
                {n: t.clone() for n, t in opt.state["w"].items()} if opt.state else None,
                dict(opt.steps),
            )
        )
        params = opt.step({"w": w.detach()}, {"w": grad})
    for s in range(1, 8):
        ratios = []
        for t in range(20, 120 - s):
            before, state, steps = trajectory[t]
            opt.state["w"], opt.steps = state, steps
            hat = opt.predict(before, s)["w"]
            later = trajectory[t + s][0]["w"]
            ratios.append(float((hat - later).norm() / (before["w"] - later).norm()))
        # well under 1 (standing still); a wrong sign or scale lands above it
        assert sum(ratios) / len(ratios) < 0.75, (s, sum(ratios) / len(ratios))
