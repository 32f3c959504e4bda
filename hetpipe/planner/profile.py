"""Keeping per-layer profiles, and synthetic ones for tests.

The profile types are pure and live in :mod:`hetpipe.core.profile` (what each field means,
and the stage call term); measuring them on a device is the worker's (:mod:`hetpipe.measure`).
Here: :class:`ProfileStore` keeps what was measured in a JSON file, and
:func:`synthetic_profile` makes plausible random ones.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hetpipe.core.profile import (
    CallProfile,
    LayerProfile,
    ModelProfile,
    StageTimes,
    TieProfile,
    at_speed,
    scale_layers,
    update_scale,
)

__all__ = [
    # re-exported from hetpipe.core.profile, their one home, for existing importers
    "CallProfile",
    "LayerProfile",
    "ModelProfile",
    "ProfileStore",
    "StageTimes",
    "TieProfile",
    "at_speed",
    "scale_layers",
    "synthetic_profile",
    "update_scale",
]


# --------------------------------------------------------------------------- store


class ProfileStore:
    """Profiles kept in a readable JSON file, keyed by (model key, minibatch, device type).

    Profiling takes a while, so the head measures each (model, minibatch, type) once and
    reuses it. The file is plain JSON::

        {"version": 2,
         "models": {"cnn{width=32}": {"32": {"input_bytes": 8192,
                                             "types": {"fast": [{"fwd_s": ..}, ..]},
                                             "calls": {"fast": {"fwd_s": .., "bwd_s": ..}}}}}}

    ``calls`` (the stage call term per type) may be absent: those types load with no call
    term, their layers' times gross. ``ties`` (the tensors several layers share, the model's
    whatever the type: :class:`TieProfile`) may be absent too: none.

    Version 2 layers say which of their saved bytes are their input and output
    (``saved_input_bytes``, ``saved_output_bytes``); a version-1 file still loads, its
    layers without them (:meth:`LayerProfile.from_dict`: the memory model's count before
    them), and is written back as version 2.
    """

    VERSION = 2
    READS = (1, 2)  # versions a file may have: 1's layers lack the saved ends

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._data: dict[str, Any] = {"version": self.VERSION, "models": {}}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"{self.path}: unreadable profile store: {e}") from e
            if not isinstance(data, dict) or data.get("version") not in self.READS:
                raise ValueError(f"{self.path}: not a version-{self.VERSION} profile store")
            self._data = {**data, "version": self.VERSION}

    def _entry(self, model_key: str, minibatch: int) -> dict[str, Any] | None:
        return self._data["models"].get(model_key, {}).get(str(minibatch))

    def get(self, model_key: str, minibatch: int, dtype: str) -> tuple[LayerProfile, ...] | None:
        entry = self._entry(model_key, minibatch)
        if entry is None or dtype not in entry["types"]:
            return None
        return tuple(LayerProfile.from_dict(x) for x in entry["types"][dtype])

    def put(
        self,
        model_key: str,
        minibatch: int,
        dtype: str,
        layers: Sequence[LayerProfile],
        *,
        input_bytes: int | None = None,
        call: CallProfile | None = None,
        ties: Sequence[TieProfile] | None = None,
    ) -> None:
        """Keep ``dtype``'s layers (and its call term, when measured: else none); ``ties``,
        the model's, where given."""
        models = self._data["models"].setdefault(model_key, {})
        entry = models.setdefault(str(minibatch), {"input_bytes": 0, "types": {}})
        if input_bytes is not None:
            entry["input_bytes"] = int(input_bytes)
        if ties is not None:
            entry["ties"] = [t.to_dict() for t in ties]
        entry["types"][dtype] = [lp.to_dict() for lp in layers]
        calls = entry.setdefault("calls", {})
        if call is None:
            calls.pop(dtype, None)
        else:
            calls[dtype] = call.to_dict()

    def get_call(self, model_key: str, minibatch: int, dtype: str) -> CallProfile:
        """``dtype``'s stage call term (zero where none is stored)."""
        entry = self._entry(model_key, minibatch) or {}
        return CallProfile.from_dict((entry.get("calls") or {}).get(dtype))

    def forget(self, model_key: str, minibatch: int) -> None:
        """Drop every type's profile at ``minibatch`` (to be measured again)."""
        self._data["models"].get(model_key, {}).pop(str(minibatch), None)

    def model_profile(
        self, model_key: str, minibatch: int, types: Sequence[str] | None = None
    ) -> ModelProfile | None:
        """Every stored type (or those of ``types`` that are stored) as one ModelProfile."""
        entry = self._entry(model_key, minibatch)
        if entry is None:
            return None
        wanted = entry["types"] if types is None else [t for t in types if t in entry["types"]]
        if not wanted:
            return None
        layers = {t: self.get(model_key, minibatch, t) for t in wanted}
        calls = {t: self.get_call(model_key, minibatch, t) for t in wanted}
        return ModelProfile(
            model_key,
            minibatch,
            int(entry["input_bytes"]),
            layers,  # type: ignore[arg-type]
            calls,
            tuple(TieProfile.from_dict(t) for t in entry.get("ties") or ()),
        )

    def save(self) -> None:
        """Write atomically (temp file + rename) so a crash never leaves half a file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self._data, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, self.path)


# --------------------------------------------------------------------------- synthetic


def synthetic_profile(
    n_layers: int,
    types: Mapping[str, float],
    rng: random.Random | int = 0,
    *,
    model: str = "synthetic",
    minibatch: int = 32,
    time_s: tuple[float, float] = (1e-3, 4e-3),
    param_bytes: tuple[int, int] = (64 << 10, 512 << 10),
    out_bytes: tuple[int, int] = (16 << 10, 128 << 10),
    type_noise: float = 0.1,
    call: tuple[float, float, float] = (0.0, 0.0, 0.0),
    ties: Sequence[tuple[int, ...]] = (),
) -> ModelProfile:
    """A random but plausible profile for tests and benchmarks.

    ``ties``: groups of layers sharing one tensor (each a :class:`TieProfile` of the
    smallest ``param_bytes`` among its layers, named ``tie<i>``); each layer keeps its own
    ``param_bytes``, which then counts the tensor, as a layer measured alone does.

    ``call``: the stage call term (forward, backward, update) at speed 1, divided by each
    type's speed like the layers; none by default.

    ``types`` maps a device type to its relative speed: a layer's time on a type is its base
    time / speed, times a per-(layer, type) factor within +-``type_noise`` (layers do not all
    speed up alike on a faster GPU). Backward takes about twice the forward. Autograd saves
    roughly the layer's input and output.
    """
    r = rng if isinstance(rng, random.Random) else random.Random(rng)
    base = []
    for _ in range(n_layers):
        f = r.uniform(*time_s)
        base.append(
            (
                f,
                f * r.uniform(1.6, 2.4),
                r.randint(*param_bytes) // 4 * 4,
                r.choice((0, 0, 0, 2048)),
                r.randint(*out_bytes) // 4 * 4,
            )
        )
    input_bytes = r.randint(*out_bytes) // 4 * 4
    layers: dict[str, tuple[LayerProfile, ...]] = {}
    for t, speed in types.items():
        lps = []
        prev_out = input_bytes
        for f, b, p, buf, o in base:
            noise = 1.0 + r.uniform(-type_noise, type_noise)
            lps.append(
                LayerProfile(
                    f * noise / speed, b * noise / speed, p, buf, o, prev_out + o, prev_out + o
                )
            )
            prev_out = o
        layers[t] = tuple(lps)
    calls = (
        {t: CallProfile(*(c / speed for c in call)) for t, speed in types.items()}
        if any(call)
        else {}
    )
    tied = tuple(
        TieProfile(f"tie{i}", tuple(sorted(set(group))), min(base[j][2] for j in group))
        for i, group in enumerate(ties)
    )
    return ModelProfile(model, minibatch, input_bytes, layers, calls, tied)
