"""Logging set-up, done once per entry point.

Every process logs through structlog: a console renderer when a person watches (a TTY), JSON
lines otherwise, so that the daemons started by ``hetpipe up`` leave machine-readable logs in
the run directory which ``hetpipe logs`` renders back for a person. Job, virtual worker, stage
and wave are bound as context variables where they are known.

A daemon started with ``--log-file`` rotates that file by size (``[runtime] log_max_bytes``,
``log_keep``): its stdout and stderr are the file itself (file descriptors 1 and 2), so
rotation moves the descriptors too, and a traceback written by Python or a message from a
C library lands in the current file like every log line.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import structlog

from hetpipe.rotation import shift

__all__ = ["RotatingStderr", "configure", "get", "rotate_to"]


class RotatingStderr:
    """A file object for structlog that writes to fd 2 and rotates the log file by size.

    ``name.log`` becomes ``name.log.1`` (``.1`` becomes ``.2`` …, up to ``keep``), and a
    fresh ``name.log`` is put on descriptors 1 and 2. With ``keep = 0`` the file is cut
    back to empty instead.
    """

    def __init__(self, path: str | os.PathLike[str], max_bytes: int, keep: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self._attach()

    def _attach(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        finally:
            os.close(fd)

    def rotate(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        if self.keep == 0:
            os.ftruncate(2, 0)
            return
        shift(self.path, self.keep)
        self._attach()

    def write(self, text: str) -> int:
        try:
            size = os.fstat(2).st_size
        except OSError:
            size = 0
        if size and size + len(text) > self.max_bytes:
            self.rotate()
        n = sys.stderr.write(text)
        return n

    def flush(self) -> None:
        sys.stderr.flush()


def configure(
    process: str, *, level: str = "info", json: bool | None = None, file: Any = None
) -> None:
    """Configure structlog for this process; ``json=None`` picks by whether stderr is a TTY.

    ``file`` is where lines go (default stderr; :func:`rotate_to` passes a rotating one).
    """
    if json is None:
        json = not sys.stderr.isatty()
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=False),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=file or sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(process=process)


def rotate_to(process: str, path: str, *, level: str, max_bytes: int, keep: int) -> None:
    """Log to ``path`` (JSON lines), rotated past ``max_bytes``, keeping ``keep`` old files."""
    configure(process, level=level, json=True, file=RotatingStderr(path, max_bytes, keep))


def get(name: str | None = None) -> Any:
    """A structlog logger; ``name`` is bound as ``component``."""
    log = structlog.get_logger()
    return log.bind(component=name) if name else log
