"""Logging set-up, done once per entry point.

Every process logs through structlog: a console renderer when a person watches (a TTY), JSON
lines otherwise, so that the daemons started by ``hetpipe up`` leave machine-readable logs in
the run directory which ``hetpipe logs`` renders back for a person. Job, virtual worker, stage
and wave are bound as context variables where they are known.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

__all__ = ["configure", "get"]


def configure(process: str, *, level: str = "info", json: bool | None = None) -> None:
    """Configure structlog for this process; ``json=None`` picks by whether stderr is a TTY."""
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(process=process)


def get(name: str | None = None) -> Any:
    """A structlog logger; ``name`` is bound as ``component``."""
    log = structlog.get_logger()
    return log.bind(component=name) if name else log
