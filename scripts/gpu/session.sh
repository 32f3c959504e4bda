#!/bin/bash
# Every GPU check of hetpipe in one run, for a machine with one NVIDIA GPU whose Python has
# torch, msgpack, click and pytest (pyzmq and structlog come as wheels in .whl/, fetched on a
# machine with pip: scripts/gpu/wheels.sh). Results go to $OUT (default ./gpu-out).
#
#   bash scripts/gpu/session.sh            # from the repository root
#
# 1. bench_gpu.py --json: one stage, four stages on cuda:0 (four workers, and one worker), bf16,
#    and per stage the predicted, counted and allocator peaks under keep / recompute / swap,
#    with swap's throughput;
# 2. a torch.profiler window in each worker of the four-stage runs, summarised
#    (scripts/gpu/trace_summary.py), with nvidia-smi's utilisation beside it;
# 3. the CUDA tests (tests/test_cuda.py);
# 4. bench_staleness.py at k = 8 on the GPU (stash against predict);
# 5. bench_data.py on this machine's free cores: the loader workers' input wait, which a
#    2-core host cannot measure (each loader worker needs a core of its own);
# 6. bench_wire.py's cross-host case (two network namespaces, 4 MiB tensors): the MAC data
#    path against plain ZeroMQ with the sender and the receiver on cores of their own (it says
#    why not where namespaces cannot be made there).
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/hetpipe-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/hetpipe-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch, zmq, structlog; print(torch.__version__, torch.cuda.get_device_name(0))" || exit 1
echo "== bench_gpu"
timeout 300 python3 scripts/bench_gpu.py --json 2>&1 | tee "$OUT/bench_gpu.log"
for case in four_stages_one_gpu four_stages_one_worker; do
    echo "== profile: $case"
    PROF=$(mktemp -d)
    (nvidia-smi dmon -s u -d 1 -c 40 >"$OUT/dmon-$case.txt" 2>&1 &)
    HETPIPE_GPU_PROFILE=$PROF PYTHONPATH=$PWD/scripts/gpu:$PYTHONPATH timeout 150 \
        python3 scripts/bench_gpu.py --cases $case --no-bf16 --minibatches 3000 2>&1 | tail -4
    python3 scripts/gpu/trace_summary.py "$PROF" 2>&1 | tee "$OUT/profile-$case.txt"
    cat "$PROF"/ops-*.txt >"$OUT/ops-$case.txt" 2>/dev/null
    head -c 3000 "$OUT/ops-$case.txt"
    tail -30 "$OUT/dmon-$case.txt"
done
echo "== CUDA tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    tests/test_stages_per_worker.py::test_four_stages_on_one_gpu_in_one_worker 2>&1 | tail -15
echo "== bench_staleness, k = 8"
timeout 200 python3 scripts/bench_staleness.py --json --device cuda:0 --tasks gpt512 --ks 8 \
    --arms stash predict 2>&1 | tail -12 | tee "$OUT/staleness.log"
echo "== bench_data (CPU: the loader workers on cores of their own)"
timeout 240 python3 scripts/bench_data.py --json --minibatches 80 --repeats 3 2>&1 | tail -8 \
    | tee "$OUT/bench_data.log"
echo "== bench_wire cross-host (CPU: sender and receiver on cores of their own)"
timeout 120 python3 scripts/bench_wire.py --json --sizes 4MiB --repeats 3 2>&1 | tail -12 \
    | tee "$OUT/bench_wire.log"
