"""A job's directory stays under ``[runtime] job_dir_max_bytes`` (:mod:`hetpipe.jobdir`): a
record stream past its share folds its oldest chunks into summary windows that count every
minibatch, keeps its newest chunks whole, and the writers of stages.json and the trace say which
range is summarised (unit: no process started)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from hetpipe.jobdir import (
    WINDOW,
    bounded_bytes,
    compact,
    covered,
    merge,
    metrics_bytes,
    named,
    stream_budget,
    summarise,
)
from hetpipe.jobstore import (
    append_records,
    read_chunks,
    read_summaries,
    records_path,
    write_stages,
)
from hetpipe.rotation import halve_lines
from hetpipe.trace import write_chrome_trace

FIELDS = ["p", "wave", "loss"]


def _chunk(first: int, n: int) -> tuple[list[list[Any]], list[list[Any]]]:
    """Records ``[p, wave, loss]`` and a forward and a backward span for minibatches
    ``first`` .. ``first + n - 1``."""
    rows = [[p, p // 4, 1.0 / (p + 1)] for p in range(first, first + n)]
    spans = [["forward", 100.0 + p, 100.5 + p, p, p // 4] for p in range(first, first + n)]
    spans += [["backward", 100.5 + p, 101.0 + p, p, p // 4] for p in range(first, first + n)]
    return rows, spans


def _stream(d: Path, chunks: int, per: int, budget: int | None) -> Path:
    """A stage's stream of ``chunks`` chunks of ``per`` minibatches, compacted after each
    append as the head does (``budget`` None: never)."""
    for c in range(chunks):
        rows, spans = _chunk(c * per, per)
        append_records(d, 0, 0, rows, spans)
        if budget is not None:
            compact(records_path(d, 0, 0), budget)
    return records_path(d, 0, 0)


def test_summarise_counts_sums_extremes_and_percentiles() -> None:
    rows = [[p, 0, float(p)] for p in range(1, 101)] + [[101, 0, None]]
    spans = [["forward", 0.0, 1.0, 1, 0], ["forward", 2.0, 2.5, 2, 0], ["gate", 3.0, 4.0, 3, 0]]
    w = summarise(rows, spans)
    assert (w["from"], w["to"], w["count"], w["exact"]) == (1, 101, 101, True)
    loss = w["columns"][2]
    assert loss["n"] == 100 and loss["sum"] == 5050.0  # the missing loss is not a number
    assert (loss["min"], loss["max"], loss["p50"], loss["p90"], loss["p99"]) == (
        1.0,
        100.0,
        50.0,
        90.0,
        99.0,
    )
    assert w["spans"] == {
        "forward": {"count": 2, "seconds": 1.5},
        "gate": {"count": 1, "seconds": 1.0},
    }
    assert (w["t0"], w["t1"]) == (0.0, 4.0)


def test_merge_keeps_counts_sums_and_extremes_exact() -> None:
    a = summarise([[p, 0, float(p)] for p in range(10)], [["forward", 0.0, 1.0, 0, 0]])
    b = summarise([[p, 1, float(p)] for p in range(10, 30)], [["gate", 5.0, 7.0, 10, 1]])
    m = merge(a, b)
    assert (m["from"], m["to"], m["count"], m["exact"]) == (0, 29, 30, False)
    assert m["columns"][2]["sum"] == sum(range(30))
    assert (m["columns"][2]["min"], m["columns"][2]["max"]) == (0.0, 29.0)
    assert m["spans"]["forward"]["count"] == 1 and m["spans"]["gate"]["seconds"] == 2.0
    assert (m["t0"], m["t1"]) == (0.0, 7.0)


def test_budgets_share_the_job_directory() -> None:
    assert stream_budget(8 << 20, 4) == (8 << 20) // 8 // 4
    assert metrics_bytes(8 << 20, 64 << 20, 3) == (8 << 20) // 8 // 4  # lowered to its share
    assert metrics_bytes(1 << 40, 64 << 20, 3) == 64 << 20  # never above metrics_max_bytes


def test_a_compacted_stream_stays_under_its_budget_and_counts_every_minibatch(tmp_path) -> None:
    budget = 32 << 10
    chunks, per = 400, 16
    path = records_path(tmp_path, 0, 0)
    largest = 0
    for c in range(chunks):
        rows, spans = _chunk(c * per, per)
        append_records(tmp_path, 0, 0, rows, spans)
        compact(path, budget)
        largest = max(largest, path.stat().st_size)
    one_chunk = len(json.dumps({"records": rows, "spans": spans})) + 1
    assert largest <= budget + one_chunk
    windows = read_summaries(path)
    full = [r for c in read_chunks(path) for r in c["records"]]
    assert windows and full
    # every minibatch is either in a window or a full record, in order, none twice
    assert sum(w["count"] for w in windows) + len(full) == chunks * per
    assert [r[0] for r in full] == list(range(full[0][0], chunks * per))
    assert windows[-1]["to"] == full[0][0] - 1 and windows[0]["from"] == 0
    assert all(a["to"] < b["from"] for a, b in itertools.pairwise(windows))
    # the windows themselves stay under an eighth of the budget (merged in pairs)
    assert sum(len(json.dumps({"summary": w})) + 1 for w in windows) <= budget // 8 + 4096
    assert any(not w["exact"] for w in windows)
    assert covered(windows) == {
        "from": 0,
        "to": full[0][0] - 1,
        "count": full[0][0],
        "windows": len(windows),
    }


def test_windows_cover_about_window_minibatches_when_made(tmp_path) -> None:
    path = _stream(tmp_path, chunks=12, per=512, budget=None)
    compact(path, path.stat().st_size // 3)  # folds most chunks at once
    windows = read_summaries(path)
    assert [w["count"] for w in windows[:-1]] == [WINDOW] * (len(windows) - 1)
    assert all(w["exact"] for w in windows)


def test_a_stream_under_its_budget_is_left_alone(tmp_path) -> None:
    path = _stream(tmp_path, chunks=3, per=4, budget=None)
    before = path.read_bytes()
    assert not compact(path, 1 << 20)
    assert path.read_bytes() == before


def test_halving_keeps_every_summary_window(tmp_path) -> None:
    path = _stream(tmp_path, chunks=40, per=16, budget=16 << 10)
    windows = read_summaries(path)
    chunks = list(read_chunks(path))
    halve_lines(path)
    assert read_summaries(path) == windows
    assert list(read_chunks(path)) == chunks[::2]


def test_stages_json_and_trace_say_which_range_is_summarised(tmp_path) -> None:
    path = _stream(tmp_path, chunks=200, per=16, budget=24 << 10)
    report: dict[str, Any] = {"stats": {"record_fields": FIELDS}}
    summarised = write_stages(tmp_path, {"vw0/stage0": (report, path)})
    stage = json.loads((tmp_path / "stages.json").read_text())["vw0/stage0"]
    windows = stage["records_summary"]
    assert summarised == {"vw0/stage0": stage["records_summarised"]}
    first_full = stage["records"][0][0]
    assert stage["records_summarised"]["to"] == first_full - 1
    assert stage["records_summarised"]["count"] + len(stage["records"]) == 200 * 16
    assert set(windows[0]["columns"]) == set(FIELDS)  # named by record_fields
    assert windows[0]["columns"]["loss"]["max"] == 1.0
    spans = {"vw0/stage0": lambda: (s for c in read_chunks(path) for s in c["spans"])}
    write_chrome_trace(
        tmp_path / "trace.json",
        spans,
        {"vw0/stage0": "gpu0"},
        "j-1",
        summaries={"vw0/stage0": read_summaries(path)},
    )
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    summary = [e for e in events if e.get("cat") == "summary"]
    assert len(summary) == len(windows)
    assert sum(e["args"]["count"] for e in summary) == stage["records_summarised"]["count"]
    assert min(e["ts"] for e in events if e.get("ph") == "X") == 0.0  # the oldest window
    forwards = [e for e in events if e.get("cat") == "forward"]
    assert len(forwards) == len(stage["records"])  # the newest spans kept whole


def test_named_leaves_columns_unnamed_when_the_fields_do_not_match() -> None:
    w = summarise([[1, 2.0, None]], [])
    assert set(named(w, ["p", "x", "loss"])["columns"]) == {"p", "x"}
    assert set(named(w, ["p"])["columns"]) == {"column0", "column1"}


def test_the_key_is_declared_with_its_default() -> None:
    from hetpipe.config import RuntimeSpec
    from hetpipe.core.keys import CLUSTER

    assert CLUSTER.default("runtime.job_dir_max_bytes") == "256MiB"
    assert RuntimeSpec().job_dir_max_bytes == 256 << 20


def test_bounded_bytes_leave_out_checkpoints_and_models(tmp_path) -> None:
    (tmp_path / "checkpoints" / "000001").mkdir(parents=True)
    (tmp_path / "checkpoints" / "000001" / "weights.tensors").write_bytes(b"x" * 1000)
    (tmp_path / "model.pt").write_bytes(b"x" * 1000)
    (tmp_path / "stages.json").write_bytes(b"x" * 10)
    append_records(tmp_path, 0, 0, [[1]], [])
    assert bounded_bytes(tmp_path) == 10 + records_path(tmp_path, 0, 0).stat().st_size
