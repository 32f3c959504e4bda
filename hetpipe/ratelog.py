"""Logging a recurring problem once per peer per interval, with a count and a short excerpt.

A peer that sends garbage at thousands of messages a second must not turn every message
into a log line (the logs would grow without bound) nor spend the daemon's time on
formatting. :class:`Throttle` logs the first occurrence per key (a peer) in each interval,
counts the rest, and reports the count with the next line it writes for that key. The number
of keys it remembers and the lines it writes per interval over all keys are bounded too, so
a flood from many fresh identities is also a handful of lines.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["EXCERPT_CHARS", "Throttle", "excerpt"]

EXCERPT_CHARS = 200


def excerpt(text: object, limit: int = EXCERPT_CHARS) -> str:
    """``str(text)`` cut to ``limit`` characters, saying how much was cut.

    Every error reply and log line that may quote peer input goes through here, so none
    echoes it unbounded (a reply quoting a 16 MB garbage string would be 16 MB).
    """
    s = str(text)
    if len(s) <= limit:
        return s
    return f"{s[:limit]}... ({len(s) - limit} more characters)"


class Throttle:
    """Once per key per ``interval_s``; at most ``lines_per_interval`` lines over all keys."""

    def __init__(
        self,
        log: Any,
        *,
        interval_s: float = 10.0,
        lines_per_interval: int = 20,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.interval_s = interval_s
        self.lines_per_interval = lines_per_interval
        self.max_keys = max_keys
        self.clock = clock
        self._keys: OrderedDict[str, list[float | int]] = OrderedDict()  # key -> [since, held]
        self._window = (clock(), 0)  # (start, lines written in it)
        self.held_back = 0  # lines not written because of the overall budget

    def count(self, key: str) -> int:
        """Occurrences of ``key`` held back in its current interval (0 if none)."""
        entry = self._keys.get(key)
        return 0 if entry is None else int(entry[1])

    def warning(self, event: str, key: str, error: str, **fields: Any) -> bool:
        """Log ``event`` for ``key`` unless it was logged within the interval; True if logged."""
        now = self.clock()
        entry = self._keys.get(key)
        if entry is not None and now - float(entry[0]) < self.interval_s:
            entry[1] = int(entry[1]) + 1
            return False
        start, lines = self._window
        if now - start >= self.interval_s:
            start, lines = now, 0
        if lines >= self.lines_per_interval:
            self._window = (start, lines)
            self.held_back += 1
            return False
        self._window = (start, lines + 1)
        held = 0 if entry is None else int(entry[1])
        extra: dict[str, Any] = {"repeated": held} if held else {}
        if self.held_back:
            extra["other_peers_held_back"], self.held_back = self.held_back, 0
        self.log.warning(event, peer=key, error=excerpt(error), **fields, **extra)
        self._keys[key] = [now, 0]
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        return True
