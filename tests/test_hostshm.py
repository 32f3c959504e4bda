"""Tensors between worker processes of one host through shared memory (hetpipe.hostshm)."""

from __future__ import annotations

import math
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import UNIFORM, assert_same_weights, job, start_cluster
from helpers import stages_json

from hetpipe import hostshm
from hetpipe.data.evaluate import VAL_BATCH
from hetpipe.hostshm import Inbox, Outbox, parse, sweep

pytestmark = pytest.mark.skipif(not hostshm.available(), reason="no /dev/shm on this host")


def files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(32, 64, 8, 8),
        torch.randn(5, 7).to(torch.bfloat16),
        torch.arange(12, dtype=torch.int64).reshape(3, 4),
        torch.tensor([True, False, True]),
        torch.tensor(3.5),
        torch.zeros(0, 4),
        torch.randn(6, 4).t(),  # not contiguous
    ],
)
def test_a_put_tensor_is_taken_back_equal_and_its_file_handed_back(tmp_path, t) -> None:
    box = Outbox(tmp_path)
    d = box.put(t)
    assert files(tmp_path) == {d["file"]}
    assert (os.stat(tmp_path / d["file"]).st_mode & 0o777) == 0o600
    got = Inbox(tmp_path).take(parse(d))
    assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    assert files(tmp_path) == {d["file"] + hostshm.FREE}  # its name is gone
    got.zero_()  # its own memory: the sender's file is not touched
    box.close()
    assert files(tmp_path) == set()
    assert box.sent == 1


def test_a_handed_back_file_carries_the_next_tensor_of_its_size(tmp_path) -> None:
    box, inbox = Outbox(tmp_path), Inbox(tmp_path)
    first = box.put(torch.full((1000,), 1.0))
    inode = os.stat(tmp_path / first["file"]).st_ino
    inbox.take(parse(first))
    again = box.put(torch.full((1000,), 2.0))
    other = box.put(torch.full((10,), 3.0))  # another size: a new file
    assert again["file"] != first["file"]  # a new name: the old description reads nothing
    assert os.stat(tmp_path / again["file"]).st_ino == inode and box.reused == 1
    assert files(tmp_path) == {again["file"], other["file"]}
    # the receiver reads the rewritten file through the mapping it kept
    assert torch.equal(inbox.take(parse(again)), torch.full((1000,), 2.0))
    assert len(inbox.mapped) == 1
    with pytest.raises(ValueError, match="No such file"):
        inbox.take(parse(first))  # a replayed description
    inbox.close()
    box.close()
    assert files(tmp_path) == set() and not inbox.mapped


def test_many_messages_through_kept_mappings_arrive_intact(tmp_path) -> None:
    """Tensors of two sizes back and forth many times: each arrives as sent, though each
    side writes and reads the same few files through the mappings it keeps."""
    box, inbox = Outbox(tmp_path), Inbox(tmp_path)
    for i in range(50):
        shape = (64, 33) if i % 3 else (7, 1000)
        sent = [torch.randn(shape) for _ in range(1 + i % 3)]  # a few in flight at once
        got = [inbox.take(parse(d)) for d in [box.put(t) for t in sent]]
        assert all(torch.equal(a, b) for a, b in zip(got, sent, strict=True))
    assert box.sent == sum(1 + i % 3 for i in range(50)) and box.reused == box.sent - 4
    assert len(inbox.mapped) == 4  # the files in rotation: 3 of one size, 1 of the other
    inbox.close()
    box.close()
    assert files(tmp_path) == set()


def _take_and_sum(directory: str, todo: Any, done: Any) -> None:
    """A receiver process: take every description from ``todo``, answer its tensor's sum."""
    inbox = Inbox(Path(directory))
    while (d := todo.get(timeout=60)) is not None:
        done.put(float(inbox.take(parse(d)).double().sum()))
    inbox.close()


@pytest.mark.timeout(120)
def test_tensors_reach_another_process_intact_through_the_files_it_keeps_mapped(tmp_path) -> None:
    """Two processes, as two stages: each of many tensors of three sizes, some in flight at
    once, arrives with its sum, though the sender rewrites the few files the receiver keeps
    mapped."""
    ctx = multiprocessing.get_context("spawn")
    todo, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_take_and_sum, args=(str(tmp_path), todo, done))
    proc.start()
    try:
        box, g = Outbox(tmp_path), torch.Generator().manual_seed(0)
        shapes = [(32, 64, 8, 8), (32, 128, 4, 4), (7, 1000)]
        for i in range(100):
            sent = [torch.randn(shapes[(i + j) % 3], generator=g) for j in range(1 + i % 4)]
            for t in sent:
                todo.put(box.put(t))
            got = [done.get(timeout=60) for _ in sent]
            assert got == pytest.approx([float(t.double().sum()) for t in sent], abs=1e-6)
        assert box.reused > 200  # the same files carried most of them
        todo.put(None)
        proc.join(timeout=60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    box.close()
    assert files(tmp_path) == set()


def test_a_receiver_keeps_few_files_mapped(tmp_path) -> None:
    box, inbox = Outbox(tmp_path), Inbox(tmp_path)
    placed = [
        box.put(torch.full((100 + i,), float(i))) for i in range(hostshm.KEEP_MAPPED + 4)
    ]  # all sizes differ: all new files
    for i, d in enumerate(placed):
        assert torch.equal(inbox.take(parse(d)), torch.full((100 + i,), float(i)))
    assert len(inbox.mapped) == hostshm.KEEP_MAPPED  # the least recently read went
    last = os.stat(tmp_path / (placed[-1]["file"] + hostshm.FREE))
    assert next(reversed(inbox.mapped)) == (last.st_dev, last.st_ino)
    inbox.close()
    box.close()


def test_a_handed_back_file_replaced_by_another_is_removed_not_written(tmp_path) -> None:
    """Under the handed-back name lies a private file of the right size, but not the one the
    sender keeps mapped: writing the mapping would send bytes the receiver never reads."""
    box = Outbox(tmp_path)
    d = box.put(torch.ones(1000))
    Inbox(tmp_path).take(parse(d))
    back = tmp_path / (d["file"] + hostshm.FREE)
    back.unlink()
    fd = os.open(back, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"\0" * 4000)
    os.close(fd)
    again = box.put(torch.full((1000,), 5.0))
    assert box.reused == 0 and files(tmp_path) == {again["file"]}
    assert torch.equal(Inbox(tmp_path).take(parse(again)), torch.full((1000,), 5.0))
    box.close()


def test_shared_memory_that_cannot_hold_a_tensor_refuses_it_without_a_file(
    tmp_path, monkeypatch
) -> None:
    """A full ``/dev/shm`` fails when the file's pages are allocated, before any is mapped
    (a write into an unallocated mapping would kill the process): the tensor stays in the
    message and no file is left."""

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    box = Outbox(tmp_path)
    big = torch.zeros(hostshm.MIN_BYTES // 4)
    placed, rest = box.place({"x": big})
    assert placed == {} and rest["x"] is big
    assert box.error == f"{tmp_path}: No space left on device"
    assert files(tmp_path) == set()


def test_a_handed_back_file_that_fails_the_checks_is_removed_not_written(tmp_path) -> None:
    box = Outbox(tmp_path)
    d = box.put(torch.ones(1000))
    Inbox(tmp_path).take(parse(d))
    os.chmod(tmp_path / (d["file"] + hostshm.FREE), 0o644)  # someone opened it up
    again = box.put(torch.ones(1000))
    assert box.reused == 0 and files(tmp_path) == {again["file"]}
    assert (os.stat(tmp_path / again["file"]).st_mode & 0o777) == 0o600
    box.close()


def test_the_outbox_keeps_few_handed_back_files_and_removes_all_when_it_closes(tmp_path) -> None:
    box = Outbox(tmp_path)
    placed = [box.put(torch.full((1000,), float(i))) for i in range(hostshm.KEEP_FREE + 3)]
    for d in placed[:-1]:
        Inbox(tmp_path).take(parse(d))
    box.put(torch.ones(3))  # each put collects what came back
    assert [e[0] for e in box.pending] == [placed[-1]["file"], box.pending[-1][0]]
    assert len(box.free[4000]) == hostshm.KEEP_FREE  # the rest were removed
    assert len(files(tmp_path)) == hostshm.KEEP_FREE + 2
    box.settle()  # the stage ended: what came back goes, what is untaken stays a while
    assert files(tmp_path) == {e[0] for e in box.pending}
    box.close()
    assert files(tmp_path) == set() and not box.pending and not box.free


def test_place_puts_large_host_tensors_only_and_falls_back_when_refused(tmp_path) -> None:
    big, small = torch.zeros(hostshm.MIN_BYTES // 4), torch.zeros(hostshm.MIN_BYTES // 4 - 1)
    box = Outbox(tmp_path)
    placed, rest = box.place({"x": big, "y": small})
    assert set(placed) == {"x"} and set(rest) == {"y"} and not box.error
    gone = Outbox(tmp_path / "missing")  # shared memory that refuses: nothing is lost
    placed, rest = gone.place({"x": big, "y": small})
    assert placed == {} and set(rest) == {"x", "y"}
    assert "missing" in gone.error and "\n" not in gone.error
    placed, rest = gone.place({"x": big})  # and it is not tried again
    assert placed == {} and rest["x"] is big
    box.close()


@pytest.mark.parametrize(
    ("d", "says"),
    [
        ("x", "expected keys"),
        ({"file": "hetpipe-1-2-0000abcd", "dtype": "float32", "shape": [1]}, "expected keys"),
        (
            {"file": "../../etc/passwd", "dtype": "uint8", "shape": [1], "nbytes": 1},
            "not a file name this runtime makes",
        ),
        (
            {"file": "hetpipe-1-2-0000abcd/x", "dtype": "uint8", "shape": [1], "nbytes": 1},
            "not a file name this runtime makes",
        ),
        ({"file": 7, "dtype": "uint8", "shape": [1], "nbytes": 1}, "not a file name"),
        (
            {"file": "hetpipe-1-2-0000abcd", "dtype": "complex4", "shape": [1], "nbytes": 1},
            "unknown dtype",
        ),
        (
            {"file": "hetpipe-1-2-0000abcd", "dtype": "float32", "shape": [-1], "nbytes": 4},
            "shape must be",
        ),
        (
            {"file": "hetpipe-1-2-0000abcd", "dtype": "float32", "shape": [True], "nbytes": 4},
            "shape must be",
        ),
        (
            {"file": "hetpipe-1-2-0000abcd", "dtype": "float32", "shape": [1] * 65, "nbytes": 4},
            "shape must be",
        ),
        (
            {"file": "hetpipe-1-2-0000abcd", "dtype": "float32", "shape": [2, 3], "nbytes": 4},
            "needs 24 bytes",
        ),
    ],
)
def test_malformed_descriptions_are_refused_in_one_line(d, says) -> None:
    with pytest.raises(ValueError, match=says) as e:
        parse(d)
    assert "\n" not in str(e.value)


def test_a_file_that_is_not_private_to_this_user_is_refused_and_left_alone(tmp_path) -> None:
    d = Outbox(tmp_path).put(torch.ones(4))
    path = tmp_path / d["file"]
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="not a private file of this user"):
        Inbox(tmp_path).take(parse(d))
    assert path.exists()


def test_a_link_a_missing_file_and_a_wrong_size_are_refused(tmp_path) -> None:
    box = Outbox(tmp_path)
    d = box.put(torch.ones(4))
    target = tmp_path / d["file"]
    link = {**d, "file": "hetpipe-1-2-0000abcd"}
    (tmp_path / link["file"]).symlink_to(target)
    with pytest.raises(ValueError, match="hetpipe-1-2-0000abcd: "):
        Inbox(tmp_path).take(parse(link))
    with pytest.raises(ValueError, match="No such file"):
        Inbox(tmp_path).take(parse({**d, "file": "hetpipe-1-3-0000abcd"}))
    with pytest.raises(ValueError, match="16 bytes, expected 8"):
        Inbox(tmp_path).take(parse({**d, "shape": [2], "nbytes": 8}))
    assert target.exists()


def test_sweep_removes_the_files_of_processes_that_are_gone_only(tmp_path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (tmp_path / f"hetpipe-{gone}-0-0000abcd").write_bytes(b"x")
    (tmp_path / f"hetpipe-{gone}-1-0000abcd{hostshm.FREE}").write_bytes(b"x")
    (tmp_path / f"hetpipe-{os.getpid()}-0-0000abcd").write_bytes(b"x")
    (tmp_path / "other-file").write_bytes(b"x")
    assert sweep(tmp_path) == 2
    assert files(tmp_path) == {f"hetpipe-{os.getpid()}-0-0000abcd", "other-file"}


def _sent(info: dict) -> dict[str, int]:
    data = stages_json(info)
    return {where: r["stats"]["shared_memory_sent"] for where, r in data.items()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shared_memory_between_stages_of_one_host_changes_no_weight(tmp_path) -> None:
    """The same job on one host with and without ``[runtime] host_shm``: every stage but the
    last sent its activations (and every one but the first its gradients) through shared
    memory in the first, none in the second, the weights are bit-identical, and no file is
    left behind."""
    split = [(["gpu0", "gpu1", "gpu2", "gpu3"], [4, 4, 4, 4])]
    # a synchronous schedule: its arithmetic does not depend on when messages arrive
    spec = job("shm", model="cnn", split=split, nm=4, minibatches=24, train={"schedule": "1f1b"})
    out = {}
    for on in (True, False):
        cluster = start_cluster(tmp_path / f"shm-{on}", UNIFORM, host_shm=on)
        try:
            pids = {p.pid for p in cluster.procs.values()}
            info = cluster.submit(spec, timeout=240)
            assert info["state"] == "done", info.get("error")
            out[on] = (torch.load(info["model_path"]), _sent(info))
        finally:
            cluster.stop()
        left = {
            n
            for n in files(hostshm.DIRECTORY)
            if n.startswith("hetpipe-") and int(n.split("-")[1]) in pids
        }
        assert not left, left
    (with_shm, sent_on), (without, sent_off) = out[True], out[False]
    # activations to 3 successors and gradients to 3 predecessors, 24 minibatches each, and
    # the job's end-of-job validation pass (the digits' 360 validation samples, in minibatches
    # of VAL_BATCH) forward through the first three; the cnn's activations at minibatch 32 are
    # all above the size that goes by file
    val = math.ceil(360 / VAL_BATCH)
    want = {"vw0/stage0": 24 + val, "vw0/stage1": 48 + val, "vw0/stage2": 48 + val}
    assert sent_on == {**want, "vw0/stage3": 24}, sent_on
    assert set(sent_off.values()) == {0}
    assert_same_weights(with_shm, without, tol=0.0)
