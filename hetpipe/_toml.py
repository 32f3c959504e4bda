"""Typed reading of TOML-shaped tables, with key paths for one-line errors.

Both the cluster file (config.py) and job files (job.py, which also arrive as plain dicts over
the wire) are nested tables of plain values, and both must reject bad input with ONE line
``"<file>: <key path>: <problem>"``. This reader is the single place that knows how to do that,
so the two agree on wording: unknown keys are named with the allowed ones, ``bool`` is never
accepted as a number, non-finite numbers are refused, and ``None`` (which TOML cannot express,
but a decoded wire dict may carry) counts as an absent key.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Iterable
from datetime import date, datetime, time
from typing import TYPE_CHECKING, Any, Final, NoReturn

if TYPE_CHECKING:
    from hetpipe.core.keys import Key

__all__: list[str] = []

MISSING: Final = object()
"""Default marking a key as required."""

DECLARED: Final = object()
"""Default of :meth:`Table.read`: the key's declared default."""

INT64_MIN: Final = -(1 << 63)
INT64_MAX: Final = (1 << 63) - 1
"""Integers must fit msgpack's signed 64 bits: every value read here may travel on the wire."""

_AT = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")


def kind(value: object) -> str:
    """Name a value's type in TOML's words, for "expected X, got Y" messages."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, dict):
        return "table"
    if isinstance(value, datetime | date | time):
        return "date/time"
    return type(value).__name__


def one_line(text: str) -> str:
    """Collapse whitespace runs so that an error always fits on one line."""
    return " ".join(text.split())


def read_toml(path: str | os.PathLike[str], error: type[ValueError]) -> tuple[dict, str]:
    """Read and parse a TOML file; I/O and syntax errors become ``error`` with line info."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise error(one_line(f"{source}: file: cannot read ({e.strerror or e})")) from None
    try:
        return tomllib.loads(raw.decode("utf-8")), source
    except UnicodeDecodeError as e:
        raise error(f"{source}: file: not UTF-8 text (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        at = _AT.search(msg)
        where = f"line {at[1]}, column {at[2]}" if at else "file"
        problem = _AT.sub("", msg) if at else msg
        raise error(one_line(f"{source}: {where}: invalid TOML: {problem}")) from None


class Table:
    """One table being read: knows its key path, its file and the error type to raise."""

    def __init__(
        self,
        data: object,
        source: str,
        error: type[ValueError],
        key: str = "",
        allowed: Iterable[str] | None = None,
    ) -> None:
        self.source, self.error, self.key = source, error, key
        if not isinstance(data, dict):
            self.fail(None, f"expected a table, got {kind(data)}")
        self.data: dict[str, Any] = data
        for k in data:
            if not isinstance(k, str):
                self.fail(None, f"key {k!r} is not a string")
        if allowed is not None:
            allowed = tuple(allowed)
            for k in data:
                if k not in allowed:
                    self.fail(k, f"unknown key (allowed: {', '.join(sorted(allowed))})")

    def path(self, name: str | None) -> str:
        """Key path of ``name`` inside this table (``None``: the table itself)."""
        if name is None:
            return self.key or "(document)"
        return f"{self.key}.{name}" if self.key else name

    def fail(self, name: str | None, problem: str) -> NoReturn:
        """Raise the one-line error for key ``name`` (may carry an index, e.g. ``shards[1]``)."""
        raise self.error(one_line(f"{self.source}: {self.path(name)}: {problem}"))

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str, default: Any = MISSING) -> Any:
        """The value as stored; a missing required key fails."""
        value = self.data.get(name)
        if value is None:
            if default is MISSING:
                self.fail(name, "missing required key")
            return default
        return value

    def _check(self, name: str, value: Any, want: str) -> Any:
        ok = {
            "string": isinstance(value, str),
            "integer": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, int | float) and not isinstance(value, bool),
            "boolean": isinstance(value, bool),
        }[want]
        if not ok:
            article = "an" if want == "integer" else "a"
            self.fail(name, f"expected {article} {want}, got {kind(value)} {value!r}")
        if want == "integer" and not INT64_MIN <= value <= INT64_MAX:
            self.fail(name, f"integer {value} is out of range (must fit in 64 bits)")
        if want == "number":
            if not math.isfinite(value):
                self.fail(name, f"expected a finite number, got {value!r}")
            return float(value)
        return value

    def _typed(self, name: str, default: Any, want: str) -> Any:
        value = self.data.get(name)
        if value is None:
            if default is MISSING:
                self.fail(name, "missing required key")
            return default
        return self._check(name, value, want)

    def text(self, name: str, default: Any = MISSING) -> Any:
        """A string; empty strings are refused (every string key here names something)."""
        value = self._typed(name, default, "string")
        if isinstance(value, str) and not value.strip():
            self.fail(name, "must not be empty")
        return value

    def integer(self, name: str, default: Any = MISSING) -> Any:
        return self._typed(name, default, "integer")

    def number(self, name: str, default: Any = MISSING) -> Any:
        """A finite float; integers are accepted and converted."""
        return self._typed(name, default, "number")

    def at_least(self, name: str, low: int, default: Any = MISSING, high: int | None = None) -> Any:
        """An integer >= ``low`` (and <= ``high`` if given); ``None`` (absent) passes.

        ``high`` is where a library or the runtime stops accepting the value (a ZeroMQ
        option is a C int, a count travels as a 64-bit integer), so it is refused here,
        with the key, rather than later inside a daemon.
        """
        value = self.integer(name, default)
        if value is not None and value < low:
            self.fail(name, f"must be >= {low}, got {value}")
        if value is not None and high is not None and value > high:
            self.fail(name, f"must be <= {high}, got {value}")
        return value

    def positive(
        self,
        name: str,
        default: Any = MISSING,
        *,
        low: float | None = None,
        high: float | None = None,
    ) -> Any:
        """A finite number > 0 (>= ``low``, <= ``high`` if given); ``None`` (absent) passes."""
        value = self.number(name, default)
        if value is not None and value <= 0:
            self.fail(name, f"must be > 0, got {value}")
        if value is not None and low is not None and value < low:
            self.fail(name, f"must be >= {low:g}, got {value:g}")
        if value is not None and high is not None and value > high:
            self.fail(name, f"must be <= {high:g}, got {value:g}")
        return value

    def flag(self, name: str, default: Any = MISSING) -> Any:
        return self._typed(name, default, "boolean")

    def array(self, name: str, of: str, default: Any = MISSING) -> Any:
        """A list whose items are all ``of`` ("string", "integer", "number", "boolean")."""
        value = self.data.get(name)
        if value is None:
            return self.raw(name, default)
        if not isinstance(value, list | tuple):
            self.fail(name, f"expected an array, got {kind(value)} {value!r}")
        return [self._check(f"{name}[{i}]", item, of) for i, item in enumerate(value)]

    def read(self, key: Key, default: Any = DECLARED) -> Any:
        """A key as :mod:`hetpipe.core.keys` declares it: its type, its default (unless
        ``default`` overrides one that depends on other keys), its bounds and choices.

        Types read here: integer, float, string, boolean, and arrays of those (bounds apply
        to each item); a parser reads other shapes (sizes, free tables) itself.
        """
        if default is DECLARED:
            default = MISSING if key.required else key.default
        name, kind_ = key.name, key.type
        if kind_.startswith("array of "):
            of = {"strings": "string", "integers": "integer", "floats": "number"}.get(
                kind_.removeprefix("array of ").removeprefix("2 ")
            )
            if of is None:
                raise TypeError(f"{key.path}: a parser reads type {kind_!r} itself")
            items = self.array(name, of, list(default) if default is not None else None)
            if items is not None:
                for i, item in enumerate(items):
                    self._bounds(f"{name}[{i}]", item, key)
            return items
        if kind_ == "string":
            value = self.text(name, default)
            if key.choices and value is not None and value not in key.choices:
                self.fail(name, f"unknown {key.noun} {value!r} (one of: {', '.join(key.choices)})")
            return value
        if kind_ == "boolean":
            return self.flag(name, default)
        if kind_ == "float" and key.above == 0:
            return self.positive(name, default, low=key.low, high=key.high)
        value = self.integer(name, default) if kind_ == "integer" else self.number(name, default)
        if kind_ not in ("integer", "float"):
            raise TypeError(f"{key.path}: a parser reads type {kind_!r} itself")
        if value is not None:
            self._bounds(name, value, key)
        return value

    def _bounds(self, name: str, value: Any, key: Key) -> None:
        """Refuse ``value`` outside ``key``'s declared bounds."""
        low, high = key.low, key.high

        def text(x: Any) -> str:
            return str(x) if isinstance(x, int) else f"{x:g}"

        if key.below is not None:
            if not (low is None or low <= value) or not value < key.below:
                self.fail(name, f"must be in [{text(low)}, {text(key.below)}), got {value}")
            return
        if key.above is not None and value <= key.above:
            self.fail(name, f"must be > {text(key.above)}, got {value}")
        if low is not None and value < low:
            self.fail(name, f"must be >= {text(low)}, got {text(value)}")
        if high is not None and value > high:
            self.fail(name, f"must be <= {text(high)}, got {text(value)}")

    def table(self, name: str, allowed: Iterable[str] | None = None) -> Table:
        """A sub-table; an absent one reads as empty so its own keys report what is missing."""
        value = self.data.get(name)
        return Table(
            {} if value is None else value, self.source, self.error, self.path(name), allowed
        )

    def tables(self, name: str, allowed: Iterable[str] | None = None) -> list[Table]:
        """An array of tables (``[[name]]``), each keyed ``name[i]``."""
        value = self.data.get(name)
        if value is None:
            return []
        if not isinstance(value, list | tuple):
            self.fail(name, f"expected an array of tables ([[{name}]]), got {kind(value)}")
        path = self.path(name)
        return [
            Table(item, self.source, self.error, f"{path}[{i}]", allowed)
            for i, item in enumerate(value)
        ]
