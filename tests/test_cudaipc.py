"""Handles to GPU tensors from peers: checked before anything is opened (hetpipe.cudaipc).

The checks run everywhere; sharing itself needs a GPU and two processes (tests/test_cuda.py
runs four stages through it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hetpipe.cudaipc import parse
from hetpipe.wire import Kind, decode, encode


def handle(**over: Any) -> dict[str, Any]:
    """A well-formed handle map of a float32 [4, 8] tensor at the start of its storage."""
    d: dict[str, Any] = {
        "size": [4, 8],
        "stride": [8, 1],
        "offset": 0,
        "dtype": "float32",
        "device": 0,
        "handle": b"h" * 64,
        "nbytes": 128,
        "at": 0,
        "counter": b"/torch_1_2",
        "counter_at": 0,
        "event": b"e" * 64,
        "sync": True,
    }
    d.update(over)
    return d


def test_a_well_formed_handle_parses() -> None:
    s = parse(handle())
    assert (s.size, s.stride, s.dtype, s.nbytes) == ((4, 8), (8, 1), torch.float32, 128)
    assert parse(handle(event=None)).event is None


@pytest.mark.parametrize(
    "over,words",
    [
        ({"offset": 1}, "reaches past its storage"),
        ({"stride": [9, 1]}, "reaches past its storage"),
        ({"size": [4, 8, 1]}, "3 sizes but 2 strides"),
        ({"size": [-1, 8]}, "'size' must be a list"),
        ({"dtype": "complex128"}, "unknown dtype"),
        ({"dtype": 3}, "unknown dtype"),
        ({"handle": b""}, "'handle' must be"),
        ({"handle": "text"}, "'handle' must be"),
        ({"counter": b"x" * 5000}, "'counter' must be"),
        ({"device": -1}, "'device' must be a non-negative int"),
        ({"nbytes": True}, "'nbytes' must be a non-negative int"),
        ({"sync": 1}, "'sync' must be true or false"),
        ({"extra": 1}, "keys"),
    ],
)
def test_malformed_handles_are_refused_with_one_line(over: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words) as e:
        parse(handle(**over))
    assert "\n" not in str(e.value)


def test_not_a_map_is_refused() -> None:
    with pytest.raises(ValueError, match="expected a map"):
        parse([1, 2])


def test_a_handle_travels_in_the_header_of_an_activation() -> None:
    """The wire carries handles as a plain field of act/grad: no tensor frame, no pickle."""
    frames = encode(
        Kind.ACT, {"job": "j", "vw": 0, "p": 3, "ipc": {"x": handle()}}, {"y": torch.arange(4)}
    )
    msg = decode(frames)
    assert parse(msg["ipc"]["x"]).size == (4, 8)
    assert set(msg.tensors) == {"y"}
