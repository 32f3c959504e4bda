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

    python scripts/bench_data.py [--json] [--minibatches N] [--minibatch B] [--repeats N]
"""

from __future__ import annotations

import time
import zlib
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


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--minibatches", type=int, default=60, help="minibatches timed per run")
    ap.add_argument("--minibatch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3, help="alternated runs; medians reported")
    args = ap.parse_args()
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
