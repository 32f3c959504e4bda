"""A user's own data set trained on real daemons, read through a shuffling ``DataLoader`` with
two loader workers: the weights equal plain PyTorch over the same order (<= 1e-5)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import userdata
from conftest import UNIFORM, assert_same_weights, edited, job, running_until
from helpers import plain_training, records_by_index, rss_mb

from hetpipe import checkpoint
from hetpipe.data import MinibatchStream, load_data
from hetpipe.jobstore import read_chunks, records_path
from hetpipe.localcluster import LocalCluster, cluster_toml
from hetpipe.views import render_result

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Four devices, two shards; the daemons can (and may) import ``userdata``. Every
    minibatch's record is streamed to the head as it finishes (``records_every = 1``), so a
    cancelled job's records hold every minibatch its checkpoints hold."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(
            "PYTHONPATH", os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
        )
        root = tmp_path_factory.mktemp("userdata")
        path = root / "cluster.toml"
        text = cluster_toml(UNIFORM, shards=2, allowed_modules=("userdata",))
        path.write_text(edited(text, "[runtime]\n", "[runtime]\nrecords_every = 1\n"))
        c = LocalCluster(path, root / "run", timeout=60).__enter__()
    yield c
    c.stop()


def data_job(name: str, split: list, **kw: Any) -> dict[str, Any]:
    spec = job(name, model="mlp", split=split, minibatch=16, **kw)
    spec["data"] = {"name": "userdata:pairs", "args": {"n": 160, "n_val": 32}, "workers": 2}
    return spec


@pytest.mark.timeout(240)
@pytest.mark.parametrize("k", [2, 4])
def test_async_transparency_with_a_real_loader(cluster: LocalCluster, k: int) -> None:
    """One VW, Nm = 1: 14 minibatches of an epoch of 10 (the second epoch reshuffled)."""
    layers = {2: [3, 3], 4: [1, 2, 2, 1]}[k]
    spec = data_job(f"data-async-{k}", [([f"gpu{i}" for i in range(k)], layers)], minibatches=14)
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    assert_same_weights(torch.load(info["model_path"]), plain_training(spec, 14))
    assert info["test_accuracy"] is not None  # the head's accuracy on the user's val set


@pytest.mark.timeout(240)
def test_sync_two_vws_train_on_the_union_of_their_shards(cluster: LocalCluster) -> None:
    """1f1b, two VWs of M = 2: SGD on the union of both VWs' disjoint shards per iteration."""
    split = [(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [2, 4])]
    spec = data_job("data-sync", split, nm=2, minibatches=8, train={"schedule": "1f1b"})
    info = cluster.submit(spec, timeout=200)
    assert info["state"] == "done", info.get("error")
    assert_same_weights(torch.load(info["model_path"]), plain_training(spec, 4, m=2, vws=2))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["1f1b", "async"])
def test_a_job_stopped_mid_epoch_and_resumed_reads_on_where_it_stopped(
    cluster: LocalCluster, schedule: str
) -> None:
    """Cancelled after its first checkpoints, mid-epoch, and resumed: each first stage opens
    its loader at the checkpoint's data position, so the job ends with the weights of the
    uninterrupted one (plain PyTorch over the same order), every sample of each epoch read
    once in what the weights hold."""
    nm = 2 if schedule == "1f1b" else 1
    # minibatches (an epoch is 10: 160 samples of 16); long enough that the cancel below
    # lands before the job could end, on a busy machine too
    total = 300
    spec = data_job(
        f"data-resume-{schedule}",
        [(["gpu0", "gpu1"], [3, 3])],
        nm=nm,
        minibatches=total,
        train={"schedule": schedule, "checkpoint_every": 2},
    )

    async def stop_then_resume() -> tuple[dict[str, Any], list[int]]:
        async with cluster.client() as head:
            job_id = await head.submit(spec)
            await running_until(
                head,
                job_id,
                lambda i: i.get("checkpoints", 0) >= 2 and min(i.get("positions") or [0]) >= 4,
                120,
                every=0.02,
            )
            await head.cancel(job_id)
            stopped = await head.follow(job_id, every_s=0.1, timeout=60)
            assert stopped["state"] == "cancelled", stopped.get("error")
            new_id = await head.submit(None, resume=job_id)
            info = await head.follow(new_id, every_s=0.2, timeout=200)
            return info, info["resumed_from"]["positions"]

    info, starts = cluster.run(stop_then_resume())
    assert info["state"] == "done", info.get("error")
    assert 0 < starts[0] < total and starts[0] % nm == 0, starts  # it stopped mid-job
    steps = total // nm
    want = plain_training(spec, steps, m=nm) if nm > 1 else plain_training(spec, steps)
    assert_same_weights(torch.load(info["model_path"]), want)
    if schedule == "1f1b":  # synchronous: the uninterrupted job's own weights, within 1e-6
        whole = cluster.submit({**spec, "name": "data-whole-1f1b"}, timeout=200)
        assert whole["state"] == "done", whole.get("error")
        assert_same_weights(
            torch.load(info["model_path"]), torch.load(whole["model_path"]), tol=1e-6
        )


def _global_positions(info: dict[str, Any], starts: list[int]) -> dict[int, list[int]]:
    """Per VW, the job-wide positions of the minibatches its first stage trained, from the
    records (an attempt's ``p`` counts from its VW's data position ``starts``): a finished
    job's in its stages.json, a cancelled one's as its stages streamed them."""
    if info["state"] == "done":
        rows = records_by_index(info)
        return {v: [start + int(r["p"]) for r in rows[(v, 0)]] for v, start in enumerate(starts)}
    d = Path(info["stages_path"]).parent
    out = {}
    for v, start in enumerate(starts):
        chunks = list(read_chunks(records_path(d, v, 0)))
        assert chunks and not any("every" in c for c in chunks)  # every record, none thinned
        out[v] = [start + int(row[0]) for c in chunks for row in c["records"]]  # row[0]: p
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("schedule", ["async", "1f1b"])
def test_a_stateful_stream_stopped_mid_epoch_resumes_from_its_state(
    cluster: LocalCluster, schedule: str
) -> None:
    """Two VWs read a stream that keeps its own position (torchdata's ``Stateful``), with two
    loader workers each; the job is cancelled after its first checkpoints and resumed. Each
    checkpoint holds every VW's stream state at its position, the resumed first stages read on
    from it, and the records of both runs (the stopped one's up to the checkpoint the resume
    took, which is what its weights hold) show every sample of each pass trained exactly once
    per pass. Synchronous: the resumed job ends with the uninterrupted job's weights."""
    nm = 2 if schedule == "1f1b" else 1
    total = 240  # per VW; a VW's pass is 9 minibatches (72 samples, 2 VWs, 4 a minibatch)
    spec = job(
        f"stateful-{schedule}",
        model="mlp",
        split=[(["gpu0", "gpu1"], [3, 3]), (["gpu2", "gpu3"], [3, 3])],
        nm=nm,
        minibatch=4,
        minibatches=total,
        train={"schedule": schedule, "checkpoint_every": 2},
    )
    spec["data"] = {"name": "userdata:stateful_stream", "args": {"n": 72, "n_val": 8}}
    spec["data"]["workers"] = 2

    async def stop_then_resume() -> tuple[dict[str, Any], dict[str, Any]]:
        async with cluster.client() as head:
            job_id = await head.submit(spec)
            await running_until(
                head,
                job_id,
                lambda i: i.get("checkpoints", 0) >= 2 and min(i.get("positions") or [0]) >= 12,
                200,
                every=0.02,
            )
            await head.cancel(job_id)
            stopped = await head.follow(job_id, every_s=0.1, timeout=60)
            assert stopped["state"] == "cancelled", stopped.get("error")
            new_id = await head.submit(None, resume=job_id)
            return stopped, await head.follow(new_id, every_s=0.2, timeout=300)

    stopped, info = cluster.run(stop_then_resume())
    assert info["state"] == "done", info.get("error")
    came = info["resumed_from"]
    starts = [int(x) for x in came["positions"]]
    assert all(0 < s < total for s in starts), starts  # it stopped mid-job
    ck = checkpoint.verify(Path(came["checkpoint"]))
    for v in range(2):  # the checkpoint holds each VW's stream state at its position
        state = ck.meta["stages"][checkpoint.stage_file(v, 0)]["meta"]["data"]
        assert state["position"] == starts[v] and state["vw"] == v, state
    before = _global_positions(stopped, [0, 0])
    after = _global_positions(info, starts)
    src = load_data("userdata:stateful_stream", {"n": 72})
    counts: Counter[tuple[int, int]] = Counter()
    for v in range(2):
        trained = [p for p in before[v] if p < starts[v]] + after[v]
        assert sorted(trained) == list(range(total)), v  # every position once, none twice
        with MinibatchStream(src, 4, spec["train"]["seed"], v, 2).reader(0) as reader:
            for p in range(total):  # the uninterrupted VW's minibatch p
                counts.update((p // 9, i) for i in userdata.ident(reader.get(p)[0]))
    passes = total // 9
    assert all(counts[(k, i)] == 1 for k in range(passes) for i in range(72)), counts
    assert max(counts.values()) == 1  # the last, partial pass: no sample twice either
    if schedule == "1f1b":
        whole = cluster.submit({**spec, "name": "stateful-whole-1f1b"}, timeout=300)
        assert whole["state"] == "done", whole.get("error")
        assert_same_weights(
            torch.load(info["model_path"]), torch.load(whole["model_path"]), tol=1e-6
        )


@pytest.mark.timeout(120)
def test_a_data_set_without_validation_set_trains_and_says_so(cluster: LocalCluster) -> None:
    spec = data_job("data-no-val", [(["gpu0", "gpu1"], [3, 3])], minibatches=4)
    spec["data"] = {"name": "userdata:train_only", "args": {"n": 64}}
    info = cluster.submit(spec, timeout=100)
    assert info["state"] == "done", info.get("error")
    assert info["test_accuracy"] is None
    assert "no validation set" in render_result(info)


@pytest.mark.timeout(240)
def test_a_10_gib_data_set_trains_in_little_memory(cluster: LocalCluster) -> None:
    """10 GiB of training samples made on the fly: no process holds the data set (each
    daemon stays under 1 GiB resident), and the head keeps only the validation set, so its
    memory is the same as for a data set a thousand times smaller."""
    heads = {}
    for gib in (10.0, 0.01):
        spec = job(f"generated-{gib}", model="mlp", split=[(["gpu0", "gpu1"], [2, 2])])
        spec["model"]["args"] = {
            "in_features": 3 * 64 * 64,
            "hidden": [16],
            "in_shape": [3, 64, 64],
        }
        spec["data"] = {"name": "userdata:generated", "args": {"gib": gib}, "workers": 2}
        spec["train"].update(minibatch=16, minibatches=12)
        info = cluster.submit(spec, timeout=200)
        assert info["state"] == "done", info.get("error")
        sizes = {name: rss_mb(proc.pid) for name, proc in cluster.procs.items()}
        assert max(sizes.values()) < 1024, sizes
        heads[gib] = sizes["ps0"]
    assert heads[10.0] < heads[0.01] + 64, heads
