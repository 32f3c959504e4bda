"""What a compute task costs after its thread idled: the cold-start law of this host.

An emulated device (``speed`` < 1) pads each forward and backward to its thread's CPU time
/ speed (:func:`hetpipe.emulate.pad`), so its thread sleeps between tasks; on a host whose
cores cool down when idle (caches refilled, clocks ramped, the vCPU rescheduled) the next
task then takes more CPU than the profile, which times layers back to back, says. The
planner charges a padded stage ``cold_pad_s * (1 - exp(-gap / cold_pad_tau_s))`` of extra
CPU per task after an idle ``gap`` (:class:`hetpipe.planner.runtime.RuntimeCosts`). This
probe measures that law on this host and fits its two figures.

For each piece of the narrowed VGG-19 of ``bench_paper.py`` (minibatch 32) and each idle
gap, one thread (one torch thread, as a worker runs) alternates sleeping the gap and one
forward and backward of the piece, timed by :func:`time.thread_time`; the extra is the
median over ``--passes`` against back to back (gap 0). The fit minimises the squared
error of the law over every piece and gap.

    python scripts/probe_cold.py [--json] [--passes 12] [--gaps 0.003 0.01 0.03 0.1 0.3]
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from _bench import emit_json, machine, parser, print_table

PIECES = ((0, 4), (0, 10), (10, 16), (16, 27), (27, None))
DEFAULT_GAPS = (0.003, 0.01, 0.03, 0.1, 0.3)


def _pass_cpu_s(piece: Any, x: Any, gap: float, passes: int) -> float:
    """Median CPU seconds of one forward and backward after sleeping ``gap``."""
    times = []
    for _ in range(passes + 2):
        if gap:
            time.sleep(gap)
        t0 = time.thread_time()
        piece(x).float().sum().backward()
        times.append(time.thread_time() - t0)
    return statistics.median(times[2:])


def measure(gaps: list[float], passes: int) -> list[dict[str, Any]]:
    import torch

    from hetpipe.papermodels import paper_vgg19

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = list(paper_vgg19().children())
    inputs = [torch.randn(32, 3, 32, 32)]
    with torch.no_grad():
        for layer in layers:
            inputs.append(layer(inputs[-1]))
    rows = []
    for a, b in PIECES:
        piece = torch.nn.Sequential(*layers[a:b])
        x = inputs[a]
        hot = _pass_cpu_s(piece, x, 0.0, passes)
        for gap in gaps:
            cold = _pass_cpu_s(piece, x, gap, passes)
            rows.append(
                {"layers": f"{a}-{b or len(layers)}", "hot_ms": hot * 1e3, "gap_s": gap,
                 "cold_ms": cold * 1e3, "extra_ms": (cold - hot) * 1e3}
            )  # fmt: skip
    return rows


def law(gap: float, cold_s: float, tau_s: float) -> float:
    """The extra CPU seconds of a task after ``gap`` seconds idle."""
    return cold_s * (1.0 - math.exp(-gap / tau_s)) if tau_s > 0 else cold_s


def fit(rows: list[dict[str, Any]]) -> tuple[float, float, float]:
    """``(cold_s, tau_s, rms_ms)``: least squares over a grid of tau (cold_s is linear)."""
    best = (0.0, 0.0, math.inf)
    for k in range(1, 400):
        tau = 0.002 * 1.025**k
        basis = [1.0 - math.exp(-r["gap_s"] / tau) for r in rows]
        num = sum(f * r["extra_ms"] / 1e3 for f, r in zip(basis, rows, strict=True))
        den = sum(f * f for f in basis)
        e = max(0.0, num / den) if den else 0.0
        rms = math.sqrt(
            sum((e * f - r["extra_ms"] / 1e3) ** 2 for f, r in zip(basis, rows, strict=True))
            / len(rows)
        )
        if rms * 1e3 < best[2]:
            best = (e, tau, rms * 1e3)
    return best


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--passes", type=int, default=12, help="timed passes per piece and gap")
    ap.add_argument("--gaps", type=float, nargs="+", default=list(DEFAULT_GAPS))
    args = ap.parse_args()
    if args.passes < 1 or any(not g > 0 for g in args.gaps):
        ap.error("--passes must be >= 1 and every gap > 0")
    t0 = time.perf_counter()
    rows = measure(args.gaps, args.passes)
    cold_s, tau_s, rms_ms = fit(rows)
    print("CPU per forward and backward, back to back and after an idle gap (one thread)")
    print_table(
        ["layers", "hot ms", "gap s", "cold ms", "extra ms", "law ms"],
        [
            [r["layers"], f"{r['hot_ms']:.2f}", f"{r['gap_s']:g}", f"{r['cold_ms']:.2f}",
             f"{r['extra_ms']:.2f}", f"{law(r['gap_s'], cold_s, tau_s) * 1e3:.2f}"]
            for r in rows
        ],
    )  # fmt: skip
    print(
        f"fit: cold_pad_s = {cold_s * 1e3:.2f} ms, cold_pad_tau_s = {tau_s * 1e3:.1f} ms"
        f" (rms {rms_ms:.2f} ms)"
    )
    if args.json:
        emit_json(
            {
                "bench": "probe_cold",
                "machine": machine(),
                "rows": rows,
                "cold_pad_s": cold_s,
                "cold_pad_tau_s": tau_s,
                "rms_ms": rms_ms,
                "seconds": time.perf_counter() - t0,
            },
        )


if __name__ == "__main__":
    main()
