"""What gradient clipping costs a pipeline: time per minibatch with and without optimizer.clip_norm.

Four unslowed CPU devices on this host, one virtual worker of k stages (the mlp, its layers
cut evenly). Arms, each with and without ``clip_norm``:

- ``async`` (Nm minibatches in flight): each stage clips its own gradient of each minibatch
  by its own norm; the cost is one norm per step on the stage, nothing is exchanged.
- ``1f1b`` (M microbatches per iteration): the stages agree on the iteration's global norm
  before any steps (hetpipe.pipeline.StageRunner._agree): a norm per stage and up to
  k - 1 hops of a small message along the pipeline, once per iteration.

A figure is the median gap between the ends of consecutive minibatches (async) or
iterations (1f1b, divided by M) at stage 0, the first fifth left out, median over
``--repeats`` runs of each arm, run in turn. Beside it, for 1f1b with clipping, each stage's
median wait for the agreement per iteration (its ``gate`` spans: a lone synchronous virtual
worker waits at no other gate), the part of the cost a loaded host's noise hides least.
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _bench import emit_json, machine, parser, print_table

from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml
from hetpipe.models import build_model


def _per_minibatch(info: dict[str, Any], m: int) -> float:
    """Median seconds per minibatch at stage 0, from the ends of its steps."""
    data = json.loads(Path(info["stages_path"]).read_text())
    r = data["vw0/stage0"]
    fields = r["stats"]["record_fields"]
    rows = [dict(zip(fields, row, strict=True)) for row in r["records"]]
    ends = [row["t_bwd"] for row in rows if row["p"] % m == m - 1]
    gaps = [b - a for a, b in itertools.pairwise(ends)][len(ends) // 5 :]
    return statistics.median(gaps) / m


def _agree_waits(info: dict[str, Any]) -> list[float]:
    """Per stage, the median seconds an iteration's step waited for the agreement."""
    data = json.loads(Path(info["stages_path"]).read_text())
    out = []
    for where in sorted(data):
        spans = [x for x in data[where]["stats"]["spans"] if x[0] == "gate"]
        out.append(statistics.median(x[2] - x[1] for x in spans) if spans else 0.0)
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--k", type=int, default=2, help="stages (at most 4)")
    ap.add_argument("--m", type=int, default=4, help="Nm (async) and M (1f1b)")
    ap.add_argument("--minibatches", type=int, default=240, help="per job")
    ap.add_argument("--minibatch", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=512, help="the mlp's hidden width")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    names = [f"gpu{i}" for i in range(args.k)]
    model_args = {"hidden": [args.hidden] * 3}
    n_layers = len(build_model("mlp", model_args))
    even = [n_layers // args.k + (i < n_layers % args.k) for i in range(args.k)]

    def job(name: str, kind: str, clip: bool) -> dict[str, Any]:
        train: dict[str, Any] = {
            "minibatch": args.minibatch,
            "nm": args.m,
            "seed": 0,
            "schedule": kind,
            "minibatches": args.minibatches,
        }
        opt: dict[str, Any] = {"name": "sgd", "lr": 0.03, "momentum": 0.9}
        if clip:
            opt["clip_norm"] = 0.5
        return {
            "name": name,
            "model": {"name": "mlp", "args": model_args},
            "data": {"name": "digits"},
            "optimizer": opt,
            "train": train,
            "vw": [{"devices": names, "layers": even}],
        }

    arms = [(kind, clip) for kind in ("async", "1f1b") for clip in (False, True)]
    got: dict[str, list[float]] = {f"{k}_{'clip' if c else 'none'}": [] for k, c in arms}
    waits: list[list[float]] = []
    devices = [DeviceDef(n, "cpu", "1GiB", 1.0, "cpu") for n in names]
    with tempfile.TemporaryDirectory(prefix="hetpipe-bench-clip-") as tmp:
        root = Path(tmp)
        path = root / "cluster.toml"
        path.write_text(cluster_toml(devices, shards=1))
        with LocalCluster(path, root / "run", timeout=120) as cluster:
            warm = cluster.submit(job("warm-up", "async", False), timeout=600)
            if warm.get("state") != "done":
                raise RuntimeError(f"warm-up job: {warm.get('error')}")
            for r in range(args.repeats):
                for kind, clip in arms:
                    arm = f"{kind}_{'clip' if clip else 'none'}"
                    info = cluster.submit(job(f"{arm}-{r}", kind, clip), timeout=600)
                    if info.get("state") != "done":
                        raise RuntimeError(f"{arm}: {info.get('error')}")
                    got[arm].append(_per_minibatch(info, args.m))
                    if kind == "1f1b" and clip:
                        waits.append(_agree_waits(info))
    med = {arm: statistics.median(v) for arm, v in got.items()}
    out: dict[str, Any] = {
        "machine": machine(),
        "k": args.k,
        "m": args.m,
        "minibatch": args.minibatch,
        "hidden": args.hidden,
        "seconds_per_minibatch": med,
        "runs": got,
        "agree_wait_s_per_iteration": [
            statistics.median(w[s] for w in waits) for s in range(args.k)
        ],
        "clip_cost": {
            kind: med[f"{kind}_clip"] / med[f"{kind}_none"] - 1.0 for kind in ("async", "1f1b")
        },
    }
    print_table(
        ["schedule", "no clip ms/minibatch", "clip ms/minibatch", "cost"],
        [
            [
                kind,
                1e3 * med[f"{kind}_none"],
                1e3 * med[f"{kind}_clip"],
                f"{100 * out['clip_cost'][kind]:+.1f}%",
            ]
            for kind in ("async", "1f1b")
        ],
    )
    print(
        "1f1b: each stage's wait for the agreement per iteration (ms): "
        + ", ".join(f"{1e3 * w:.2f}" for w in out["agree_wait_s_per_iteration"])
    )
    if args.json:
        emit_json(out)


if __name__ == "__main__":
    main()
