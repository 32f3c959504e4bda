"""``hetpipe schedule``: export, import and check of torch-format CSV schedules (no cluster)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from hetpipe.cli import main
from hetpipe.core.schedule import microbatch_order
from hetpipe.core.schedule_csv import dumps, load


def ours(kind: str, k: int, m: int, warmup: int = 0) -> tuple:
    return tuple(microbatch_order(kind, k, s, m, warmup) for s in range(k))


def run(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(main, ["schedule", *args])


JOB = """name = "imported"
[model]
name = "mlp"
[train]
minibatch = 8
nm = 4
minibatches = 8
schedule = "1f1b"
{extra}
[[vw]]
devices = ["gpu0", "gpu1", "gpu2"]
"""

BROKEN = "0F0,0B0,0F1,0B1\r\n1F0,1F1,1B0,1B1\r\n"


def test_export_a_kind_to_stdout_and_to_a_file(tmp_path: Path) -> None:
    r = run("export", "--kind", "1f1b", "-k", "4", "-m", "6")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == dumps(ours("1f1b", 4, 6)).splitlines()
    out = tmp_path / "g.csv"
    r = run("export", "--kind", "gpipe", "-k", "2", "-m", "3", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert load(out) == ours("gpipe", 2, 3)
    r = run("export", "-k", "3", "-m", "4", "--warmup", "1")
    assert load_text(r.stdout) == ours("1f1b", 3, 4, 1)


def load_text(text: str) -> tuple:
    from hetpipe.core.schedule_csv import loads

    return loads(text)


def test_export_a_job_file(tmp_path: Path) -> None:
    jobfile = tmp_path / "job.toml"
    jobfile.write_text(JOB.format(extra="warmup_forwards = 1"))
    r = run("export", str(jobfile))
    assert r.exit_code == 0, r.output
    assert load_text(r.stdout) == ours("1f1b", 3, 4, 1)
    r = run("export", str(jobfile), "--kind", "gpipe")  # the job's shape, another kind
    assert load_text(r.stdout) == ours("gpipe", 3, 4)
    # a job with an imported order exports that order
    (tmp_path / "o.csv").write_text(dumps(ours("gpipe", 3, 4)))
    jobfile.write_text(JOB.format(extra='order = "o.csv"\nwarmup_forwards = 3'))
    r = run("export", str(jobfile))
    assert r.exit_code == 0, r.output
    assert load_text(r.stdout) == ours("gpipe", 3, 4)


def test_export_needs_a_shape() -> None:
    r = run("export", "--kind", "gpipe")
    assert r.exit_code == 2 and "give a job file, or -k" in r.output


def test_import_prints_checks_and_writes_a_file_a_job_uses(tmp_path: Path) -> None:
    src = tmp_path / "torch.csv"  # torch's compute_comms format, one 1F1B
    src.write_text(
        "0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1,0REDUCE_GRAD\r\n"
        "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1,1REDUCE_GRAD\r\n"
    )
    out = tmp_path / "order.csv"
    r = run("import", str(src), "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "stage 0: F0 F1 B0 B1\nstage 1: F0 B0 F1 B1\n" in r.stdout
    assert "equals hetpipe's 1f1b" in r.stdout
    assert out.read_bytes() == dumps(ours("1f1b", 2, 2)).encode()  # torch's CRLF rows
    # the file it wrote runs in a job
    jobfile = tmp_path / "job.toml"
    jobfile.write_text(
        JOB.format(extra='order = "order.csv"').replace('"gpu1", "gpu2"', '"gpu1"')
        .replace("nm = 4", "nm = 2")
    )  # fmt: skip
    r = run("check", str(jobfile))
    assert r.exit_code == 0, r.output


def test_import_refuses_a_malformed_file_in_one_line(tmp_path: Path) -> None:
    src = tmp_path / "bad.csv"
    src.write_text("0F0,0B0\r\n0F0,1B0\r\n")
    r = run("import", str(src))
    assert r.exit_code == 1
    assert r.output == (
        f"Error: {src}: row 2, column 1: '0F0' runs stage 0 on the rank of stage 1: hetpipe "
        "runs one stage per rank (no interleaved or V-shaped chunks), stage index = row - 1\n"
    )


def test_check_names_the_blocking_action(tmp_path: Path) -> None:
    src = tmp_path / "broken.csv"
    src.write_text(BROKEN)
    r = run("check", str(src))
    assert r.exit_code == 1
    assert r.output == (
        "Error: dry run: stage 0, action 2 (B0) can never run: waits for stage 1's B0, which "
        "comes after stage 1's action 2 (F1), which waits for stage 0's F1, which comes after "
        "stage 0's action 2 (B0): a cycle\n"
    )
    src.write_text(dumps(ours("1f1b", 4, 8)))
    r = run("check", str(src))
    assert r.exit_code == 0 and r.output == "ok: 4 stages, 8 microbatches, every action runs\n"
    r = run("check", str(src), "-m", "9")
    assert r.exit_code == 1 and r.output.startswith("Error: dry run: stage 0: microbatch 8")


def test_check_a_job_refuses_its_broken_order_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken.csv").write_text(BROKEN)
    jobfile = tmp_path / "job.toml"
    jobfile.write_text(
        JOB.format(extra='order = "broken.csv"\nwarmup_forwards = 1')
        .replace(', "gpu2"', "").replace("nm = 4", "nm = 2")
    )  # fmt: skip
    r = run("check", str(jobfile))
    assert r.exit_code == 1 and r.output.count("\n") == 1
    assert r.output.startswith(f"Error: {jobfile}: train.order: dry run: stage 0, action 2 (B0)")
