"""Files a weeks-long job writes stay bounded: rotation (logs, metrics.jsonl) keeps the
newest lines whole and at most ``keep`` older files; thinning (record streams) keeps a
stream under its budget however long it runs, with every part of the run represented."""

from __future__ import annotations

import itertools
import json

from hetpipe.rotation import RotatingJsonl, Thinning, append_line, halve_lines, shift


def test_shift_moves_each_file_one_down_and_drops_past_keep(tmp_path) -> None:
    p = tmp_path / "m.jsonl"
    for i in range(4):
        p.write_text(str(i))
        shift(p, keep=2)
    assert not p.exists()
    assert (tmp_path / "m.jsonl.1").read_text() == "3"
    assert (tmp_path / "m.jsonl.2").read_text() == "2"
    assert not (tmp_path / "m.jsonl.3").exists()


def test_shift_with_keep_zero_removes_the_file(tmp_path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text("x")
    shift(p, keep=0)
    assert list(tmp_path.iterdir()) == []


def test_rotating_jsonl_keeps_every_file_under_its_size_and_the_newest_lines(tmp_path) -> None:
    f = RotatingJsonl(tmp_path / "d" / "metrics.jsonl", max_bytes=200, keep=2)
    for i in range(100):
        f.append({"i": i, "pad": "x" * 20})
    files = sorted((tmp_path / "d").iterdir())
    assert [p.name for p in files] == ["metrics.jsonl", "metrics.jsonl.1", "metrics.jsonl.2"]
    assert all(p.stat().st_size <= 200 for p in files)
    newest = [json.loads(x)["i"] for x in files[0].read_text().splitlines()]
    older = [json.loads(x)["i"] for x in files[1].read_text().splitlines()]
    assert newest[-1] == 99 and older[-1] == newest[0] - 1  # no line lost between them


def test_a_line_longer_than_the_limit_still_lands(tmp_path) -> None:
    p = tmp_path / "m.jsonl"
    append_line(p, "a" * 50, max_bytes=10, keep=1)
    append_line(p, "b" * 50, max_bytes=10, keep=1)
    assert p.read_text() == "b" * 50 + "\n"
    assert (tmp_path / "m.jsonl.1").read_text() == "a" * 50 + "\n"


def test_halve_lines_keeps_every_other_complete_line(tmp_path) -> None:
    p = tmp_path / "s.jsonl"
    p.write_text("".join(f"{i}\n" for i in range(7)) + "partial")
    halve_lines(p)
    assert p.read_text() == "0\n2\n4\n6\n"


def test_a_thinned_stream_of_any_length_stays_near_its_budget_and_spans_the_run(
    tmp_path,
) -> None:
    """Chunks offered one by one: the stream never passes its budget by more than a chunk,
    and what it keeps reaches from the first chunk to the last stride, about evenly."""
    path = tmp_path / "s.jsonl"
    chunk = 100
    stream = Thinning(budget=10_000)
    largest = 0
    for n in range(20_000):
        if stream.keep():
            with path.open("a") as f:
                f.write(json.dumps({"n": n, "every": stream.every}).ljust(chunk - 1) + "\n")
            stream.written(path)
            largest = max(largest, path.stat().st_size)
    assert largest <= 10_000 + chunk
    kept = [json.loads(x)["n"] for x in path.read_text().splitlines()]
    assert kept[0] == 0 and kept[-1] >= 20_000 - stream.every
    assert stream.every >= 2 and len(kept) >= 10_000 // chunk // 2
    gaps = {b - a for a, b in itertools.pairwise(kept)}
    assert max(gaps) <= 2 * stream.every  # every part of the run represented
