"""GPU throughput: plain PyTorch against hetpipe on the same GPU(s), in one run.

Both sides train the builtin ``gpt`` (dim 512, 8 blocks, seq 128: 25.5 M parameters) on
synthetic tokens, minibatch 32, SGD with momentum, from the same seed and data order, and are
timed in steady state: samples per second after the first fifth of the minibatches (ours at
stage 0, when the backward of the window's last minibatch finishes there, as
``bench_pipeline.py`` counts; plain PyTorch after a ``torch.cuda.synchronize``).

- ``one stage``: one virtual worker of one stage on ``cuda:0``, Nm = 1, against plain
  PyTorch on ``cuda:0`` (``ratio_one_stage``);
- ``four stages, one GPU``: one virtual worker of four stages, all on ``cuda:0``, Nm = 4
  (``ratio_four_stages_one_gpu``), each stage its own worker process (four devices of one GPU);
- ``four stages, one worker``: the same four stages served by one worker process
  (``train.several_stages``: one device named four times), each stage on its own CUDA stream
  and activations handed over in the process (``ratio_four_stages_one_worker``);
- with two or more GPUs, one stage per GPU (Nm = the number of stages) against plain PyTorch
  on one GPU times the pipeline's ideal speed-up, the number of GPUs (``ratio_gpus``);
- each again in bfloat16 (``train.precision = "bf16"`` against plain PyTorch under
  ``torch.autocast``): the same fields with ``_bf16``;
- ``memory``: the four-stage run again under each activation policy (``keep``,
  ``recompute``, ``swap``), and per stage three peaks side by side: the plan's predicted
  peak (``expected_memory``), hetpipe's own count of the stage's tensors (``peak_bytes``,
  what the cap is enforced on) and what the CUDA caching allocator held for that stage's
  process (``torch.cuda.max_memory_allocated``, and ``max_memory_reserved``). The JSON
  gives ``memory_error_<policy>``, the worst stage's |predicted - allocated| / allocated
  (target <= 0.10), and ``swap_vs_keep``, the swap run's samples/s over the keep run's
  (target >= 0.8).

    python scripts/bench_gpu.py [--json] [--minibatches N] [--dim D] [--blocks B] [--no-bf16]
                                [--no-cuda-ipc] [--cases one_stage,four_stages_one_gpu,memory]

Stages on GPUs of this host pass activations and gradients by CUDA IPC handle (no copy on
one GPU); ``--no-cuda-ipc`` sends them through host memory instead, for comparison.

Without CUDA it prints one line saying so (with ``--json``: ``{"skipped": "no CUDA"}``) and
exits 0.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _bench import emit_json, machine, parser, print_table

SEQ, VOCAB, HEADS, LR, MOMENTUM, SEED = 128, 256, 8, 0.01, 0.9, 0


def job_dict(
    name: str,
    devices: list[str],
    layers: list[int],
    nm: int,
    args: Any,
    precision: str,
    activations: str = "keep",
) -> dict[str, Any]:
    """The job hetpipe runs (plain PyTorch reads the same model, data and optimizer); a
    device named more than once in ``devices`` runs each of those stages."""
    return {
        "name": name,
        "model": {
            "name": "gpt",
            "args": {
                "vocab": VOCAB,
                "seq": SEQ,
                "dim": args.dim,
                "heads": HEADS,
                "blocks": args.blocks,
            },
        },
        "data": {
            "name": "synthetic",
            "args": {"kind": "tokens", "seq": SEQ, "vocab": VOCAB, "n_train": 4096, "n_test": 256},
        },
        "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM, "weight_decay": 0.0},
        "train": {
            "minibatch": args.minibatch,
            "nm": nm,
            "staleness": 0,
            "seed": SEED,
            "minibatches": args.minibatches,
            "checkpoint_every": 0,
            "precision": precision,
            "activations": activations,
            "several_stages": len(set(devices)) < len(devices),
        },
        "vw": [{"devices": devices, "layers": layers}],
    }


def split(n_layers: int, k: int) -> list[int]:
    """``n_layers`` cut into ``k`` contiguous stages of nearly equal size."""
    base, extra = divmod(n_layers, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def plain(job: dict[str, Any], device: str) -> float:
    """Plain PyTorch on one device: steady-state samples/s."""
    from hetpipe.data import MinibatchStream, load_dataset
    from hetpipe.job import JobSpec
    from hetpipe.models import build_model, model_loss

    spec = JobSpec.from_dict(job)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model).to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = model_loss(spec.model)
    stream = MinibatchStream(
        load_dataset(spec.data.name, spec.data.args), spec.minibatch, spec.seed, 0, 1
    )
    n = job["train"]["minibatches"]
    warm = n // 5
    bf16 = spec.precision == "bf16"
    t0 = 0.0
    for p in range(n):
        if p == warm:
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        x, y = stream.batch(p)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    return (n - warm) * spec.minibatch / (time.perf_counter() - t0)


def ours(job: dict[str, Any], devices: dict[str, str], memory: str, cuda_ipc: bool) -> float:
    """hetpipe on a local cluster of these devices (name -> cuda:N): steady-state samples/s
    at stage 0."""
    return run_ours(job, devices, memory, cuda_ipc)[0]


def run_ours(
    job: dict[str, Any], devices: dict[str, str], memory: str, cuda_ipc: bool
) -> tuple[float, dict[str, Any]]:
    """:func:`ours`, and the finished job's status (its stages' figures and predictions)."""
    from hetpipe.localcluster import DeviceDef, LocalCluster, cluster_toml

    n = job["train"]["minibatches"]
    warm = n // 5
    with tempfile.TemporaryDirectory(prefix="hetpipe-bench-gpu-") as tmp:
        root = Path(tmp)
        path = root / "cluster.toml"
        defs = [DeviceDef(name, "gpu", memory, 1.0, dev) for name, dev in devices.items()]
        path.write_text(cluster_toml(defs, shards=1, cuda_ipc=cuda_ipc))
        with LocalCluster(path, root / "run", timeout=120) as cluster:
            info = cluster.submit(job, timeout=1800)
            if info.get("state") != "done":
                raise RuntimeError(f"{job['name']} ended {info.get('state')}: {info.get('error')}")
            stages = json.loads(Path(info["stages_path"]).read_text())
    r = stages["vw0/stage0"]
    rows = [dict(zip(r["stats"]["record_fields"], row, strict=True)) for row in r["records"]]
    window = rows[n - 1]["t_bwd"] - rows[warm - 1]["t_bwd"]
    return (n - warm) * job["train"]["minibatch"] / window, info


def memory_rows(info: dict[str, Any]) -> list[dict[str, Any]]:
    """Per stage: the plan's predicted peak, hetpipe's count and the allocator's peaks."""
    predicted = info.get("predicted") or {}
    pred = predicted["vws"][0]["stages"] if predicted.get("vws") else None
    rows = []
    for s in info["stages"]:
        ps = pred[s["stage"]] if pred else {}
        alloc = s.get("allocator_peak") or {}
        expected = ps.get("expected_memory") or ps.get("memory")
        allocated = alloc.get("allocated")
        rows.append(
            {
                "stage": s["stage"],
                "layers": s["layers"],
                "predicted_bytes": expected,
                "predicted_terms": ps.get("expected_memory_terms") or ps.get("memory_terms"),
                "counted_bytes": s["peak_bytes"],
                "counted_terms": s["peak_memory"],
                "allocated_bytes": allocated,
                "reserved_bytes": alloc.get("reserved"),
                "in_flight": s.get("peak_in_flight"),
                "error": abs(expected - allocated) / allocated if expected and allocated else None,
                "counted_error": abs(s["peak_bytes"] - allocated) / allocated
                if allocated
                else None,
            }
        )
    return rows


def memory_study(args: Any, memory: str, out: dict[str, Any]) -> list[list[Any]]:
    """The four-stage run under each activation policy: peaks per stage and throughput."""
    devices = {f"gpu{i}": "cuda:0" for i in range(4)}
    layers = split(args.blocks + 3, 4)
    table: list[list[Any]] = []
    rates: dict[str, float] = {}
    for policy in ("keep", "recompute", "swap"):
        job = job_dict(f"bench-gpu-memory-{policy}", list(devices), layers, 4, args, "fp32", policy)
        rate, info = run_ours(job, devices, memory, not args.no_cuda_ipc)
        rows = memory_rows(info)
        rates[policy] = rate
        out[f"memory_{policy}"] = {"samples_per_s": rate, "stages": rows}
        errors = [r["error"] for r in rows if r["error"] is not None]
        out[f"memory_error_{policy}"] = max(errors) if errors else None
        for r in rows:
            table.append(
                [
                    policy,
                    r["stage"],
                    mib(r["predicted_bytes"]),
                    mib(r["counted_bytes"]),
                    mib(r["allocated_bytes"]),
                    mib(r["reserved_bytes"]),
                    r["error"],
                ]
            )
    out["swap_vs_keep"] = rates["swap"] / rates["keep"]
    out["recompute_vs_keep"] = rates["recompute"] / rates["keep"]
    return table


def mib(n: int | None) -> float | None:
    """Bytes as MiB for the table."""
    return None if n is None else n / 2**20


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--minibatches", type=int, default=200, help="minibatches per run")
    ap.add_argument("--minibatch", type=int, default=32)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 runs")
    ap.add_argument(
        "--no-cuda-ipc",
        action="store_true",
        help="stages pass tensors through host memory ([runtime] cuda_ipc = false)",
    )
    ap.add_argument(
        "--cases",
        default="",
        help="comma-separated subset of the runs "
        "(one_stage, four_stages_one_gpu, four_stages_one_worker, gpus, memory); default all",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        if args.json:
            emit_json({"skipped": "no CUDA"})
        else:
            print("bench_gpu: skipped, no CUDA device on this machine")
        return
    if args.minibatches < 10:
        ap.error("--minibatches must be >= 10")
    gpus = torch.cuda.device_count()
    total = torch.cuda.get_device_properties(0).total_memory
    memory = f"{total // 2**20}MiB"
    n_layers = args.blocks + 3  # embedding, blocks, final norm, head
    # (name, the cluster's devices: name -> cuda:N, the VW's stages' devices, ideal speed-up)
    cases: list[tuple[str, dict[str, str], list[str], float]] = [
        ("one_stage", {"gpu0": "cuda:0"}, ["gpu0"], 1.0),
        (
            "four_stages_one_gpu",
            {f"gpu{i}": "cuda:0" for i in range(4)},
            [f"gpu{i}" for i in range(4)],
            1.0,
        ),
        ("four_stages_one_worker", {"gpu0": "cuda:0"}, ["gpu0"] * 4, 1.0),
    ]
    if gpus >= 2:
        many = {f"gpu{i}": f"cuda:{i}" for i in range(gpus)}
        cases.append(("gpus", many, list(many), float(gpus)))
    wanted = {"one_stage", "four_stages_one_gpu", "four_stages_one_worker", "gpus", "memory"}
    if args.cases:
        unknown = set(args.cases.split(",")) - wanted
        if unknown:
            ap.error(f"--cases: unknown run(s) {', '.join(sorted(unknown))}")
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c[0] in wanted]
    out: dict[str, Any] = {
        "bench": "gpu",
        "machine": machine(),
        "gpu": torch.cuda.get_device_name(0),
        "gpus": gpus,
        "dim": args.dim,
        "blocks": args.blocks,
        "seq": SEQ,
        "minibatch": args.minibatch,
        "minibatches": args.minibatches,
        "cuda_ipc": not args.no_cuda_ipc,
    }
    rows = []
    for precision in ("fp32",) if args.no_bf16 else ("fp32", "bf16"):
        suffix = "" if precision == "fp32" else "_bf16"
        base = None
        for name, devices, stages, ideal in cases:
            k = len(stages)
            job = job_dict(
                f"bench-gpu-{name}{suffix}", stages, split(n_layers, k), k, args, precision
            )
            if base is None:
                base = plain(job, "cuda:0")
            got = ours(job, devices, memory, not args.no_cuda_ipc)
            ratio = got / (base * ideal)
            out[f"plain_samples_per_s{suffix}"] = base
            out[f"{name}_samples_per_s{suffix}"] = got
            out[f"ratio_{name}{suffix}"] = ratio
            rows.append([f"{name}{suffix}", k, base * ideal, got, ratio])
    print(
        f"gpt dim {args.dim}, {args.blocks} blocks, seq {SEQ}, minibatch {args.minibatch}, "
        f"{args.minibatches} minibatches (first fifth left out), on {out['gpu']} x {gpus}"
    )
    print_table(["run", "stages", "plain (x ideal) samples/s", "hetpipe samples/s", "ratio"], rows)
    if "memory" in wanted:
        table = memory_study(args, memory, out)
        print(
            f"peaks per stage (MiB), four stages on cuda:0, Nm = 4; swap/keep samples/s "
            f"{out['swap_vs_keep']:.3f}, recompute/keep {out['recompute_vs_keep']:.3f}"
        )
        print_table(
            ["policy", "stage", "predicted", "counted", "allocated", "reserved", "error"], table
        )
    if args.json:
        emit_json(out)


if __name__ == "__main__":
    main()
