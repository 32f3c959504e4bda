"""Capture cost and overhead: a transformer written as an nn.Module, captured into blocks.

Two figures, both in plain PyTorch in this one process:

- ``capture_s``: the time to capture a ``--layers``-layer decoder (an ``nn.Module`` subclass
  with a ``ModuleList`` of layers, as people write it) on the meta device into an
  ``nn.Sequential`` of blocks, and to cut it into ``--stages`` contiguous stages, as the head
  and each worker do (:func:`hetpipe.models.build_model`); median of ``--repeats``.
- ``captured_vs_handwritten``: the per-minibatch forward+backward time of the same model
  written by hand as a flat ``nn.Sequential`` (:func:`hetpipe.models.gpt`) divided by that
  of the captured blocks, applied block by block with the same weights and the same batch;
  the two run back to back in pairs (their order alternating), on ``--threads`` torch
  threads, and the figure is the median over ``--repeats`` pairs of each pair's ratio, so
  that load from other processes on a shared host falls on both sides of a ratio alike.
  1.0: the capture costs nothing; below 1: the captured blocks are slower.
- ``hf_export_s`` and ``hf_cached_s``, where transformers imports: the time to capture a
  Hugging Face Llama of ``--hf-layers`` layers (hidden 32) on the meta device through the
  ``torch.export`` route, the first time (the export) and again (a new build of the same
  configuration, which reuses the cut); ``None`` without transformers.

    python scripts/bench_capture.py [--json] [--layers 48] [--repeats 21] [--threads 1]
        [--hf-layers 4]

With ``--json`` the last line is one JSON object of the figures.
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _bench import emit_json, machine, median, parser, print_table
from torch import Tensor, nn

from hetpipe.capture import capture, capture_of
from hetpipe.models import TransformerBlock, gpt


class Decoder(nn.Module):
    """The builtin ``gpt`` as a user writes it: embeddings, a ModuleList of layers, head."""

    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def stages(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous, nearly equal ranges of ``n`` blocks."""
    cuts = [round(i * n / k) for i in range(k + 1)]
    return list(itertools.pairwise(cuts))


def capture_time(cfg: dict[str, int], k: int) -> tuple[float, int]:
    """Seconds to build on meta, capture and cut into ``k`` stages; and the block count."""
    t0 = time.perf_counter()
    with torch.device("meta"):
        seq = capture(Decoder(**cfg))
    parts = [seq[a:b] for a, b in stages(len(seq), k)]
    assert sum(len(p) for p in parts) == len(seq)
    return time.perf_counter() - t0, len(seq)


def hf_capture_times(layers: int) -> tuple[float, float] | None:
    """Seconds to capture a tiny Hugging Face Llama on meta through ``torch.export``: the
    first time, and for a second build of the same configuration; ``None`` without
    transformers."""
    # tests/libmodels.py imports transformers where a CPU torch cannot load torchvision's
    # operators (see there), and holds the tiny Llama the tests train
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import libmodels

    if libmodels.missing("transformers") is not None:
        return None
    config = libmodels.tiny_llama_config(vocab=256, layers=layers, seq=64)
    auto = libmodels._transformers().AutoModelForCausalLM
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        with torch.device("meta"):
            seq = capture(auto.from_config(config))
        times.append(time.perf_counter() - t0)
        assert len(seq) == layers + 3
    return times[0], times[1]


def step(model: nn.Module, x: Tensor, y: Tensor) -> None:
    """One forward and backward of ``model`` on ``x`` against next-token labels ``y``."""
    out = x
    for block in model:
        out = block(out)
    loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    loss.backward()
    for p in model.parameters():
        p.grad = None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = parser(__doc__)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--minibatch", type=int, default=8)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hf-layers", type=int, default=4)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = {"vocab": 256, "seq": args.seq, "dim": args.dim, "heads": 4, "layers": args.layers}

    times, n_blocks = [], 0
    for _ in range(args.repeats):
        t, n_blocks = capture_time(cfg, args.stages)
        times.append(t)
    capture_s = median(times)

    torch.manual_seed(0)
    hand = gpt(cfg["vocab"], cfg["seq"], cfg["dim"], cfg["heads"], cfg["layers"])
    user = Decoder(**cfg)
    user.tok, user.pos = hand[0].tok, hand[0].pos  # the same weights in both
    user.layers = nn.ModuleList(list(hand[1:-2]))
    user.norm, user.head = hand[-2], hand[-1]
    captured = capture(user)
    assert capture_of(captured) is not None
    g = torch.Generator().manual_seed(1)
    x = torch.randint(cfg["vocab"], (args.minibatch, cfg["seq"]), generator=g)
    y = torch.randint(cfg["vocab"], (args.minibatch, cfg["seq"]), generator=g)
    with torch.no_grad():
        assert torch.allclose(captured(x), hand(x), atol=1e-5)

    runs: dict[str, list[float]] = {"handwritten": [], "captured": []}
    models = {"handwritten": hand, "captured": captured}
    for name in runs:  # warm-up
        step(models[name], x, y)
    for i in range(args.repeats):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            t0 = time.perf_counter()
            step(models[name], x, y)
            runs[name].append(time.perf_counter() - t0)
    hand_s, cap_s = median(runs["handwritten"]), median(runs["captured"])
    hf = hf_capture_times(args.hf_layers)
    ratio = median([h / c for h, c in zip(runs["handwritten"], runs["captured"], strict=True)])
    figures = {
        "layers": args.layers,
        "blocks": n_blocks,
        "capture_s": capture_s,
        "capture_target_s": 10.0,
        "handwritten_step_s": hand_s,
        "captured_step_s": cap_s,
        "captured_vs_handwritten": ratio,
        "captured_vs_handwritten_target": 0.97,
        "hf_layers": args.hf_layers,
        "hf_export_s": hf[0] if hf else None,
        "hf_cached_s": hf[1] if hf else None,
        "repeats": args.repeats,
        "threads": args.threads,
        "machine": machine(),
    }
    print_table(
        ["figure", "value", "target"],
        [
            [f"capture + cut into {args.stages} stages (s)", capture_s, "< 10"],
            ["handwritten step (s)", hand_s, ""],
            ["captured step (s)", cap_s, ""],
            ["captured_vs_handwritten", ratio, ">= 0.97"],
            [f"HF Llama ({args.hf_layers} layers) export + cut (s)", hf[0] if hf else "-", ""],
            ["HF Llama again, same config (s)", hf[1] if hf else "-", ""],
        ],
    )
    if args.json:
        emit_json(figures)
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
