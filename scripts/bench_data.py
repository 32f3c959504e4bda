"""Input wait of a first stage reading a Dataset with per-sample CPU work, data.workers 0 against 2.

The data set holds images as compressed bytes: reading a sample decodes it (zlib, then
uint8 to float) and augments it (a random crop of the image padded by 4, a random flip,
normalisation), the CPU work an image pipeline does per sample. A first stage reads its
minibatches exactly as the runtime's does (:meth:`hetpipe.data.MinibatchStream.reader`, the
path of ``pipeline.StageRunner._my_batch``) and trains a small CNN on each (forward, backward,
SGD step, one intra-op thread as a worker's compute). Beside it, a plain PyTorch loop with
the same ``DataLoader`` settings (shuffled, same workers, prefetch and persistent workers)
and the same compute. Figures, per ``data.workers`` (0 and 2):

- ``input_wait_share``: the first stage's time waiting for its next minibatch over its
  whole time (target <= 0.05 with 2 workers: the loader keeps ahead of the compute);
- ``samples_per_s`` of the stage and of the plain loop, and ``ratio_vs_torch`` (ours over
  plain; 1.0: the stage reads as fast as PyTorch does).

The first ``--warmup`` minibatches (the loader's worker processes starting) are not counted;
each figure is the median of ``--repeats`` runs, the stage's and the plain loop's alternated.
Loader workers need cores of their own: on a host whose cores are busy the wait stays.

``--memory``: instead, the resident memory of every process of a local cluster (the head, two
workers, their loader worker processes) while a job trains on a data set of ``--gib`` GiB of
3 x 64 x 64 images made on the fly from their index (nothing on disk), against one a thousand
times smaller: ``max_rss_mib`` per kind of process (target: every process under 1024 MiB) and
``head_growth_mib``, the head's extra memory for the large set (target: about 0, the head
never loads the training set).

    python scripts/bench_data.py [--json] [--minibatches N] [--minibatch B] [--repeats N]
    python scripts/bench_data.py --memory [--json] [--gib G]
"""

from __future__ import annotations

import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _bench import emit_json, machine, median, parser, print_table
from torch import nn
from torch.utils.data import DataLoader, Dataset

from hetpipe.data import Batcher, DataSource, MinibatchStream

SIZE = 32  # the side of an image as the model takes it
STORED = 64  # the side of an image as stored (decoded, then resized to SIZE)
PAD = 4  # crop padding


class CompressedImages(Dataset):
    """``n`` 3 x 64 x 64 images kept zlib-compressed; a sample is decoded, resized to 32 x 32
    and augmented."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.blobs = []
        for _ in range(n):
            base = rng.integers(0, 256, size=(3, 8, 8), dtype=np.uint8)
            img = np.kron(base, np.ones((1, STORED // 8, STORED // 8), dtype=np.uint8))
            img = img + rng.integers(0, 8, size=img.shape, dtype=np.uint8)  # texture
            self.blobs.append(zlib.compress(img.tobytes(), 6))
        self.labels = rng.integers(0, 10, size=n)

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        raw = np.frombuffer(zlib.decompress(self.blobs[i]), dtype=np.uint8)
        x = torch.from_numpy(raw.reshape(3, STORED, STORED).astype(np.float32)) / 255.0
        x = nn.functional.interpolate(
            x[None], size=(SIZE, SIZE), mode="bilinear", antialias=True, align_corners=False
        )[0]
        x = nn.functional.pad(x, (PAD, PAD, PAD, PAD), mode="reflect")
        top, left = (int(v) for v in torch.randint(0, 2 * PAD + 1, (2,)))
        x = x[:, top : top + SIZE, left : left + SIZE]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        x = (x - 0.5) / 0.25
        return x.contiguous(), int(self.labels[i])


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )


def train_step(net: nn.Module, opt: torch.optim.Optimizer, x: Any, y: Any) -> None:
    opt.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    opt.step()


def run_stage(data: Dataset, workers: int, args: Any) -> dict[str, float]:
    """The first stage's read path and a compute per minibatch."""
    source = DataSource("bench", data, None, Batcher("bench"))
    stream = MinibatchStream(source, args.minibatch, seed=0, workers=workers, prefetch=2)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with stream.reader(0) as reader:
        for p in range(args.warmup):
            train_step(net, opt, *reader.get(p))
        waited0, t0 = reader.waited_s, time.perf_counter()
        for p in range(args.warmup, args.warmup + args.minibatches):
            train_step(net, opt, *reader.get(p))
        total = time.perf_counter() - t0
        waited = reader.waited_s - waited0
    stream.close()
    return {
        "input_wait_share": waited / total,
        "samples_per_s": args.minibatches * args.minibatch / total,
    }


def run_plain(data: Dataset, workers: int, args: Any) -> dict[str, float]:
    """Plain PyTorch: a shuffling DataLoader of the same settings, the same compute."""
    loader = DataLoader(
        data,
        batch_size=args.minibatch,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        prefetch_factor=2 if workers else None,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(0),
    )
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    need = args.warmup + args.minibatches
    waited = 0.0
    done = 0
    t0 = 0.0
    while done < need:
        it = iter(loader)
        while done < need:
            w0 = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            if done >= args.warmup:
                waited += time.perf_counter() - w0
            if done == args.warmup:
                t0, waited = w0, time.perf_counter() - w0
            train_step(net, opt, x, y)
            done += 1
    total = time.perf_counter() - t0
    return {
        "input_wait_share": waited / total,
        "samples_per_s": args.minibatches * args.minibatch / total,
    }


# -- memory: a data set far larger than any process's memory --------------------------------

GENERATED = '''"""Images made on the fly from their index (written by scripts/bench_data.py)."""
import torch
from torch.utils.data import Dataset


class Generated(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        g = torch.Generator().manual_seed(i)
        return torch.randn((3, 64, 64), generator=g), i % 10


def generated(gib):
    sample = 4 * 3 * 64 * 64
    return {"train": Generated(int(gib * (1 << 30)) // sample), "val": Generated(32)}
'''


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (0 where it has ended)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children(pids: set[int]) -> set[int]:
    """The processes whose parent is one of ``pids`` (the loader workers of a worker)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid in pids:
            out.add(int(stat.parent.name))
    return out


async def train_and_watch(
    cluster: Any, spec: dict[str, Any], pids: dict[str, int], peak: dict[str, float]
) -> dict[str, Any]:
    """Run ``spec`` on ``cluster`` to its end, keeping each process's peak RSS in ``peak``
    (the daemons ``pids`` by name, their children as ``loader<pid>``); its final status."""
    import asyncio

    async with cluster.client() as client:
        job_id = await client.submit(spec)
        while True:
            loaders = children({pid for name, pid in pids.items() if name != "ps0"})
            seen = {name: rss_mib(pid) for name, pid in pids.items()}
            seen.update({f"loader{pid}": rss_mib(pid) for pid in loaders})
            for name, mib in seen.items():
                peak[name] = max(peak.get(name, 0.0), mib)
            info = await client.job(job_id)
            if info["state"] in ("done", "failed", "cancelled"):
                return info
            await asyncio.sleep(0.2)


def run_memory(args: Any) -> dict[str, Any]:
    """Peak RSS per kind of process while a job trains on ``args.gib`` GiB and on a thousandth
    of it, each on a fresh cluster (so neither inherits the other's memory)."""
    import asyncio
    import os
    import tempfile

    from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-data-memory-") as tmp:
        root = Path(tmp)
        (root / "benchgen.py").write_text(GENERATED)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(root), os.environ.get("PYTHONPATH")) if p
        )
        for gib in (args.gib, args.gib / 1000):
            run = root / f"run-{gib}"
            run.mkdir()
            (run / "cluster.toml").write_text(
                cluster_toml(
                    [DeviceDef("gpu0", memory="1GiB"), DeviceDef("gpu1", memory="1GiB")],
                    shards=1,
                    allowed_modules=("benchgen",),
                )
            )
            spec = {
                "name": f"generated-{gib:g}",
                "model": {
                    "name": "mlp",
                    "args": {"in_features": 3 * 64 * 64, "hidden": [16], "in_shape": [3, 64, 64]},
                },
                "data": {"name": "benchgen:generated", "args": {"gib": gib}, "workers": 2},
                "optimizer": {"name": "sgd", "lr": 0.01},
                "train": {"minibatch": 16, "minibatches": args.memory_minibatches, "nm": 1},
                "vw": [{"devices": ["gpu0", "gpu1"], "layers": [2, 2]}],
            }
            with LocalCluster(run / "cluster.toml", run / "run", timeout=120) as cluster:
                pids = {name: proc.pid for name, proc in cluster.procs.items()}
                peak: dict[str, float] = {}
                info = asyncio.run(train_and_watch(cluster, spec, pids, peak))
            if info["state"] != "done":
                raise SystemExit(
                    f"memory bench: job {info['id']} {info['state']}: {info.get('error')}"
                )
            kinds = {
                "head": [v for n, v in peak.items() if n == "ps0"],
                "workers": [v for n, v in peak.items() if not n.startswith(("ps", "loader"))],
                "loader_workers": [v for n, v in peak.items() if n.startswith("loader")],
            }
            out[f"{gib:g}GiB"] = {
                "train_samples": int(gib * (1 << 30)) // (4 * 3 * 64 * 64),
                "max_rss_mib": {k: max(v, default=0.0) for k, v in kinds.items()},
                "loader_workers_seen": len(kinds["loader_workers"]),
            }
    big, small = out[f"{args.gib:g}GiB"], out[f"{args.gib / 1000:g}GiB"]
    out["max_rss_mib"] = max(max(d["max_rss_mib"].values()) for d in (big, small))
    out["head_growth_mib"] = big["max_rss_mib"]["head"] - small["max_rss_mib"]["head"]
    return out


def main_memory(args: Any) -> int:
    figures: dict[str, Any] = {"machine": machine(), **run_memory(args)}
    rows = []
    for size in (f"{args.gib:g}GiB", f"{args.gib / 1000:g}GiB"):
        d = figures[size]
        m = d["max_rss_mib"]
        rows.append(
            [
                size,
                d["train_samples"],
                f"{m['head']:.0f}",
                f"{m['workers']:.0f}",
                f"{m['loader_workers']:.0f} ({d['loader_workers_seen']})",
            ]
        )
    print_table(["data set", "samples", "head MiB", "worker MiB", "loader worker MiB (seen)"], rows)
    print(
        f"largest process: {figures['max_rss_mib']:.0f} MiB (target < 1024); head grew "
        f"{figures['head_growth_mib']:+.0f} MiB for {args.gib:g} GiB of data (target: about 0)"
    )
    if args.json:
        emit_json(figures)
    return 0


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--minibatches", type=int, default=60, help="minibatches timed per run")
    ap.add_argument("--minibatch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3, help="alternated runs; medians reported")
    ap.add_argument("--memory", action="store_true", help="measure processes' RSS instead")
    ap.add_argument("--gib", type=float, default=10.0, help="--memory: the large data set")
    ap.add_argument("--memory-minibatches", type=int, default=40, help="--memory: per job")
    args = ap.parse_args()
    if args.memory:
        return main_memory(args)
    torch.set_num_threads(1)
    data = CompressedImages(args.samples)
    figures: dict[str, Any] = {"machine": machine(), "minibatch": args.minibatch}
    rows = []
    for workers in (0, 2):
        runs: dict[str, list[dict[str, float]]] = {"stage": [], "plain": []}
        for _ in range(args.repeats):  # alternated turns: a busy host's drift hits both
            runs["stage"].append(run_stage(data, workers, args))
            runs["plain"].append(run_plain(data, workers, args))
        ours, plain = (
            {k: median([r[k] for r in runs[side]]) for k in runs[side][0]}
            for side in ("stage", "plain")
        )
        ratio = ours["samples_per_s"] / plain["samples_per_s"]
        figures[f"workers{workers}"] = {"stage": ours, "plain": plain, "ratio_vs_torch": ratio}
        rows.append(
            [
                workers,
                f"{ours['input_wait_share']:.3f}",
                f"{plain['input_wait_share']:.3f}",
                f"{ours['samples_per_s']:.0f}",
                f"{plain['samples_per_s']:.0f}",
                f"{ratio:.2f}",
            ]
        )
    figures["input_wait_share"] = figures["workers2"]["stage"]["input_wait_share"]
    figures["ratio_vs_torch"] = figures["workers2"]["ratio_vs_torch"]
    print_table(
        [
            "data.workers",
            "input wait (stage)",
            "input wait (plain)",
            "samples/s (stage)",
            "samples/s (plain)",
            "ratio",
        ],
        rows,
    )
    print(f"input_wait_share with 2 workers: {figures['input_wait_share']:.3f} (target <= 0.05)")
    if args.json:
        emit_json(figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
