#!/bin/bash
# Fetch pyzmq and structlog as wheels into .whl/ (at the versions installed here) for a GPU
# machine without a package index: scripts/gpu/session.sh installs them there.
set -e
v() { python3 -m pip show "$1" | awk '/^Version/{print $2}'; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "pyzmq==$(v pyzmq)" "structlog==$(v structlog)"
ls .whl
