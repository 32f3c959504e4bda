"""The one wire protocol every hetpipe process speaks.

A message is a ZeroMQ multipart. Frame 0 is a msgpack header::

    {"v": PROTOCOL_VERSION, "kind": str, "f": {fields}, "t": [descriptor, ...]}

where each tensor descriptor is ``{"name": str, "dtype": str, "shape": [int, ...],
"frame": int}`` and frames 1.. hold raw tensor bytes (little-endian, C order). Every dtype,
bfloat16 included, travels as a uint8 view of the tensor's memory, so no dtype needs numpy
support and nothing is ever pickled.

Why this shape:

- Large tensors cross the process boundary without copies. :func:`encode` returns
  memoryviews of the tensors' own memory (the views keep the tensors alive, so the caller
  can ``send_multipart(frames, copy=False)``); :func:`decode` builds tensors that alias the
  received frame memory. Below :data:`ZERO_COPY_MIN_BYTES` a copy is cheaper than the
  bookkeeping of zero-copy, so small tensors are copied on both sides.
- Headers come from the network and are hostile until validated. Every malformed message
  raises :class:`WireError` with one line that says what is wrong, so a receiver can log it,
  answer with an ``error`` reply where the pattern has one, drop it and keep running. The
  same schemas check outgoing messages, so a programming error surfaces at the sender.

Extending: add a member to :class:`Kind` and its field schema to :data:`SCHEMAS`. Decoded
tensors may alias read-only memory (a ``bytes`` frame): clone one before writing into it.

One file on purpose: the kinds, their field schemas and the codec are the protocol, and a
reader checks each against the others; a second home for any of them would drift.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "MAX_DIMS",
    "MAX_HEADER_BYTES",
    "PROTOCOL_VERSION",
    "SCHEMAS",
    "ZERO_COPY_MIN_BYTES",
    "Field",
    "Kind",
    "Message",
    "WireError",
    "decode",
    "dtype_name",
    "dtype_named",
    "encode",
    "error_frames",
    "frames_nbytes",
]

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 1 << 30
# A job's trace travels in one header (a stage's per-minibatch records and spans travel in
# bounded stage_records chunks while it trains), so the bound is generous; decoding work and
# memory stay proportional to the bytes actually received.
MAX_HEADER_BYTES = 64 << 20
ZERO_COPY_MIN_BYTES = 64 * 1024  # below this, copying beats zero-copy
MAX_DIMS = 16
MAX_NESTING = 64  # depth of dict/list field values; bounds validation work on hostile input

if sys.byteorder != "little":  # raw tensor bytes are little-endian on the wire
    raise ImportError("hetpipe.wire supports little-endian hosts only")


class WireError(ValueError):
    """A message that cannot be encoded or decoded; ``str(e)`` is one line saying why."""


class Kind(StrEnum):
    """Every message kind; the value is what travels in the header."""

    ERROR = "error"
    OK = "ok"
    HELLO = "hello"
    WELCOME = "welcome"
    HEARTBEAT = "heartbeat"
    SHARD_HELLO = "shard_hello"
    ASSIGN = "assign"
    START = "start"
    ABORT = "abort"
    REPORT = "report"
    STAGE_DONE = "stage_done"
    STAGE_RECORDS = "stage_records"
    STAGE_FAILED = "stage_failed"
    STAGE_STATE = "stage_state"
    ACT = "act"
    GRAD = "grad"
    REPLICA_GRAD = "replica_grad"
    PUSH = "push"
    PULL = "pull"
    MIGRATE = "migrate"
    MIGRATE_ORDER = "migrate_order"
    PULLED = "pulled"
    REDUCE = "reduce"
    REDUCED = "reduced"
    SHARD_INIT = "shard_init"
    SHARD_FETCH = "shard_fetch"
    SHARD_DROP = "shard_drop"
    SHARD_CUT = "shard_cut"
    CUT_AT = "cut_at"
    CHECKPOINT = "checkpoint"
    SUBMIT = "submit"
    JOB_STATUS = "job_status"
    CLUSTER_STATUS = "cluster_status"
    CANCEL = "cancel"
    PROFILE = "profile"
    PLAN = "plan"
    MEASURE = "measure"
    TRACE = "trace"
    TENSORS = "tensors"


@dataclass(frozen=True)
class Field:
    """One header field: its type(s) and whether it must be present.

    ``bool`` never passes for ``int`` (a flag is not a count); an ``int`` passes for
    ``float`` and is delivered as a float. ``dict``/``list`` are msgpack maps/arrays whose
    contents are free-form plain data (str keys; None, bool, int, float, str, bytes).
    """

    type: type | tuple[type, ...]
    required: bool = True

    @functools.cached_property
    def types(self) -> tuple[type, ...]:
        """The types a received value may have."""
        return self.type if isinstance(self.type, tuple) else (self.type,)

    @functools.cached_property
    def types_out(self) -> tuple[type, ...]:
        """The types a value to send may have: a tuple passes for a list."""
        return (*self.types, tuple) if list in self.types else self.types

    @functools.cached_property
    def exact(self) -> frozenset[type]:
        """Types whose exact instances pass as they are (bool only where a field takes it:
        a flag is not a count; float's int is converted, so not here)."""
        return frozenset(self.types)


_STR, _INT, _FLOAT = Field(str), Field(int), Field(float)
_DICT, _LIST = Field(dict), Field(list)
_OPT_STR, _OPT_INT, _OPT_DICT = Field(str, False), Field(int, False), Field(dict, False)
_OPT_LIST = Field(list, False)

# One schema per kind. Tensors are not part of the schema; the comment names what a kind carries.
SCHEMAS: dict[Kind, dict[str, Field]] = {
    Kind.ERROR: {"message": _STR, "rid": _OPT_INT},
    Kind.OK: {"rid": _INT, "info": _OPT_DICT},
    Kind.HELLO: {"device": _STR, "address": _STR, "pid": _INT, "host": _STR, "type": _STR},
    Kind.WELCOME: {"heartbeat_s": _FLOAT, "lost_after_s": _FLOAT},
    Kind.HEARTBEAT: {
        "device": _STR,
        "state": _STR,
        "job": _OPT_STR,
        "vw": _OPT_INT,
        "stage": _OPT_INT,
    },
    Kind.SHARD_HELLO: {"shard": _INT, "address": _STR, "pid": _INT},
    Kind.ASSIGN: {"rid": _INT, "job": _STR, "task": _DICT},
    Kind.START: {"job": _STR},
    Kind.ABORT: {"job": _STR, "reason": _STR},
    # stats: a stage's progress; or (stats.evaluation) a validation pass's figures from vw0's
    # last stage, or a stage's weights (tensors) for train.keep_best (hetpipe.head.evals)
    Kind.REPORT: {"job": _STR, "vw": _INT, "stage": _INT, "stats": _DICT},
    # a stage's summary; its records and spans came before in stage_records (records: any
    # last rows that did not, appended after them; this runtime's workers send none here)
    Kind.STAGE_DONE: {
        "job": _STR,
        "vw": _INT,
        "stage": _INT,
        "stats": _DICT,
        "records": _OPT_LIST,
    },
    # a chunk of a stage's per-minibatch records (rows of stats.record_fields, ascending p)
    # and timeline spans, sent while it trains (hetpipe.pipeline.RecordsOut)
    Kind.STAGE_RECORDS: {
        "job": _STR,
        "vw": _INT,
        "stage": _INT,
        "records": _LIST,
        "spans": _LIST,
    },
    Kind.STAGE_FAILED: {"job": _STR, "vw": _INT, "stage": _INT, "error": _STR},
    # tensors: a stage's state right after its push of wave - 1 (hetpipe.checkpoint names)
    Kind.STAGE_STATE: {"job": _STR, "vw": _INT, "stage": _INT, "wave": _INT, "meta": _DICT},
    # a stage at one step of a live migration (hetpipe.migrate.HeadBus): ``parcels`` its
    # parcels' descriptions (tensors: ``<index>/<name>``), or ``refusal`` its verdict
    # the head to each stage of a virtual worker: carry out split ``layers`` before
    # minibatch ``at`` (hetpipe.head.migration.MigrationPart.migrate); ``mode`` "pick":
    # stage 0 chooses the boundary, ``at`` or the first free one after it (the OK's info
    # says which), "cancel": drop the order at ``at`` (another stage refused it)
    Kind.MIGRATE_ORDER: {
        "rid": _INT,
        "job": _STR,
        "vw": _INT,
        "at": _INT,
        "layers": _LIST,
        "reason": _STR,
        "mode": _OPT_STR,
    },
    Kind.MIGRATE: {
        "rid": _INT,
        "job": _STR,
        "vw": _INT,
        "stage": _INT,
        "at": _INT,
        "step": _STR,
        "layers": _OPT_LIST,
        "reason": _OPT_STR,
        "parcels": _OPT_LIST,
        "refusal": _OPT_STR,
    },
    # eval (on an activation): [i, n, c], minibatch i of the validation pass at wave boundary
    # c, n the count on the last one and -1 on the others ([i, n]: the job's end; no tensors
    # with n = 0: no validation set); [c] (no
    # tensors): a pass at boundary c is announced (hetpipe.evalpass,
    # hetpipe.pipeline.StageRunner._validation_pass)
    # tensors: activation "x" (a tuple carry: "x.0", "x.1", ...: hetpipe.carry), target "y"
    # (a dict: "y.<key>"; none: the model makes its loss); rows: the minibatch's rows [lo, hi)
    # they hold, where a stage on either side is replicated (hetpipe.replicas); absent: all of them.
    # agree (then no tensors): [step, [[stage, squared norm, finite], ...]], the stages'
    # agreement before a step (hetpipe.pipeline.StageRunner._agree)
    # tied (then the tensors are "<stage>/<tie>"): the iteration whose gradient sums of the
    # copies of a tie spanning stages they are (hetpipe.pipeline.StageRunner._exchange)
    Kind.ACT: {
        "job": _STR,
        "vw": _INT,
        "p": _INT,
        "eval": _OPT_LIST,
        "ipc": _OPT_DICT,
        "shm": _OPT_DICT,
        "rows": _OPT_LIST,
        "agree": _OPT_LIST,
        "tied": _OPT_INT,
        "stage": _OPT_INT,  # the stage it is for (a device may run several)
    },
    # tensors: gradient "g" (of a tuple carry: "g.0", ..., one per floating tensor); rows,
    # agree and tied as for act; eval (then no tensors): [c, improved], the last stage's
    # verdict on the pass at boundary c for train.keep_best (hetpipe.evalpass)
    Kind.GRAD: {
        "job": _STR,
        "vw": _INT,
        "p": _INT,
        "eval": _OPT_LIST,
        "ipc": _OPT_DICT,
        "shm": _OPT_DICT,
        "rows": _OPT_LIST,
        "agree": _OPT_LIST,
        "tied": _OPT_INT,
        "stage": _OPT_INT,  # the stage it is for (a device may run several)
    },
    # tensors: one replica's weight gradients of minibatch p, by name, to the stage's other
    # replicas (summed by every replica before its step)
    Kind.REPLICA_GRAD: {
        "job": _STR,
        "vw": _INT,
        "stage": _INT,
        "p": _INT,
        "replica": _INT,
        "shm": _OPT_DICT,
    },
    # tensors: summed deltas of the wave, by parameter name
    # with ``migrate`` (a live migration, hetpipe.migrate): no update, but the names this
    # stage pushes and pulls on the shard from ``wave`` on (none: it leaves the shard)
    Kind.PUSH: {
        "rid": _INT,
        "job": _STR,
        "vw": _INT,
        "stage": _INT,
        "wave": _INT,
        "migrate": _OPT_LIST,
    },
    Kind.PULL: {
        "rid": _INT,
        "job": _STR,
        "vw": _INT,
        "stage": _INT,
        "need": _INT,
        "wave": _INT,
    },
    # tensors: weights, by parameter name
    Kind.PULLED: {"rid": _INT, "clock": _INT, "vw_clock": _INT, "applied": _LIST},
    # tensors: a stage's sample-weighted gradient sum of one synchronous iteration, by name
    Kind.REDUCE: {
        "rid": _INT,
        "job": _STR,
        "vw": _INT,
        "stage": _INT,
        "iteration": _INT,
        "samples": _INT,
    },
    # tensors: the mean gradient over every virtual worker's samples of the iteration
    Kind.REDUCED: {"rid": _INT, "samples": _INT},
    # tensors: initial weights, by parameter name
    # owners: "vw/stage" -> user id of the worker assigned (the only one it takes pushes from)
    # cut_every: keep a cut of the weights every that many waves (checkpoints)
    Kind.SHARD_INIT: {
        "rid": _INT,
        "job": _STR,
        "members": _DICT,
        "staleness": _INT,
        "owners": _OPT_DICT,
        "cut_every": _OPT_INT,
        # a VW leaves or joins a held job again (hetpipe.ps.ShardServer._reform)
        "reform": _OPT_DICT,
    },
    # head -> shard: the weights of cut ``wave`` (answered once complete) and its applied sets
    # ``keep`` 1: keep a cut at ``wave`` too (an on-demand checkpoint), answered at once
    Kind.SHARD_CUT: {"rid": _INT, "job": _STR, "wave": _INT, "keep": _OPT_INT},
    # head -> worker: send the stage's state at cut ``wave`` too (an on-demand checkpoint)
    Kind.CUT_AT: {"rid": _INT, "job": _STR, "wave": _INT},
    Kind.SHARD_FETCH: {"rid": _INT, "job": _STR},
    Kind.SHARD_DROP: {"rid": _INT, "job": _STR},
    # resume: the id of a job to continue from its last complete checkpoint (job optional then)
    Kind.SUBMIT: {"rid": _INT, "job": _OPT_DICT, "resume": _OPT_STR},
    Kind.JOB_STATUS: {"rid": _INT, "job": _STR},
    Kind.CLUSTER_STATUS: {"rid": _INT},
    Kind.CANCEL: {"rid": _INT, "job": _STR},
    Kind.CHECKPOINT: {"rid": _INT, "job": _STR},  # client -> head: checkpoint at the next cut
    Kind.PROFILE: {"rid": _INT, "job": _DICT},  # client -> head: profile every device type
    Kind.PLAN: {"rid": _INT, "job": _DICT},  # client -> head: the plan the head would run
    Kind.MEASURE: {"rid": _INT, "job": _DICT},  # head -> worker: profile the job's layers here
    Kind.TRACE: {"rid": _INT, "job": _STR},  # client -> head: a finished job's Chrome trace
    # tensors by name in a file (hetpipe.tensorfile: checkpoints), never sent to a daemon
    Kind.TENSORS: {},
}

_missing_schemas = set(Kind) - set(SCHEMAS)
assert not _missing_schemas, f"kinds without a schema: {sorted(_missing_schemas)}"

_DTYPE_NAMES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int8",
    "uint8",
    "bool",
)


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    """The dtypes the wire carries, by wire name: built on first use, so that a process that
    sends no tensor (the command line) never imports torch (over a second)."""
    import torch

    return {name: getattr(torch, name) for name in _DTYPE_NAMES}


@functools.cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {dt: name for name, dt in _dtypes().items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire's name of a dtype (``WireError`` if the wire cannot carry it)."""
    name = _dtype_names().get(dtype)
    if name is None:
        raise WireError(f"dtype {dtype} is not supported ({', '.join(_DTYPE_NAMES)})")
    return name


def dtype_named(name: str) -> torch.dtype | None:
    """The dtype of a wire name, or None for a name the wire does not know."""
    return _dtypes().get(name)


_HEADER_KEYS = frozenset({"v", "kind", "f", "t"})
_DESCRIPTOR_KEYS = ("name", "dtype", "shape", "frame")
_INT_MIN, _UINT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack can carry


@dataclass
class Message:
    """A decoded message: its kind, validated fields, and tensors in header order."""

    kind: Kind
    fields: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    user: str | None = None  # the sender's user id from ZAP (its Curve key's name), if any

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


# --------------------------------------------------------------------------- validation


def _type_name(t: type | tuple[type, ...]) -> str:
    if isinstance(t, tuple):
        return " or ".join(x.__name__ for x in t)
    return t.__name__


# scalars that are always plain (exact types: a subclass takes the general path below)
_LEAF_TYPES = frozenset({type(None), bool, float, str, bytes})


def _path(name: str, where: Any) -> str:
    """The path of an item for an error message, from the chain of ``(parent, key, is_map)``
    the walk keeps instead of formatting a path string for every item it visits."""
    parts: list[str] = []
    while where is not None:
        where, key, is_map = where
        parts.append(f"[{key!r}]" if is_map else f"[{key}]")
    return name + "".join(reversed(parts))


def _check_plain(kind: str, name: str, value: Any, where: Any = None, depth: int = 0) -> None:
    """Check that a dict/list field holds plain msgpack data with str keys.

    Recursive, but only :data:`MAX_NESTING` deep (deeper raises first), so hostile nesting
    cannot exhaust the Python stack. Exact types are tested first: every message's fields
    pass through here, and most of their items are str, int or float."""
    if depth >= MAX_NESTING:
        raise WireError(f"{kind}: field {name!r}: nested deeper than {MAX_NESTING}")
    if isinstance(value, dict):
        items: Iterable[tuple[Any, Any]] = value.items()
        is_map = True
    else:
        items, is_map = enumerate(value), False
    for key, v in items:
        t = type(v)
        if is_map and not isinstance(key, str):
            raise WireError(
                f"{kind}: field {name!r}: map key {key!r} at {_path(name, where)} is not a str"
            )
        if t in _LEAF_TYPES:
            continue
        if isinstance(v, int):  # (bool, an int too, is a leaf above)
            if not _INT_MIN <= v <= _UINT_MAX:
                raise WireError(
                    f"{kind}: field {name!r}: integer at "
                    f"{_path(name, (where, key, is_map))} is out of range"
                )
        elif isinstance(v, dict | list | tuple):
            _check_plain(kind, name, v, (where, key, is_map), depth + 1)
        elif not isinstance(v, float | str | bytes):  # a subclass of a leaf type
            raise WireError(
                f"{kind}: field {name!r}: {t.__name__} at "
                f"{_path(name, (where, key, is_map))} is not plain msgpack data"
            )


def _check_fields(kind: Kind, fields: Mapping[str, Any], *, outgoing: bool) -> dict[str, Any]:
    """Validate ``fields`` against the schema of ``kind``; return the normalised copy.

    On the way out, an optional field set to None counts as absent and a tuple passes for a
    list (msgpack sends both as an array).
    """
    schema = SCHEMAS[kind]
    out: dict[str, Any] = {}
    for name, value in fields.items():
        field = schema.get(name) if isinstance(name, str) else None
        if field is None:
            raise WireError(f"{kind}: unexpected field {name!r}")
        if type(value) not in field.exact:  # exactly a type the field takes: no more to ask
            if value is None and outgoing and not field.required:
                continue
            types = field.types_out if outgoing else field.types
            ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
            if not ok and float in types and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True
            if not ok:
                raise WireError(
                    f"{kind}: field {name!r} expects {_type_name(field.type)}, "
                    f"got {type(value).__name__}"
                )
        if isinstance(value, int) and not isinstance(value, bool):
            if not _INT_MIN <= value <= _UINT_MAX:
                raise WireError(f"{kind}: field {name!r}: integer {value} is out of range")
        elif isinstance(value, dict | list | tuple):
            _check_plain(kind, name, value)
        out[name] = value
    if len(out) < len(schema):
        for name, field in schema.items():
            if field.required and name not in out:
                raise WireError(f"{kind}: missing required field {name!r}")
    return out


def _kind(kind: Any) -> Kind:
    if isinstance(kind, Kind):
        return kind
    if not isinstance(kind, str):
        raise WireError(f"message kind must be a str, got {type(kind).__name__}")
    try:
        return Kind(kind)
    except ValueError:
        raise WireError(f"unknown message kind {kind!r}") from None


# --------------------------------------------------------------------------- encode


def _tensor_frame(name: str, t: torch.Tensor) -> tuple[dict[str, Any], bytes | memoryview]:
    """Describe a tensor and return its bytes: a view of its memory, or a copy if small."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise WireError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
    dtype = _dtype_names().get(t.dtype)
    if dtype is None:
        supported = ", ".join(_DTYPE_NAMES)
        raise WireError(f"tensor {name!r}: dtype {t.dtype} is not supported ({supported})")
    if t.layout != torch.strided:
        raise WireError(f"tensor {name!r}: layout {t.layout} is not supported (dense only)")
    if t.dim() > MAX_DIMS:
        raise WireError(f"tensor {name!r}: {t.dim()} dims, at most {MAX_DIMS}")
    desc = {"name": name, "dtype": dtype, "shape": list(t.shape), "frame": 0}
    if t.numel() == 0:
        return desc, b""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    # The ndarray's base is the tensor, and the memoryview's base is the ndarray: holding the
    # view keeps the tensor memory alive until the send (copy=False) is done with it.
    view = memoryview(raw.numpy())
    if view.nbytes < ZERO_COPY_MIN_BYTES:
        return desc, view.tobytes()
    return desc, view


def encode(
    kind: Kind | str,
    fields: Mapping[str, Any] | None = None,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> list[bytes | memoryview]:
    """Build the frames of one message, ready for ``send_multipart(frames, copy=False)``.

    Fields are checked against the kind's schema (WireError on a mismatch). Tensor frames are
    zero-copy views of the tensors' (contiguous, CPU) memory; non-contiguous tensors are made
    contiguous and CUDA tensors are copied to the host first. Tensors under
    :data:`ZERO_COPY_MIN_BYTES` are copied into ``bytes``. The caller must not modify a
    tensor in place until the send of its frames has completed.
    """
    k = _kind(kind)
    checked = _check_fields(k, fields or {}, outgoing=True)
    descriptors: list[dict[str, Any]] = []
    frames: list[bytes | memoryview] = [b""]
    for name, t in (tensors or {}).items():
        if not isinstance(name, str):
            raise WireError(f"tensor name {name!r} is not a str")
        desc, frame = _tensor_frame(name, t)
        desc["frame"] = len(frames)
        descriptors.append(desc)
        frames.append(frame)
    header = {"v": PROTOCOL_VERSION, "kind": k.value, "f": checked, "t": descriptors}
    try:
        frames[0] = msgpack.packb(header, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as e:  # _check_fields should prevent this
        raise WireError(f"{k}: header cannot be packed: {e}") from None
    if len(frames[0]) > MAX_HEADER_BYTES:
        raise WireError(
            f"{k}: header is {len(frames[0])} bytes, over the {MAX_HEADER_BYTES}-byte limit"
        )
    return frames


def error_frames(message: str, rid: int | None = None) -> list[bytes]:
    """The frames of an ``error`` reply (``rid`` ties it to the request it answers)."""
    return encode(Kind.ERROR, {"message": message, "rid": rid})  # type: ignore[return-value]


# --------------------------------------------------------------------------- decode


def _buffer(frame: bytes | bytearray | memoryview | zmq.Frame) -> memoryview:
    if isinstance(frame, zmq.Frame):
        return frame.buffer  # no copy
    view = memoryview(frame)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def frames_nbytes(frames: Iterable[bytes | bytearray | memoryview | zmq.Frame]) -> int:
    """Total payload bytes of a message's frames (for metrics and bandwidth accounting)."""
    total = 0
    for frame in frames:
        total += len(frame) if isinstance(frame, zmq.Frame) else memoryview(frame).nbytes
    return total


def _unpack_header(raw: memoryview) -> Any:
    try:
        return msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=MAX_HEADER_BYTES,
            max_bin_len=MAX_HEADER_BYTES,
            max_array_len=MAX_HEADER_BYTES,
            max_map_len=MAX_HEADER_BYTES,
            max_ext_len=0,  # no extension types (timestamps included) on this wire
        )
    except Exception as e:  # msgpack raises many types (ValueError, ExtraData, StackError ...)
        detail = str(e).splitlines()[0] if str(e) else ""
        raise WireError(
            f"header is not valid msgpack: {type(e).__name__}{': ' if detail else ''}{detail}"
        ) from None


def _is_index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tensor(
    desc: Any, i: int, frames: Sequence[memoryview], used: dict[int, str]
) -> tuple[str, torch.Tensor]:
    """Validate descriptor ``i`` against its frame and build the tensor."""
    import torch

    if not isinstance(desc, dict):
        raise WireError(f"tensor descriptor {i} is not a map (got {type(desc).__name__})")
    for key in _DESCRIPTOR_KEYS:
        if key not in desc:
            raise WireError(f"tensor descriptor {i} lacks {key!r}")
    for key in desc:
        if key not in _DESCRIPTOR_KEYS:
            raise WireError(f"tensor descriptor {i} has unexpected key {key!r}")
    name = desc["name"]
    if not isinstance(name, str):
        raise WireError(f"tensor descriptor {i}: name is a {type(name).__name__}, not a str")
    dtype_name = desc["dtype"]
    dtype = _dtypes().get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise WireError(f"tensor {name!r}: unknown dtype {dtype_name!r}")
    shape = desc["shape"]
    if not isinstance(shape, list) or not all(_is_index(d) and d >= 0 for d in shape):
        raise WireError(
            f"tensor {name!r}: shape must be a list of non-negative ints, got {shape!r}"
        )
    if len(shape) > MAX_DIMS:
        raise WireError(f"tensor {name!r}: {len(shape)} dims, at most {MAX_DIMS}")
    index = desc["frame"]
    if not _is_index(index) or not 1 <= index < len(frames):
        raise WireError(
            f"tensor {name!r}: frame {index!r} is out of range (message has {len(frames)} frames)"
        )
    if index in used:
        raise WireError(f"tensor {name!r}: frame {index} is already used by tensor {used[index]!r}")
    used[index] = name
    buf = frames[index]
    numel = 1
    for d in shape:
        numel *= d
    need = numel * dtype.itemsize
    if need != buf.nbytes:
        raise WireError(
            f"tensor {name!r} {dtype_name}{shape} needs {need} bytes, "
            f"frame {index} has {buf.nbytes}"
        )
    if numel == 0:
        return name, torch.empty(shape, dtype=dtype)
    if buf.nbytes < ZERO_COPY_MIN_BYTES:
        flat = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    elif buf.readonly:
        # A read-only frame (bytes) is fine: we never write into it. catch_warnings swaps the
        # process-wide filter list (and costs tens of microseconds), so it is only used here;
        # received zmq frames are writable and skip it.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(buf, dtype=torch.uint8)
    else:
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    if flat.data_ptr() % dtype.itemsize:  # misaligned memory: pay one copy
        flat = flat.clone()
    if dtype is torch.bool and bool((flat > 1).any()):
        raise WireError(f"tensor {name!r}: bool frame {index} holds bytes other than 0 and 1")
    return name, flat.view(dtype).view(shape)


def decode(
    frames: Sequence[bytes | bytearray | memoryview | zmq.Frame],
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
) -> Message:
    """Validate and decode one received message; raise WireError (one line) if malformed.

    Tensors of at least :data:`ZERO_COPY_MIN_BYTES` alias the frame memory (``zmq.Frame``
    buffers are used without a copy); smaller ones are copied so that tiny tensors do not
    pin large receive buffers.
    """
    if len(frames) == 0:
        raise WireError("empty message: no frames")
    bufs = [_buffer(f) for f in frames]
    if bufs[0].nbytes > MAX_HEADER_BYTES:
        raise WireError(f"header is {bufs[0].nbytes} bytes, over the {MAX_HEADER_BYTES}-byte limit")
    for i, buf in enumerate(bufs[1:], start=1):
        if buf.nbytes > max_frame_bytes:
            raise WireError(
                f"frame {i} is {buf.nbytes} bytes, over the max_frame_bytes limit {max_frame_bytes}"
            )
    header = _unpack_header(bufs[0])
    if not isinstance(header, dict):
        raise WireError(f"header is not a map (got {type(header).__name__})")
    if "v" not in header:
        raise WireError("header has no protocol version 'v'")
    version = header["v"]
    if not _is_index(version) or version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {version!r}, this process speaks {PROTOCOL_VERSION}")
    for key in header:
        if key not in _HEADER_KEYS:
            raise WireError(f"header has unexpected key {key!r}")
    if "kind" not in header:
        raise WireError("header has no 'kind'")
    kind = _kind(header["kind"])
    fields = header.get("f", {})
    if not isinstance(fields, dict):
        raise WireError(f"{kind}: fields 'f' are not a map (got {type(fields).__name__})")
    checked = _check_fields(kind, fields, outgoing=False)
    descriptors = header.get("t", [])
    if not isinstance(descriptors, list):
        raise WireError(
            f"{kind}: tensor descriptors 't' are not an array (got {type(descriptors).__name__})"
        )
    tensors: dict[str, torch.Tensor] = {}
    used: dict[int, str] = {}
    for i, desc in enumerate(descriptors):
        name, tensor = _tensor(desc, i, bufs, used)
        if name in tensors:
            raise WireError(f"{kind}: duplicate tensor name {name!r}")
        tensors[name] = tensor
    extra = len(bufs) - 1 - len(used)
    if extra:
        raise WireError(
            f"{kind}: {extra} extra frame{'s' if extra != 1 else ''} "
            "that no tensor descriptor references"
        )
    return Message(kind, checked, tensors)
