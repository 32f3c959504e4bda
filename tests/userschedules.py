"""Learning-rate schedule functions a test job names (``lr_schedule.kind =
"userschedules:halving"``): the daemons import this module from the tests' directory."""

from __future__ import annotations


def halving(t: int, every: int = 1) -> float:
    """The factor at step ``t`` (after the warm-up): halved every ``every`` steps."""
    return 0.5 ** (t // every)


def broken(t: int) -> str:
    """Returns what no schedule may: not a number."""
    return "fast"
