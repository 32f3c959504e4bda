"""Reproducible randomness (dropout and the like): one seed per layer, minibatch and VW.

Before each layer of a stage runs the forward of minibatch ``p``, the stage seeds every
generator it draws from (the CPU generator and, on a GPU, that device's generator) with
:func:`layer_seed` ``(job seed, vw, layer, p)``. So the masks a layer draws depend on
nothing but those four numbers:

- a job is reproducible run to run, whatever the timing of its stages;
- the masks do not depend on where the model is cut, so a planned job (whose split comes
  from measured profiles) draws the same masks as any explicit split of the same model;
- virtual workers draw different masks for their different data.

A plain PyTorch reference that draws the same masks runs the layers one by one::

    for i, layer in enumerate(model):
        torch.manual_seed(layer_seed(seed, vw, i, p))
        x = layer(x)

The backward of a minibatch draws nothing: autograd keeps the masks its forward drew. A
recomputed forward draws the same ones again, because the seed is a function of ``p``.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import torch
from torch import nn

__all__ = ["LayerSeeds", "layer_seed"]


def layer_seed(seed: int, vw: int, layer: int, p: int) -> int:
    """The seed of ``layer`` (global index) for minibatch ``p`` of virtual worker ``vw``.

    The first 8 bytes (little endian) of BLAKE2b over the four numbers as little-endian
    int64s: well mixed, so neighbouring layers or minibatches get unrelated streams.
    """
    digest = hashlib.blake2b(struct.pack("<4q", seed, vw, layer, p), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class LayerSeeds:
    """Forward pre-hooks that seed a stage's generators before each of its layers.

    The stage sets :attr:`p` before each forward; the hooks read it. ``first`` is the global
    index of the stage's first layer, so a layer's seed is the same on any stage.
    """

    def __init__(
        self, module: nn.Sequential, *, seed: int, vw: int, first: int, device: str
    ) -> None:
        self.seed = seed
        self.vw = vw
        self.p = 0
        # minibatches this VW ran before this attempt (a resumed job): a seed follows the
        # minibatch's position in the whole job, so a resumed job draws the same masks
        self.start = 0
        self.generators = [torch.default_generator]
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.init()  # the device generators exist only once CUDA is initialised
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            self.generators.append(torch.cuda.default_generators[index])
        for i, layer in enumerate(module):
            layer.register_forward_pre_hook(self._hook(first + i))

    def _hook(self, layer: int) -> Any:
        def reseed(_module: nn.Module, _args: Any) -> None:
            s = layer_seed(self.seed, self.vw, layer, self.start + self.p)
            for g in self.generators:
                g.manual_seed(s)

        return reseed
