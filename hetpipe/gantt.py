"""A job's trace drawn as a Gantt chart a person reads at a glance (``hetpipe trace --png``).

A whole job is hundreds of minibatches: drawn in one strip, every box is a hairline. So the
picture shows a *window*: minibatches ``A:B``, seconds ``A:B`` since the job's first event, or
by default a steady-state slice of three waves from the middle of the job (after the pipeline
filled, before it drained). Boxes wide enough carry their minibatch number; beside each row
are that stage's busy, bubble and gate shares *within the window*, so what the eye sees and
the numbers agree. Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["COLORS", "Window", "gantt_png", "pick_window", "window_shares"]

COLORS = {
    "forward": "#4c78a8",
    "backward": "#f58518",
    "step": "#9d755d",
    "send": "#72b7b2",
    "push": "#54a24b",
    "merge": "#b279a2",
    "gate": "#e45756",
    "bubble": "#d8d8d8",
    "replicas": "#ff9da6",
}
COMPUTE = ("forward", "backward", "step")
STEADY_WAVES = 3  # waves in the default window


@dataclass(frozen=True)
class Window:
    """A time range of the trace in seconds since its first event, and how it was chosen."""

    start: float
    end: float
    label: str


def _spans(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def _covering(events: Sequence[dict[str, Any]], keep: Any) -> tuple[float, float] | None:
    chosen = [e for e in events if e.get("cat") in COMPUTE and keep(e.get("args") or {})]
    if not chosen:
        return None
    return (min(e["ts"] for e in chosen) / 1e6, max(e["ts"] + e["dur"] for e in chosen) / 1e6)


def pick_window(
    trace: Mapping[str, Any],
    *,
    minibatches: tuple[int, int] | None = None,
    seconds: tuple[float, float] | None = None,
) -> Window:
    """The window to draw; ValueError (one line) when the asked one holds nothing."""
    events = _spans(trace)
    if not events:
        raise ValueError("the trace holds no events")
    first = min(e["ts"] for e in events) / 1e6
    last = max(e["ts"] + e["dur"] for e in events) / 1e6
    if seconds is not None:
        a, b = seconds
        if b <= a or b <= first or a >= last:
            raise ValueError(
                f"--seconds {a:g}:{b:g} holds nothing (the job spans {first:.2f}-{last:.2f} s)"
            )
        return Window(max(a, first), min(b, last), f"seconds {a:g}-{b:g}")
    if minibatches is not None:
        a_mb, b_mb = minibatches
        span = _covering(
            events, lambda g: g.get("minibatch") is not None and a_mb <= g["minibatch"] < b_mb
        )
        if span is None:
            top = max((e["args"].get("minibatch") or 0) for e in events if e.get("args"))
            raise ValueError(
                f"--minibatches {a_mb}:{b_mb} holds nothing (the job has minibatches 0-{top})"
            )
        return Window(*span, f"minibatches {a_mb}-{b_mb - 1}")
    waves = sorted(
        {
            e["args"]["wave"]
            for e in events
            if e.get("cat") in COMPUTE and (e.get("args") or {}).get("wave") is not None
        }
    )
    if len(waves) <= STEADY_WAVES + 1:
        return Window(first, last, "the whole job")
    mid = waves[len(waves) // 2]
    lo, hi = mid - STEADY_WAVES // 2, mid - STEADY_WAVES // 2 + STEADY_WAVES
    span = _covering(events, lambda g: g.get("wave") is not None and lo <= g["wave"] < hi)
    assert span is not None  # mid is a wave of some compute event
    return Window(
        *span, f"waves {lo}-{hi - 1} (steady state; --minibatches/--seconds for another window)"
    )


def window_shares(trace: Mapping[str, Any], window: Window) -> dict[int, dict[str, float]]:
    """Per track: the share of the window each kind of span takes (clipped to it)."""
    length = window.end - window.start
    out: dict[int, dict[str, float]] = {}
    for e in _spans(trace):
        a = max(e["ts"] / 1e6, window.start)
        b = min((e["ts"] + e["dur"]) / 1e6, window.end)
        if b > a and length > 0:
            row = out.setdefault(e["tid"], {})
            row[e["cat"]] = row.get(e["cat"], 0.0) + (b - a) / length
    return out


def gantt_png(
    trace: Mapping[str, Any],
    path: str | Path,
    *,
    minibatches: tuple[int, int] | None = None,
    seconds: tuple[float, float] | None = None,
) -> Window:
    """Draw ``trace`` in a window (see :func:`pick_window`) to ``path``; return the window."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise RuntimeError("the PNG needs matplotlib: pip install 'hetpipe[plot]'") from exc
    win = pick_window(trace, minibatches=minibatches, seconds=seconds)
    names = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"
    }
    rows = sorted(names)
    width_in, dpi = 15.0, 110
    fig, ax = plt.subplots(figsize=(width_in, 1.8 + 0.55 * len(rows)), layout="constrained")
    length = win.end - win.start
    plot_px = width_in * dpi * 0.72  # the axes' share of the figure, near enough for labels
    for e in _spans(trace):
        a = max(e["ts"] / 1e6, win.start)
        b = min((e["ts"] + e["dur"]) / 1e6, win.end)
        if b <= a or e["tid"] not in names:
            continue
        y = rows.index(e["tid"])
        ax.broken_barh(
            [(a, b - a)],
            (y - 0.4, 0.8),
            facecolors=COLORS.get(e["cat"], "#999"),
            edgecolor="white",
            linewidth=0.3,
        )
        p = (e.get("args") or {}).get("minibatch")
        if e["cat"] in COMPUTE and p is not None:
            label = str(p)
            if (b - a) / length * plot_px >= 6.5 * len(label) + 4:
                ax.text(
                    (a + b) / 2,
                    y,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if e["cat"] == "forward" else "black",
                )
    shares = window_shares(trace, win)
    for y, tid in enumerate(rows):
        sh = shares.get(tid, {})
        busy = sum(sh.get(k, 0.0) for k in COMPUTE)
        ax.text(
            1.005,
            y,
            f"busy {busy:4.0%}  bubble {sh.get('bubble', 0.0):4.0%}  "
            f"gate {sh.get('gate', 0.0):4.0%}",
            transform=ax.get_yaxis_transform(),
            va="center",
            ha="left",
            fontsize=8,
            family="monospace",
        )
    ax.set_yticks(range(len(rows)), [names[t] for t in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(win.start, win.end)
    ax.set_xlabel("seconds since the job's first event")
    job = trace.get("otherData", {}).get("job", "")
    ax.set_title(f"hetpipe job {job}: {win.label}", loc="left", fontsize=10)
    fig.legend(
        [Patch(color=c) for c in COLORS.values()],
        list(COLORS),
        loc="outside lower center",
        ncol=len(COLORS),
        frameon=False,
        fontsize=8,
    )
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return win
