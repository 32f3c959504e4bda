"""What the CUDA caching allocator really held for a stage, beside hetpipe's own count.

The memory cap is enforced on the stage's own count of its tensors
(:meth:`hetpipe.stage.StageCompute.memory`), the terms the planner predicts. The allocator
holds more than those terms (its block rounding, kernels' workspaces, tensors in transit),
so a stage on a GPU also reports the allocator's peaks for its process, to check the model
against: ``allocated`` (live tensors) and ``reserved`` (what the allocator took from the
device, what another process on the GPU can no longer use).
"""

from __future__ import annotations

import torch

__all__ = ["allocator_peaks", "reset_allocator_peaks"]


def reset_allocator_peaks(device: str | torch.device) -> None:
    """Start counting the peaks afresh (a worker runs one job after another)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def allocator_peaks(device: str | torch.device) -> dict[str, int] | None:
    """The allocator's peak allocated and reserved bytes since the last reset (None off a
    GPU, where there is no allocator to compare with)."""
    if torch.device(device).type != "cuda":
        return None
    return {
        "allocated": torch.cuda.max_memory_allocated(device),
        "reserved": torch.cuda.max_memory_reserved(device),
    }
