"""Units shown to people: byte sizes in binary units."""

from __future__ import annotations

__all__ = ["format_size"]


def format_size(n: int) -> str:
    """Human form in binary units: ``2147483648 -> "2.0GiB"``, ``512 -> "512B"``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"
