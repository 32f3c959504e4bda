"""Resuming as a person follows it, at the CLI on real daemons: ``hetpipe down`` mid-job and
``hetpipe up`` say which job was resumed as which, from which wave; ``jobs`` and ``status``
show the link both ways; a second resume of the same job is refused in one line naming its
successor; a job without a checkpoint is still known after the restart, as failed with the
reason, never ``no job``. The pure parts (the texts, the head's restart records) without
processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import UNIFORM, job
from helpers import UpDown, cli_status, cli_until, hetpipe_cli, job_toml, stop_up_daemons

from hetpipe.jobstore import links, read_result, recovered_line, summary, update_result
from hetpipe.views import job_line, render_result

# -- pure -------------------------------------------------------------------------------------


def test_the_link_reads_both_ways() -> None:
    new = {
        "id": "t-2",
        "state": "running",
        "resumed_from": {"job": "t-1", "wave": 10, "checkpoint": "/x"},
    }
    old = {"id": "t-1", "state": "resumed", "error": "the head is shutting down"}
    old["resumed_as"] = "t-2"
    assert links(new) == ["resumed from t-1 at wave 10"]
    assert links(old) == ["resumed as t-2"]
    assert "resumed from t-1 at wave 10" in job_line(summary(new))
    assert "resumed as t-2" in job_line(summary(old))
    assert render_result(old).endswith("resumed as t-2")


def test_what_up_says_of_the_previous_heads_jobs() -> None:
    assert recovered_line({"job": "t-1", "as": "t-3", "wave": 20}) == (
        "resumed job t-1 as t-3 from wave 20"
    )
    assert recovered_line({"job": "t-2", "error": "no complete checkpoint"}) == (
        "job t-2 not resumed: no complete checkpoint"
    )


def test_a_result_is_updated_or_made_from_the_record(tmp_path: Path) -> None:
    update_result(tmp_path, "t-1", {"id": "t-1", "state": "failed"}, resumed_as="t-2")
    assert read_result(tmp_path, "t-1") == {"id": "t-1", "state": "failed", "resumed_as": "t-2"}
    update_result(tmp_path, "t-1", {"id": "other"}, state="resumed")
    assert read_result(tmp_path, "t-1") == {"id": "t-1", "state": "resumed", "resumed_as": "t-2"}


# -- real daemons through the CLI -------------------------------------------------------------


def _job_file(path: Path, name: str, every: int) -> Path:
    spec = job(
        name,
        model="mlp",
        split=[(["gpu0", "gpu1"], [3, 3])],
        nm=2,
        minibatches=200_000,  # still running whenever the test stops it
        train={"checkpoint_every": every},
    )
    path.write_text(job_toml(spec))
    return path


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_down_and_up_mid_job_say_what_was_resumed_as_what(tmp_path: Path) -> None:
    c = UpDown(tmp_path, UNIFORM[:2])
    cluster, run_dir, pids, up, down = c.cluster, c.run_dir, c.pids, c.up, c.down

    try:
        up()
        sub = hetpipe_cli(cluster, run_dir, "submit", str(_job_file(tmp_path / "a.toml", "ux", 5)))
        assert sub.returncode == 0, sub.stderr
        old = sub.stdout.strip()
        cli_until(cluster, run_dir, old, lambda i: i.get("checkpoints", 0) >= 1, 120)
        down()
        said = up()
        resumed = [x for x in said.splitlines() if x.startswith(f"up: resumed job {old} as ")]
        assert len(resumed) == 1, said
        new = resumed[0].split(" as ")[1].split()[0]
        assert new != old and " from wave " in resumed[0], resumed
        wave = int(resumed[0].rsplit(" ", 1)[1])

        # the new job names the old one, and from where it went on
        info = cli_status(cluster, run_dir, new)
        assert info["resumed_from"]["job"] == old and info["resumed_from"]["wave"] == wave
        text = hetpipe_cli(cluster, run_dir, "status", new)
        assert f"resumed from {old} at wave {wave}" in text.stdout, text.stdout
        # the old job names its successor, in its status and in the listing
        info = cli_status(cluster, run_dir, old)
        assert info["resumed_as"] == new and info["state"] == "resumed", info
        text = hetpipe_cli(cluster, run_dir, "status", old)
        assert f"resumed as {new}" in text.stdout, text.stdout
        listing = hetpipe_cli(cluster, run_dir, "jobs").stdout.splitlines()
        assert any(x.startswith(old) and f"resumed as {new}" in x for x in listing), listing
        assert any(x.startswith(new) and f"resumed from {old}" in x for x in listing), listing

        # resuming the old job again would train it twice: refused, naming the successor
        again = hetpipe_cli(cluster, run_dir, "submit", "--resume", old)
        assert again.returncode == 1
        lines = again.stderr.strip().splitlines()
        assert len(lines) == 1 and f"already resumed as {new}" in lines[0], again.stderr
        assert hetpipe_cli(cluster, run_dir, "cancel", new).returncode == 0
        cli_until(cluster, run_dir, new, lambda i: i["state"] == "cancelled", 60)

        # a job without a checkpoint when the head stops: known after, failed and why
        sub = hetpipe_cli(
            cluster, run_dir, "submit", str(_job_file(tmp_path / "b.toml", "nock", 0))
        )
        assert sub.returncode == 0, sub.stderr
        bare = sub.stdout.strip()
        cli_until(cluster, run_dir, bare, lambda i: i.get("minibatches", 0) >= 4, 120)
        os.kill(pids["ps0"], signal.SIGKILL)  # the head dies under it, writing nothing
        time.sleep(0.5)
        down()
        said = up()
        assert f"up: job {bare} not resumed: " in said and "no complete checkpoint" in said, said
        info = cli_status(cluster, run_dir, bare)
        assert info["state"] == "failed" and "no complete checkpoint" in info["error"], info
        text = hetpipe_cli(cluster, run_dir, "status", bare)
        assert text.returncode == 0 and "no job" not in text.stdout + text.stderr
        down()
    finally:
        stop_up_daemons(cluster, run_dir, pids)
