"""What the ``hetpipe`` command line prints: tables, result lines and the live progress view.

The renderers are pure: a status dict (as the head answers it, or a job's ``result.json``) in,
text out, so tests check them without a head or a process. :class:`Progress` is the one piece
that writes (to stderr), redrawing a block in place on a TTY. The commands that fetch the
dicts live in :mod:`hetpipe.cli`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import click

from hetpipe.config import format_size
from hetpipe.jobstore import links, summary, waiting_text

__all__ = [
    "SECURITY_OFF",
    "Progress",
    "brief",
    "explain_lines",
    "final_line",
    "job_line",
    "live_view",
    "render_comparison",
    "render_log_line",
    "render_profile",
    "render_result",
    "render_running",
    "render_status",
]

SECURITY_OFF = (
    "SECURITY OFF: [security] curve = false: the daemons authenticate and "
    "encrypt nothing; any peer that reaches a port is trusted"
)


# -- the cluster and its jobs ---------------------------------------------------------------


def render_status(info: dict[str, Any]) -> str:
    """The cluster status as a table a person reads."""
    rows = [("DEVICE", "TYPE", "SPEED", "MEMORY", "STATE", "JOB", "STAGE")]
    warnings = []
    if info.get("security", {}).get("curve") is False:
        warnings.append(SECURITY_OFF)
    if info.get("shards_lost"):
        warnings.append("LOST SHARDS: " + ", ".join(f"ps{i}" for i in info["shards_lost"]))
    for w in info["workers"]:
        stage = f"vw{w['vw']}/stage{w['stage']}" if w.get("stage") is not None else "-"
        rows.append(
            (
                w["device"],
                w["type"],
                f"{w['speed']:g}",
                format_size(w["memory"]),
                w["state"],
                w.get("job") or "-",
                stage,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    lines = warnings + lines
    jobs = info.get("jobs", [])
    if jobs:
        lines.append("")
        lines.append("JOBS")
        for j in jobs[-10:]:
            lines.append("  " + job_line(j))
    return "\n".join(lines)


def job_line(j: dict[str, Any]) -> str:
    """One job on one line: id, state, then whatever of progress, loss, throughput, WSP
    clocks, accuracy and error its status has."""
    parts = [f"{j['id']:<20} {j['state']:<9}"]
    if j.get("owner"):
        parts.append(f"owner {j['owner']}")
    if j.get("total"):
        parts.append(f"{j.get('minibatches', 0)}/{j['total']} minibatches")
    if j.get("loss") is not None:
        parts.append(f"loss {j['loss']:.3f}")
    if j.get("samples_per_s"):
        parts.append(f"{j['samples_per_s']:.0f} samples/s")
    if j.get("vws"):
        clocks = " ".join(f"vw{v['vw']}:{v['clock']}" for v in j["vws"])
        parts.append(f"clocks {clocks} global {j.get('global_clock', 0)}")
    if j.get("validation"):
        parts.append(figures_text(j["validation"][-1]))
    elif j.get("test_accuracy") is not None:
        parts.append(f"test accuracy {j['test_accuracy']:.4f}")
    parts.extend(links(j))  # resumed from / as, what a paused job waits for
    if j.get("error"):
        parts.append(f"error: {j['error']}")
    return "  ".join(parts)


# what an evaluation's entry holds beside its figures (hetpipe.head.jobs)
_NOT_FIGURES = ("seconds", "minibatches", "wave", "on")


def figures_text(entry: dict[str, Any]) -> str:
    """One evaluation's figures (``val_loss``, then ``train.metrics``'s) on one line."""
    return "  ".join(
        f"{k} {v:.4g}" for k, v in entry.items() if k not in _NOT_FIGURES and v is not None
    )


def render_running(info: dict[str, Any]) -> str:
    """The live view of each running job of a cluster status, under its id (empty when
    none runs): what ``hetpipe status`` prints below the table."""
    blocks = [
        "\n".join([f"{j['id']}:", *live_view(j)])
        for j in info.get("jobs", [])
        if j["state"] == "running"
    ]
    return "\n\n".join(blocks)


def brief(info: dict[str, Any]) -> dict[str, Any]:
    """The fields of a job's status that ``hetpipe jobs`` lists (those that are set), alike
    for a running job's status and a finished job's ``result.json``."""
    return summary(info)


# -- a job's result and live progress -------------------------------------------------------


def final_line(info: dict[str, Any]) -> dict[str, Any]:
    """The one JSON line ``--json`` prints."""
    return {
        "job": info["id"],
        "status": info["state"],
        "test_accuracy": info.get("test_accuracy"),
        "samples_per_s": info.get("samples_per_s"),
        "minibatches": info.get("minibatches"),
        "seconds": info.get("seconds"),
        "model_path": info.get("model_path"),
        "error": info.get("error"),
    }


def render_result(info: dict[str, Any]) -> str:
    """A finished job for a person: time, throughput, accuracy, where each stage's
    parameters live, measured against predicted, and the paths of its outputs."""
    if info["state"] != "done":
        return "  ".join([f"{info['id']}: {info['state']}: {info.get('error')}", *links(info)])
    accuracy = info.get("test_accuracy")  # None: the data set gave no validation set
    lines = [
        f"{info['id']}: done in {info['seconds']:.1f} s, "
        f"{info['minibatches']} minibatches, {info['samples_per_s']:.0f} samples/s, "
        + ("no validation set" if accuracy is None else f"test accuracy {accuracy:.4f}")
    ]
    lines.extend(links(info))  # resumed from / as
    placement = ", ".join(
        f"vw{r['vw']}/stage{r['stage']}->shard{'+'.join(map(str, r['shards']))}"
        for r in info.get("placement") or []
        if r["shards"]
    )
    if info.get("validation"):
        lines.append(f"validation: {figures_text(info['validation'][-1])}")
    if info.get("best"):
        b = info["best"]
        lines.append(f"best:    {b['metric']} {b['value']:.4g} at wave {b.get('wave')}")
    if info.get("stopped"):
        lines.append(f"stopped early: {info['stopped']}")
    if placement:
        lines.append(f"placement: {placement}")
    comparison = render_comparison(info)
    if comparison:
        lines.append(comparison)
    if info.get("owner"):
        lines.append(f"owner:   {info['owner']}")
    lines.append(f"model:   {info['model_path']}")
    if info.get("best_model_path"):
        lines.append(f"best:    {info['best_model_path']}")
    lines.append(f"metrics: {info['metrics_path']}")
    lines.append(f"trace:   {info['trace_path']}  (open in https://ui.perfetto.dev)")
    return "\n".join(lines)


class Progress:
    """The live view of a running job.

    On a TTY: a block redrawn in place (progress bar, then per stage its busy / bubble /
    gate shares, then a hang diagnosis if any). Otherwise one line every few seconds.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.drawn = 0

    def update(self, info: dict[str, Any]) -> None:
        if not self.enabled or info["state"] != "running" or not info.get("total"):
            return
        now = time.monotonic()
        if not self.tty and now - self.last < 2.0:
            return
        self.last = now
        lines = live_view(info)
        if self.tty:
            up = f"\x1b[{self.drawn}F" if self.drawn else ""
            click.echo(up + "\n".join(line.ljust(100) for line in lines), err=True)
            self.drawn = len(lines)
        else:
            click.echo(lines[0], err=True)
            for line in lines[1:]:
                if line.startswith(("hang", "paused")):
                    click.echo(line, err=True)

    def close(self) -> None:
        pass


def live_view(info: dict[str, Any]) -> list[str]:
    """Progress, throughput, clocks, per-stage shares and any hang diagnosis, as lines."""
    total = info.get("total") or 0
    done = info.get("minibatches") or 0
    width = 30
    filled = int(width * done / total) if total else 0
    loss = f"loss {info['loss']:.3f}" if info.get("loss") is not None else "loss -"
    vws = info.get("vws") or []
    per_vw = " ".join(f"vw{v['vw']} {v['samples_per_s']:.0f}/s clock {v['clock']}" for v in vws)
    lines = [
        f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} minibatches  {loss}  "
        f"{info.get('samples_per_s', 0):.0f} samples/s  global clock "
        f"{info.get('global_clock', 0)}" + (f"  ({per_vw})" if len(vws) > 1 else "")
    ]
    for st in info.get("stages") or []:
        sh = st.get("shares") or {}
        if sh:
            lines.append(
                f"  vw{st['vw']}/stage{st['stage']} {st['device']:<8} "
                f"busy {sh['busy']:4.0%}  bubble {sh['bubble']:4.0%}  "
                f"gate {sh['gate']:4.0%}  comm {sh['comm']:4.0%}"
            )
    if info.get("validation"):
        last = info["validation"][-1]
        lines.append(f"validation (wave {last.get('wave')}): {figures_text(last)}")
    for d in info.get("diagnosis") or []:
        lines.append(f"hang: {d}")
    if info.get("waiting"):  # a lost shard paused it (hetpipe.head.shardwait)
        lines.append(f"paused: {waiting_text(info['waiting'])}")
    for r in (info.get("replan_decisions") or [])[-3:]:  # [replan]: hetpipe.head.drift
        lines.append(f"replan: {r['line']}")
    return lines


def render_comparison(info: dict[str, Any]) -> str:
    """Measured per-stage time and throughput next to the planner's prediction."""
    pred = info.get("predicted")
    if not pred:
        return ""
    lines = ["measured vs predicted:"]
    for st in info.get("stages") or []:
        try:
            p = pred["vws"][st["vw"]]["stages"][st["stage"]]["time_s"]
        except (IndexError, KeyError, TypeError):
            continue
        m = st.get("time_s")
        lines.append(
            f"  vw{st['vw']}/stage{st['stage']} {st['device']:<8} compute "
            f"{_ms(m)} per minibatch, predicted {_ms(p)}"
        )
    lines.append(
        f"  throughput {info.get('samples_per_s', 0):.0f} samples/s, predicted "
        f"{pred['samples_per_s']:.0f} samples/s"
    )
    for e in pred.get("left_out") or ():  # devices the planner chose not to use, and why
        lines.append(
            f"  left out: {e['device']}: predicted {float(e['with_samples_per_s']):.0f} "
            f"samples/s with it, {float(e['without_samples_per_s']):.0f} without"
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


# -- profiles and logs ----------------------------------------------------------------------


def render_profile(prof: dict[str, Any]) -> str:
    """Per device type: forward/backward ms of each layer, and bytes per layer; then each
    stage's call term (paid once per stage, whatever its layers: see
    :mod:`hetpipe.planner.profile`), where the profile has one."""
    types = sorted(prof["layers"])
    first = prof["layers"][types[0]]
    head = ["LAYER", *[f"{t} fwd+bwd ms" for t in types], "PARAMS", "OUTPUT"]
    rows = [head]
    for i in range(len(first)):
        times = [prof["layers"][t][i]["fwd_s"] + prof["layers"][t][i]["bwd_s"] for t in types]
        rows.append(
            [
                str(i),
                *[f"{1e3 * s:.3f}" for s in times],
                format_size(first[i]["param_bytes"]),
                format_size(first[i]["out_bytes"]),
            ]
        )
    calls = prof.get("calls") or {}
    if calls:
        times = [calls[t]["fwd_s"] + calls[t]["bwd_s"] if t in calls else 0.0 for t in types]
        rows.append(["per stage", *[f"{1e3 * s:.3f}" for s in times], "", ""])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"profile of {prof['model']} at minibatch {prof['minibatch']}"]
    lines += ["  ".join(c.rjust(widths[i]) for i, c in enumerate(r)) for r in rows]
    return "\n".join(lines)


def render_log_line(line: str) -> str:
    """One JSON log record as ``time LEVEL event key=value ...``; any other line as it is."""
    try:
        rec = json.loads(line)
    except ValueError:
        return line
    if not isinstance(rec, dict):
        return line
    ts = str(rec.pop("timestamp", ""))[11:23]
    level = str(rec.pop("level", "")).upper()
    event = rec.pop("event", "")
    rec.pop("process", None)
    rest = " ".join(f"{k}={v}" for k, v in rec.items())
    return f"{ts} {level:<7} {event} {rest}".rstrip()


# -- hetpipe plan --explain: why a plan's formation and placement won ---------------------


def explain_lines(details: Mapping[str, Any]) -> list[str]:
    """Each candidate formation (and placement) with its predicted samples/s, then why the
    chosen one won: the runner-up and the margin, and how many were skipped by bound."""
    cands: Sequence[Mapping[str, Any]] = details.get("candidates") or ()
    if not cands:
        return [
            *_chunk_lines(details),
            "explain: this plan records no candidate formations (a split from the job file, "
            "or a synchronous plan)",
        ]
    lines = [
        f"candidate formations ({len(cands)}), predicted samples/s "
        "(staleness-weighted where a VW is deep; plain in brackets):"
    ]
    for i, c in enumerate(cands):
        mark = "*" if c.get("chosen") else " "
        score = c.get("score")
        figure = f"{score:10.2f}" if score is not None else f"{'-':>10}"
        plain = c.get("samples_per_s")
        if score is not None and plain is not None and abs(plain - score) > 1e-9 * abs(plain):
            figure += f" [{plain:.2f}]"
        why = f"  ({c['skipped']})" if c.get("skipped") else ""
        lines.append(f" {mark} {i:2d} {c['name']:<9} {figure}  {c['formation']}{why}")
    scored = sorted(
        (c for c in cands if c.get("score") is not None), key=lambda c: -float(c["score"])
    )
    chosen = next((c for c in cands if c.get("chosen")), None)
    if chosen is not None and chosen.get("score") is not None:
        rest = [c for c in scored if c is not chosen]
        unsimulated = sum(1 for c in cands if c.get("not_simulated"))
        pruned = sum(1 for c in cands if c.get("skipped") and c.get("score") is None)
        pruned -= unsimulated
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
        if unsimulated:
            msg += f"; {unsimulated} not simulated, their estimate far below the best"
        lines.append(msg)
    lines += _choice_lines(details)
    places: Sequence[Mapping[str, Any]] = details.get("placements") or ()
    if places:
        lines.append("parameter placements of the chosen formation, predicted samples/s:")
        for p in places:
            mark = "*" if p.get("chosen") else " "
            lines.append(f" {mark} {p['name']:<9} {float(p['score']):10.2f}  {p['rule']}")
    return lines


def _chunk_lines(details: Mapping[str, Any]) -> list[str]:
    """A synchronous plan's devices priced one stage a device and two (the device-level
    schedules), each with its predicted iteration time; the fastest marked ``*``."""
    rows: Sequence[Mapping[str, Any]] = details.get("chunk_candidates") or ()
    if not rows:
        return []
    lines = ["schedules on the plan's devices, predicted iteration time (idle host):"]
    for r in rows:
        mark = "*" if r.get("best") else " "
        t = r.get("iteration_s")
        figure = f"{float(t):9.4f} s" if t is not None else f"{'-':>11}"
        kind = r["kind"] + (f" (warm-up +{r['warmup']})" if r.get("warmup") else "")
        where = ",".join(r["devices"])
        layers = f" layers {r['layers']}" if r.get("layers") else ""
        why = f"  ({r['why']})" if r.get("why") else ""
        lines.append(f" {mark} {kind:<22} {figure}  {r['chunks']} a device: {where}{layers}{why}")
    return lines


def _choice_lines(details: Mapping[str, Any]) -> list[str]:
    """The devices the search left out (with the predicted samples/s with and without
    each), each VW's rate and share of the job's samples, and the staleness rule's verdict
    per VW (:mod:`hetpipe.planner.staleness`)."""
    lines = []
    for e in details.get("left_out") or ():
        lines.append(
            f"left out: {e['device']} ({e['type']}, {e['node']}) from VW "
            f"{','.join(e['vw_devices'])}: predicted {float(e['with_samples_per_s']):.2f} "
            f"samples/s with it, {float(e['without_samples_per_s']):.2f} without"
        )
    shares: Sequence[Mapping[str, Any]] = details.get("vw_shares") or ()
    st: Mapping[str, Any] = details.get("staleness") or {}
    factors = st.get("factors") or ()
    if shares:
        lines.append(
            "virtual workers, predicted samples/s and share of the job's samples "
            "(under WSP each VW runs at its own pace, so a faster VW trains on more of the data):"
        )
        for s in shares:
            v = int(s["vw"])
            f = float(factors[v]) if v < len(factors) else 1.0
            weight = f"  staleness x{f:.2f}" if f < 1.0 else ""
            lines.append(
                f"  VW {v}: {float(s['samples_per_s']):10.2f} {float(s['share']):6.1%}  "
                f"Nm={s['nm']}{weight}  {','.join(s['devices'])}"
            )
    if st:
        lines.append(
            f"staleness rule: {st.get('rule')}; effective "
            f"{float(st.get('effective_samples_per_s', 0.0)):.2f} samples/s"
            + (f"; train.max_nm = {st['max_nm']}" if st.get("max_nm") is not None else "")
        )
    return lines
