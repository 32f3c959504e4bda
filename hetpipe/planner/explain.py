"""Why a plan's formation and placement won: the lines ``hetpipe plan --explain`` prints.

Reads only a plan's ``details`` (what :func:`hetpipe.planner.plan.make_plan` records:
``candidates``, one entry per formation the search considered, from
:func:`hetpipe.planner.formation.best_formation`'s trace; ``placements``, the chosen
formation's predicted throughput under each parameter placement), so it works on a plan
that came over the wire as a dict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["explain_lines"]


def explain_lines(details: Mapping[str, Any]) -> list[str]:
    """Each candidate formation (and placement) with its predicted samples/s, then why the
    chosen one won: the runner-up and the margin, and how many were skipped by bound."""
    cands: Sequence[Mapping[str, Any]] = details.get("candidates") or ()
    if not cands:
        return [
            "explain: this plan records no candidate formations (a split from the job file, "
            "or a synchronous plan)"
        ]
    lines = [f"candidate formations ({len(cands)}), predicted samples/s:"]
    for i, c in enumerate(cands):
        mark = "*" if c.get("chosen") else " "
        score = c.get("score")
        figure = f"{score:10.2f}" if score is not None else f"{'-':>10}"
        why = f"  ({c['skipped']})" if c.get("skipped") else ""
        lines.append(f" {mark} {i:2d} {c['name']:<9} {figure}  {c['formation']}{why}")
    scored = sorted(
        (c for c in cands if c.get("score") is not None), key=lambda c: -float(c["score"])
    )
    chosen = next((c for c in cands if c.get("chosen")), None)
    if chosen is not None and chosen.get("score") is not None:
        rest = [c for c in scored if c is not chosen]
        pruned = sum(1 for c in cands if c.get("skipped") and c.get("score") is None)
        msg = f"chosen: {chosen['name']} at {float(chosen['score']):.2f} samples/s"
        if rest:
            r = rest[0]
            margin = float(chosen["score"]) / float(r["score"]) - 1 if r["score"] else 0.0
            msg += (
                f", {margin:+.1%} over the best other candidate ({r['name']}, "
                f"{float(r['score']):.2f}: {r['formation']})"
            )
        if pruned:
            msg += f"; {pruned} skipped whose throughput bound could not beat the best so far"
        lines.append(msg)
    places: Sequence[Mapping[str, Any]] = details.get("placements") or ()
    if places:
        lines.append("parameter placements of the chosen formation, predicted samples/s:")
        for p in places:
            mark = "*" if p.get("chosen") else " "
            lines.append(f" {mark} {p['name']:<9} {float(p['score']):10.2f}  {p['rule']}")
    return lines
