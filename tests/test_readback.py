"""Scalars read back from a device in batches (hetpipe.readback)."""

from __future__ import annotations

import pytest
import torch

from hetpipe.readback import Readback


def test_values_come_back_in_order_in_whole_batches_and_all_when_blocking() -> None:
    rb = Readback("cpu", every=4)
    for i in range(10):
        rb.add(i, torch.tensor(float(i)))
    assert rb.ready() == [(i, float(i)) for i in range(8)]  # two closed batches
    assert len(rb) == 2
    assert rb.ready(block=True) == [(8, 8.0), (9, 9.0)]
    assert len(rb) == 0 and rb.ready(block=True) == []


def test_float32_and_bf16_read_back_exactly_and_a_double_keeps_its_last_bits() -> None:
    """Values travel in double: a float32 loss reads back as ``float()`` of it alone, and a
    ratio computed in double on the device is the one the host would compute."""
    rb = Readback("cpu", every=3)
    num, den = torch.tensor(0.1234567, dtype=torch.float32), torch.tensor(0.7654321)
    rb.add(0, num)
    rb.add(1, torch.tensor(1.0 / 3.0, dtype=torch.bfloat16))
    rb.add(2, num.double() / den.double())
    got = [v for _, v in rb.ready()]
    assert got == [
        float(num),
        float(torch.tensor(1.0 / 3.0, dtype=torch.bfloat16)),
        float(num) / float(den),
    ]


def test_a_batch_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="every must be >= 1"):
        Readback("cpu", every=0)
