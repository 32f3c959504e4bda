#!/usr/bin/env bash
# Install hetpipe (editable) into the active Python environment; `--test` adds the test tools and
# the libraries the tests train models from (torchvision, transformers).
#
# PyTorch: an installed torch is kept as it is (a GPU user keeps their CUDA build). Without
# one, a machine with an NVIDIA driver gets the default (CUDA) build from PyPI, and a CPU-only
# machine gets the CPU build of torch 2.13.0: from a local wheel directory when pip has one
# (PIP_FIND_LINKS; checked without touching the network), otherwise from the PyTorch CPU
# index. This avoids pulling several GB of CUDA packages onto a machine that cannot use them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
command -v "$PY" >/dev/null 2>&1 || PY=python3
extra=""
[[ "${1:-}" == "--test" ]] && extra="[test]"

if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install torch
else
    wheels=$(mktemp -d)
    if "$PY" -m pip download -q --no-deps --no-index -d "$wheels" "torch==2.13.0" >/dev/null 2>&1; then
        # pip sees a local build (find-links): take it, its dependencies from the usual index
        "$PY" -m pip install "torch==2.13.0"
    else
        "$PY" -m pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
    fi
    rm -rf "$wheels"
fi
if [[ -n "$extra" ]]; then
    # the tests also train torchvision and Hugging Face models and the CIFAR-10 example (the
    # `libs` extra). torchvision must be the release made for the installed torch (torch 2.N.P
    # pairs with torchvision 0.(N+15).P): an unpinned one would pull a newer torch
    tv=$("$PY" -c 'import torch; v = torch.__version__.split("+")[0].split("."); print(f"0.{int(v[1]) + 15}.{v[2]}")')
    if "$PY" -m pip install "torchvision==${tv}"; then
        extra="[test,libs]"
    else
        echo "setup: torchvision ${tv} is not installable here: the tests that need it skip, saying why" >&2
    fi
fi
"$PY" -m pip install -e ".${extra}"
echo "setup: done ($("$PY" -c 'import torch, hetpipe; print("hetpipe", hetpipe.__version__, "torch", torch.__version__)'))"
