"""A torch.profiler window in every hetpipe worker process, for profiling GPU runs.

Not part of the package: ``scripts/gpu/session.sh`` puts this folder first on
``PYTHONPATH`` with ``HETPIPE_GPU_PROFILE=DIR`` set, and Python imports it at start-up in
each process. In a worker (the process that imported ``hetpipe.worker`` or
``hetpipe.pipeline``), once CUDA is initialised (its first job or profile), it waits
``HETPIPE_GPU_PROFILE_WAIT`` seconds (default 12: past the device profile and the warm-up),
records ``HETPIPE_GPU_PROFILE_S`` seconds (default 2) of CPU and CUDA activity, and writes
``DIR/trace-<pid>.json`` (a Chrome trace; ``trace_summary.py`` reads them) and
``DIR/ops-<pid>.txt`` (the top operators). Kernels are recorded whichever thread launched
them, so the stage's compute thread is covered.
"""

from __future__ import annotations

import os
import sys
import threading
import time

_DIR = os.environ.get("HETPIPE_GPU_PROFILE")


def _cuda_in_a_worker() -> bool:
    if "hetpipe.worker" not in sys.modules and "hetpipe.pipeline" not in sys.modules:
        return False
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def _watch(out: str) -> None:
    while not _cuda_in_a_worker():
        time.sleep(0.25)
    time.sleep(float(os.environ.get("HETPIPE_GPU_PROFILE_WAIT", "12")))
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    time.sleep(float(os.environ.get("HETPIPE_GPU_PROFILE_S", "2")))
    prof.stop()
    prof.export_chrome_trace(os.path.join(out, f"trace-{os.getpid()}.json"))
    table = prof.key_averages()
    with open(os.path.join(out, f"ops-{os.getpid()}.txt"), "w") as f:
        f.write(table.table(sort_by="self_cuda_time_total", row_limit=12))
        f.write(table.table(sort_by="self_cpu_time_total", row_limit=12))


if _DIR:
    threading.Thread(target=_watch, args=(_DIR,), daemon=True, name="gpu-profile").start()
