"""A backward split in an input half and a weight half gives the whole backward's gradients
(hetpipe/splitbackward.py), whatever the graph's shape."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hetpipe.splitbackward import input_gradients, weight_gradients


def _weights(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in shapes]


def _mlp(x, w):
    h = torch.relu(x @ w[0].T + w[1])
    return h @ w[2].T + w[3] + x  # a residual: two paths from the input


def _shared(x, w):
    return torch.tanh(x @ w[0].T) @ w[0] + w[1]  # one weight used twice


def _norm(x, w):
    y = torch.nn.functional.layer_norm(x @ w[0].T, (x.shape[1],), w[1], w[2])
    return y * w[3].sum()  # a weight whose branch joins at the very end


def _checkpointed(x, w):
    return checkpoint(lambda x: torch.tanh(x @ w[0].T) @ w[1], x, use_reentrant=False)


CASES = {
    "mlp": (_mlp, [(6, 6), (6,), (6, 6), (6,)]),
    "shared": (_shared, [(6, 6), (6,)]),
    "norm": (_norm, [(6, 6), (6,), (6,), (3,)]),
    "checkpointed": (_checkpointed, [(6, 6), (6, 6)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("input_grad", [True, False])
def test_the_halves_give_the_whole_backward(case, input_grad):
    torch.manual_seed(0)
    f, shapes = CASES[case]
    w = _weights(*shapes)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=input_grad)
    out = f(x, w)
    g = torch.randn_like(out)
    want = torch.autograd.grad(out, ([x] if input_grad else []) + w, g)
    out = f(x, w)
    gx, kept = input_gradients([out], [g], [x], w)
    gw = weight_gradients(kept, w)
    got = ([gx[0]] if input_grad else []) + list(gw)
    assert gx[0] is None or input_grad
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    if not input_grad:  # no input path: every weight is differentiated from the output
        assert kept.rest == list(range(len(w)))


def test_a_loss_and_an_unused_weight():
    torch.manual_seed(1)
    w = _weights((6, 6), (6,), (2,))  # the last takes no part
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    loss = (x @ w[0].T + w[1]).pow(2).mean()
    gx, kept = input_gradients([loss], [torch.ones_like(loss)], [x], w)
    gw = weight_gradients(kept, w)
    loss = (x @ w[0].T + w[1]).pow(2).mean()
    want = torch.autograd.grad(loss, [x, w[0], w[1]])
    torch.testing.assert_close(gx[0], want[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(gw[0], want[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(gw[1], want[2], rtol=0, atol=1e-12)
    assert gw[2] is None
