"""Tests of the wire protocol: round trips, zero copy, every validation error, fuzzing, sockets."""

from __future__ import annotations

import gc
import random
import re
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq

from hetpipe.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    SCHEMAS,
    ZERO_COPY_MIN_BYTES,
    Field,
    Kind,
    Message,
    WireError,
    decode,
    encode,
    error_frames,
    frames_nbytes,
)

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]
ACT_FIELDS = {"job": "j", "vw": 0, "p": 3}


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality, shape and dtype included (NaN payloads too)."""
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)


def _address(buf: Any) -> tuple[int, int]:
    """Start address and length of a buffer's memory."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data, arr.nbytes


def _inside(t: torch.Tensor, buf: Any) -> bool:
    start, n = _address(buf)
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + n


def _raw(header: Any, *data: bytes) -> list[bytes]:
    return [msgpack.packb(header, use_bin_type=True), *data]


def _header(**over: Any) -> dict[str, Any]:
    """A valid act header with one float32[3, 4] tensor "x" in frame 1."""
    h: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "kind": "act",
        "f": dict(ACT_FIELDS),
        "t": [{"name": "x", "dtype": "float32", "shape": [3, 4], "frame": 1}],
    }
    h.update(over)
    return h


def _desc(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"name": "x", "dtype": "float32", "shape": [3, 4], "frame": 1}
    d.update(over)
    return d


def _raises(frames: Any, message: str, **kw: Any) -> WireError:
    with pytest.raises(WireError, match=re.escape(message)) as info:
        decode(frames, **kw)
    assert "\n" not in str(info.value)
    return info.value


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_every_dtype(dtype: torch.dtype) -> None:
    t = _random((5, 7), dtype)
    m = decode(encode(Kind.ACT, ACT_FIELDS, {"x": t}))
    assert m.kind is Kind.ACT and m.fields == ACT_FIELDS
    assert _same(m.tensors["x"], t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_large_every_dtype(dtype: torch.dtype) -> None:
    t = _random((300, 257), dtype)  # >= 64 KiB for most dtypes: the zero-copy path
    assert _same(decode(encode("grad", ACT_FIELDS, {"g": t})).tensors["g"], t)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (0, 0)])
def test_empty_tensors(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = torch.empty(shape, dtype=dtype)
    frames = encode("act", ACT_FIELDS, {"x": t})
    assert bytes(frames[1]) == b""
    out = decode(frames).tensors["x"]
    assert out.shape == t.shape and out.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_dim_tensors(dtype: torch.dtype) -> None:
    t = _random((), dtype)
    out = decode(encode("act", ACT_FIELDS, {"y": t})).tensors["y"]
    assert out.dim() == 0 and _same(out, t)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(60.0).reshape(6, 10).t(),
        lambda: torch.arange(100, dtype=torch.int32)[3::7],
        lambda: torch.arange(120.0).reshape(4, 5, 6)[1:3, :, ::2],
        lambda: torch.randn(1, 6).expand(5, 6),
        lambda: torch.randn(512, 256).t(),  # large and transposed
        lambda: torch.randn(4, 4).bfloat16().t(),
    ],
    ids=["transposed", "strided", "sliced", "expanded", "large-transposed", "bf16-transposed"],
)
def test_non_contiguous(make: Any) -> None:
    t = make()
    assert not t.is_contiguous()
    out = decode(encode("act", ACT_FIELDS, {"x": t})).tensors["x"]
    assert out.is_contiguous() and _same(out, t)


def test_requires_grad_and_storage_offset() -> None:
    base = torch.randn(100, requires_grad=True)
    t = base[10:30]
    assert _same(decode(encode("act", ACT_FIELDS, {"x": t})).tensors["x"], t.detach())


def test_bf16_bit_exact_all_patterns() -> None:
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    t = bits.view(torch.bfloat16)  # every bf16 pattern: NaNs, infs, subnormals, -0
    out = decode(encode("act", ACT_FIELDS, {"x": t})).tensors["x"]
    assert out.dtype is torch.bfloat16
    assert torch.equal(out.view(torch.int16), bits)


def test_many_tensors_keep_order_and_fields() -> None:
    tensors = {f"layer{i}.weight": _random((i + 1, 3), torch.float32, i) for i in range(10)}
    frames = encode("push", {"rid": 1, "job": "j", "vw": 2, "stage": 1, "wave": 4}, tensors)
    m = decode(frames)
    assert list(m.tensors) == list(tensors)
    assert all(_same(m.tensors[k], v) for k, v in tensors.items())
    assert m["wave"] == 4 and m.get("nope", 7) == 7 and m.get("vw") == 2
    assert isinstance(m, Message)


def test_every_kind_round_trips() -> None:
    samples = {
        str: "s",
        int: -3,
        float: 2.5,
        dict: {"a": [1, {"b": None, "c": b"\x00"}], "d": 1.5, "e": True},
        list: [1, "x", {"y": [2.0]}],
    }
    for kind, schema in SCHEMAS.items():
        fields = {name: samples[f.type] for name, f in schema.items()}  # type: ignore[index]
        m = decode(encode(kind, fields))
        assert m.kind is kind and m.fields == fields and m.tensors == {}
        required = {name: v for name, v in fields.items() if schema[name].required}
        assert decode(encode(kind.value, required)).fields == required


def test_every_kind_has_a_schema() -> None:
    assert set(SCHEMAS) == set(Kind)
    assert all(isinstance(f, Field) for s in SCHEMAS.values() for f in s.values())


def test_int_accepted_for_float_and_delivered_as_float() -> None:
    frames = encode("welcome", {"heartbeat_s": 1, "lost_after_s": 5.0})
    m = decode(frames)
    assert m["heartbeat_s"] == 1.0 and isinstance(m["heartbeat_s"], float)
    m = decode(_raw({"v": 1, "kind": "welcome", "f": {"heartbeat_s": 2, "lost_after_s": 3}}))
    assert isinstance(m["heartbeat_s"], float) and isinstance(m["lost_after_s"], float)


def test_optional_none_is_dropped_and_tuple_passes_for_list() -> None:
    m = decode(encode("heartbeat", {"device": "d", "state": "idle", "job": None, "vw": None}))
    assert m.fields == {"device": "d", "state": "idle"}
    m = decode(encode("pulled", {"rid": 1, "clock": 2, "vw_clock": 3, "applied": (1, 2)}))
    assert m["applied"] == [1, 2]


def test_error_frames() -> None:
    m = decode(error_frames("stage 2 ran out of memory", rid=9))
    assert m.kind is Kind.ERROR and m.fields == {"message": "stage 2 ran out of memory", "rid": 9}
    assert decode(error_frames("no rid")).fields == {"message": "no rid"}
    assert all(isinstance(f, bytes) for f in error_frames("x"))


def test_frames_nbytes() -> None:
    t = torch.randn(256, 256)
    frames = encode("act", ACT_FIELDS, {"x": t, "y": torch.arange(4)})
    expected = len(frames[0]) + t.numel() * 4 + 32
    assert frames_nbytes(frames) == expected
    assert frames_nbytes([zmq.Frame(b"abc"), b"de", bytearray(b"f"), memoryview(b"gh")]) == 8


# --------------------------------------------------------------------------- zero copy


def test_encode_is_zero_copy_and_keeps_tensor_alive() -> None:
    t = torch.randn(1024, 1024)  # 4 MiB
    ptr = t.data_ptr()
    expected = t.clone()
    frames = encode("act", ACT_FIELDS, {"x": t})
    assert isinstance(frames[1], memoryview)
    assert _address(frames[1]) == (ptr, 4 << 20)
    del t
    gc.collect()
    torch.randn(1024, 1024)  # would likely reuse freed memory if the frame did not pin it
    assert _same(decode(frames).tensors["x"], expected)


def test_small_tensors_are_copied_on_encode() -> None:
    frames = encode("act", ACT_FIELDS, {"x": torch.randn(4)})
    assert isinstance(frames[1], bytes)
    assert ZERO_COPY_MIN_BYTES == 64 * 1024


def test_decode_from_bytes_is_zero_copy() -> None:
    t = torch.randn(1024, 1024)
    frames = [bytes(f) for f in encode("act", ACT_FIELDS, {"x": t})]
    out = decode(frames).tensors["x"]
    assert _inside(out, frames[1]) and _same(out, t)


def test_decode_from_zmq_frame_is_zero_copy() -> None:
    t = torch.randn(1024, 1024).bfloat16()
    frames = [zmq.Frame(bytes(f)) for f in encode("act", ACT_FIELDS, {"x": t})]
    out = decode(frames).tensors["x"]
    assert _inside(out, frames[1].buffer) and _same(out, t)
    del frames
    gc.collect()
    assert _same(out, t)  # the tensor keeps its frame alive


def test_small_tensors_are_copied_on_decode() -> None:
    t = torch.randn(8)
    frames = [bytes(f) for f in encode("act", ACT_FIELDS, {"x": t})]
    out = decode(frames).tensors["x"]
    assert not _inside(out, frames[1]) and _same(out, t)


def test_misaligned_frame_is_copied_and_correct() -> None:
    t = torch.randn(64, 1024, dtype=torch.float64)
    frames = encode("act", ACT_FIELDS, {"x": t})
    padded = b"\x00" + bytes(frames[1])
    out = decode([frames[0], memoryview(padded)[1:]]).tensors["x"]
    assert out.data_ptr() % 8 == 0 and _same(out, t)


def test_decode_does_not_warn_about_read_only_buffers() -> None:
    import warnings

    frames = [bytes(f) for f in encode("act", ACT_FIELDS, {"x": torch.randn(256, 256)})]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decode(frames)


# --------------------------------------------------------------------------- encode rejects


@pytest.mark.parametrize(
    ("kind", "fields", "message"),
    [
        ("nope", {}, "unknown message kind 'nope'"),
        (3, {}, "message kind must be a str, got int"),
        ("act", {"job": "j", "vw": 0}, "act: missing required field 'p'"),
        ("act", {**ACT_FIELDS, "vw": "0"}, "act: field 'vw' expects int, got str"),
        ("act", {**ACT_FIELDS, "vw": True}, "act: field 'vw' expects int, got bool"),
        ("act", {**ACT_FIELDS, "vw": 1.0}, "act: field 'vw' expects int, got float"),
        ("act", {**ACT_FIELDS, "vw": np.int64(1)}, "act: field 'vw' expects int, got int64"),
        ("act", {**ACT_FIELDS, "zz": 1}, "act: unexpected field 'zz'"),
        ("act", {**ACT_FIELDS, "vw": None}, "act: field 'vw' expects int, got NoneType"),
        ("act", {**ACT_FIELDS, "p": 1 << 64}, "act: field 'p': integer"),
        ("welcome", {"heartbeat_s": "1", "lost_after_s": 1.0}, "expects float, got str"),
        ("welcome", {"heartbeat_s": True, "lost_after_s": 1.0}, "expects float, got bool"),
        ("submit", {"rid": 1, "job": []}, "submit: field 'job' expects dict, got list"),
        ("submit", {"rid": 1, "job": {"a": {1, 2}}}, "set at job['a'] is not plain msgpack"),
        ("submit", {"rid": 1, "job": {1: "x"}}, "map key 1 at job is not a str"),
        ("submit", {"rid": 1, "job": {"a": [{b"k": 1}]}}, "map key b'k' at job['a'][0]"),
        ("submit", {"rid": 1, "job": {"t": torch.zeros(1)}}, "Tensor at job['t'] is not plain"),
        ("submit", {"rid": 1, "job": {"n": -(1 << 63) - 1}}, "integer at job['n'] is out of"),
        (
            "stage_done",
            {"job": "j", "vw": 0, "stage": 0, "stats": {}, "records": "x"},
            "stage_done: field 'records' expects list, got str",
        ),
    ],
)
def test_encode_rejects_bad_fields(kind: Any, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(WireError, match=re.escape(message)):
        encode(kind, fields)


def test_encode_rejects_deep_nesting() -> None:
    deep: Any = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(WireError, match="nested deeper than 64"):
        encode("submit", {"rid": 1, "job": {"x": deep}})


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"x": torch.zeros(2, dtype=torch.complex64)}, "tensor 'x': dtype torch.complex64 is not"),
        ({"x": torch.zeros(2, dtype=torch.int16)}, "tensor 'x': dtype torch.int16 is not"),
        ({"x": [1.0, 2.0]}, "tensor 'x' is a list, not a torch.Tensor"),
        ({"x": torch.zeros((1,) * 17)}, "tensor 'x': 17 dims, at most 16"),
        ({1: torch.zeros(1)}, "tensor name 1 is not a str"),
        ({"x": torch.eye(3).to_sparse()}, "tensor 'x': layout torch.sparse_coo is not supported"),
    ],
)
def test_encode_rejects_bad_tensors(tensors: dict[Any, Any], message: str) -> None:
    with pytest.raises(WireError, match=re.escape(message)):
        encode("act", ACT_FIELDS, tensors)


def test_encode_rejects_oversized_header() -> None:
    with pytest.raises(
        WireError, match=r"header is \d+ bytes, over the " + str(MAX_HEADER_BYTES) + "-byte limit"
    ):
        encode("submit", {"rid": 1, "job": {"blob": "x" * MAX_HEADER_BYTES}})


# --------------------------------------------------------------------------- decode rejects


def test_valid_header_helper_decodes() -> None:
    m = decode(_raw(_header(), bytes(48)))
    assert m.tensors["x"].shape == (3, 4)


def test_no_frames() -> None:
    _raises([], "empty message: no frames")


def test_header_too_big() -> None:
    _raises(
        [b"\x80" * (MAX_HEADER_BYTES + 1)],
        f"header is {MAX_HEADER_BYTES + 1} bytes, over the {MAX_HEADER_BYTES}-byte",
    )


@pytest.mark.parametrize(
    "junk",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"\x93\x01\x02",  # truncated array
        msgpack.packb(1) + msgpack.packb(2),  # extra data
        b"\xa3\xff\xfe\xfd",  # str that is not UTF-8
        msgpack.packb({1: 2}),  # int map key
        msgpack.packb({"a": msgpack.ExtType(5, b"xx")}),  # extension type
        b"\x91" * 5000,  # nested too deep for the unpacker
    ],
)
def test_header_not_msgpack(junk: bytes) -> None:
    _raises([junk], "header is not valid msgpack")


def test_header_not_a_map() -> None:
    _raises(_raw([1, 2]), "header is not a map (got list)")
    _raises(_raw("act"), "header is not a map (got str)")


def test_missing_version() -> None:
    h = _header()
    del h["v"]
    _raises(_raw(h, bytes(48)), "header has no protocol version 'v'")


def test_wrong_version() -> None:
    _raises(_raw(_header(v=7), bytes(48)), "protocol version 7, this process speaks 1")
    _raises(_raw(_header(v="1"), bytes(48)), "protocol version '1', this process speaks 1")
    _raises(_raw(_header(v=True), bytes(48)), "protocol version True, this process speaks 1")


def test_unexpected_header_key() -> None:
    _raises(_raw(_header(extra=1), bytes(48)), "header has unexpected key 'extra'")


def test_missing_kind() -> None:
    h = _header()
    del h["kind"]
    _raises(_raw(h, bytes(48)), "header has no 'kind'")


def test_unknown_kind() -> None:
    _raises(_raw(_header(kind="frobnicate"), bytes(48)), "unknown message kind 'frobnicate'")
    _raises(_raw(_header(kind=5), bytes(48)), "message kind must be a str, got int")


def test_fields_not_a_map() -> None:
    _raises(_raw(_header(f=[1]), bytes(48)), "act: fields 'f' are not a map (got list)")


def test_missing_required_field() -> None:
    _raises(_raw(_header(f={"job": "j", "vw": 0}), bytes(48)), "act: missing required field 'p'")


def test_wrong_field_type() -> None:
    f = {**ACT_FIELDS, "vw": "zero"}
    _raises(_raw(_header(f=f), bytes(48)), "act: field 'vw' expects int, got str")


def test_bool_is_not_int() -> None:
    f = {**ACT_FIELDS, "p": True}
    _raises(_raw(_header(f=f), bytes(48)), "act: field 'p' expects int, got bool")


def test_unexpected_field() -> None:
    f = {**ACT_FIELDS, "extra": 1}
    _raises(_raw(_header(f=f), bytes(48)), "act: unexpected field 'extra'")


def test_nested_field_with_bytes_key() -> None:
    h = {"v": 1, "kind": "submit", "f": {"rid": 1, "job": {b"k": 1}}}
    _raises(_raw(h), "submit: field 'job': map key b'k' at job is not a str")


def test_descriptors_not_an_array() -> None:
    _raises(_raw(_header(t={"x": 1}), bytes(48)), "act: tensor descriptors 't' are not an array")


def test_descriptor_not_a_map() -> None:
    _raises(_raw(_header(t=[[1, 2]]), bytes(48)), "tensor descriptor 0 is not a map (got list)")


@pytest.mark.parametrize("key", ["name", "dtype", "shape", "frame"])
def test_descriptor_missing_key(key: str) -> None:
    d = _desc()
    del d[key]
    _raises(_raw(_header(t=[d]), bytes(48)), f"tensor descriptor 0 lacks '{key}'")


def test_descriptor_unexpected_key() -> None:
    d = _desc(stride=[4, 1])
    _raises(_raw(_header(t=[d]), bytes(48)), "tensor descriptor 0 has unexpected key 'stride'")


def test_descriptor_name_not_str() -> None:
    _raises(_raw(_header(t=[_desc(name=3)]), bytes(48)), "tensor descriptor 0: name is a int")


@pytest.mark.parametrize("dtype", ["complex64", "float", "int16", 7, None])
def test_unknown_dtype(dtype: Any) -> None:
    _raises(
        _raw(_header(t=[_desc(dtype=dtype)]), bytes(48)), f"tensor 'x': unknown dtype {dtype!r}"
    )


@pytest.mark.parametrize("shape", [[3, -4], "3x4", [3.0, 4], [True, 4], 12, None, [[3], 4]])
def test_bad_shape(shape: Any) -> None:
    _raises(
        _raw(_header(t=[_desc(shape=shape)]), bytes(48)),
        f"tensor 'x': shape must be a list of non-negative ints, got {shape!r}",
    )


def test_too_many_dims() -> None:
    _raises(_raw(_header(t=[_desc(shape=[1] * 17)]), bytes(4)), "tensor 'x': 17 dims, at most 16")
    decode(_raw(_header(t=[_desc(shape=[1] * 16)]), bytes(4)))  # 16 is fine


@pytest.mark.parametrize("frame", [0, 2, -1, 99, "1", True, 1.0])
def test_frame_index_out_of_range(frame: Any) -> None:
    _raises(
        _raw(_header(t=[_desc(frame=frame)]), bytes(48)),
        f"tensor 'x': frame {frame!r} is out of range (message has 2 frames)",
    )


def test_frame_reused() -> None:
    t = [_desc(), _desc(name="y")]
    _raises(_raw(_header(t=t), bytes(48)), "tensor 'y': frame 1 is already used by tensor 'x'")


def test_size_mismatch() -> None:
    _raises(_raw(_header(), bytes(40)), "tensor 'x' float32[3, 4] needs 48 bytes, frame 1 has 40")
    d = _desc(dtype="bfloat16", shape=[])
    _raises(_raw(_header(t=[d]), bytes(3)), "tensor 'x' bfloat16[] needs 2 bytes, frame 1 has 3")
    d = _desc(shape=[0, 5])
    _raises(_raw(_header(t=[d]), bytes(1)), "tensor 'x' float32[0, 5] needs 0 bytes, frame 1 has 1")


def test_huge_shape_is_a_size_mismatch_not_an_allocation() -> None:
    d = _desc(shape=[1 << 40, 1 << 40])
    _raises(_raw(_header(t=[d]), bytes(48)), "needs 4835703278458516698824704 bytes")


def test_frame_over_max_frame_bytes() -> None:
    frames = encode("act", ACT_FIELDS, {"x": torch.zeros(300)})
    _raises(
        frames, "frame 1 is 1200 bytes, over the max_frame_bytes limit 1024", max_frame_bytes=1024
    )
    assert DEFAULT_MAX_FRAME_BYTES == 1 << 30
    decode(frames, max_frame_bytes=1200)


def test_extra_frames() -> None:
    _raises(_raw(_header(), bytes(48), b"a", b"b"), "act: 2 extra frames")
    _raises(_raw(_header(t=[]), b"a"), "act: 1 extra frame that no tensor descriptor references")


def test_duplicate_tensor_names() -> None:
    t = [_desc(), _desc(frame=2)]
    _raises(_raw(_header(t=t), bytes(48), bytes(48)), "act: duplicate tensor name 'x'")


def test_bool_tensor_with_bad_bytes() -> None:
    d = _desc(dtype="bool", shape=[3])
    _raises(_raw(_header(t=[d]), b"\x00\x01\x02"), "tensor 'x': bool frame 1 holds bytes other")


def test_missing_f_and_t_mean_empty() -> None:
    m = decode(_raw({"v": 1, "kind": "cluster_status", "f": {"rid": 4}}))
    assert m.fields == {"rid": 4} and m.tensors == {}
    _raises(_raw({"v": 1, "kind": "cluster_status"}), "cluster_status: missing required field")


# --------------------------------------------------------------------------- fuzz


def _decode_or_wire_error(frames: list[Any]) -> None:
    try:
        decode(frames, max_frame_bytes=1 << 20)
    except WireError as e:
        assert "\n" not in str(e)


def test_fuzz_random_bytes() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        junk = rng.randbytes(rng.randrange(0, 64))
        extra = [rng.randbytes(rng.randrange(0, 16)) for _ in range(rng.randrange(0, 3))]
        _decode_or_wire_error([junk, *extra])


def test_fuzz_mutated_valid_messages() -> None:
    rng = random.Random(99)
    frames = encode(
        "push",
        {"rid": 1, "job": "job", "vw": 0, "stage": 1, "wave": 2},
        {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int32), "m": torch.ones(2) > 0},
    )
    header, data = bytes(frames[0]), [bytes(f) for f in frames[1:]]
    for _ in range(2000):
        h = bytearray(header)
        for _ in range(rng.randrange(1, 4)):
            op = rng.randrange(4)
            if op == 0 and h:
                h[rng.randrange(len(h))] = rng.randrange(256)
            elif op == 1 and h:
                del h[rng.randrange(len(h)) :]
            elif op == 2:
                h.insert(rng.randrange(len(h) + 1), rng.randrange(256))
            elif h:
                i = rng.randrange(len(h))
                h[i] ^= 1 << rng.randrange(8)
        body = list(data)
        if rng.random() < 0.3:
            body = body[: rng.randrange(len(body) + 1)]
        _decode_or_wire_error([bytes(h), *body])


def test_fuzz_structured_mutations() -> None:
    rng = random.Random(7)
    junk_values: list[Any] = [None, -1, 0, 1, 2, 1 << 40, "x", "", [], {}, [1], {"a": 1}, 1.5]
    junk_values += [True, b"\x00", [-1], [1 << 62, 1 << 62], {"k": []}]
    for _ in range(2000):
        h = _header()
        h["t"] = [_desc(), _desc(name="y", dtype="int8", shape=[2], frame=2)]
        target = rng.choice(["top", "f", "t0", "t1"])
        value = rng.choice(junk_values)
        if target == "top":
            h[rng.choice(["v", "kind", "f", "t", "zz"])] = value
        elif target == "f":
            h["f"][rng.choice(["job", "vw", "p", "zz"])] = value
        else:
            h["t"][int(target[1])][rng.choice(["name", "dtype", "shape", "frame", "zz"])] = value
        _decode_or_wire_error(_raw(h, bytes(48), bytes(2)))


# --------------------------------------------------------------------------- sockets


@pytest.fixture
def ctx() -> Any:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.mark.parametrize(
    "pattern", [(zmq.PAIR, zmq.PAIR), (zmq.PUSH, zmq.PULL)], ids=["pair", "push-pull"]
)
def test_through_sockets(ctx: zmq.Context, pattern: tuple[int, int]) -> None:
    address = f"inproc://wire-{pattern[0]}"
    receiver = ctx.socket(pattern[1])
    sender = ctx.socket(pattern[0])
    try:
        for s in (receiver, sender):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 5000)
            s.setsockopt(zmq.SNDTIMEO, 5000)
        receiver.bind(address)
        sender.connect(address)
        big = torch.randn(1024, 1024).bfloat16().t()  # 2 MiB, non-contiguous
        small = torch.arange(10)
        expected = {"x": big.clone(), "y": small.clone(), "e": torch.empty(0, 4)}
        frames = encode("act", ACT_FIELDS, {"x": big, "y": small, "e": expected["e"]})
        del big  # the frames keep the contiguous copy alive
        tracker = sender.send_multipart(frames, copy=False, track=True)
        received = receiver.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in received)
        m = decode(received)
        assert m.kind is Kind.ACT and m.fields == ACT_FIELDS
        assert all(_same(m.tensors[k], v) for k, v in expected.items())
        assert _inside(m.tensors["x"], received[1].buffer)
        tracker.wait(5)
        sender.send_multipart(error_frames("bad header", rid=3), copy=False)
        reply = decode(receiver.recv_multipart(copy=False))
        assert reply.kind is Kind.ERROR and reply["rid"] == 3
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
