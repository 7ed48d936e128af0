#!/usr/bin/env bash
# Fetch, on a machine with a package index, the cp312 wheels a bare GPU machine lacks for scripts/gpu-check.sh
# (the H200 of 2026-12-04 had torch, triton, cuda-bindings, aiofiles, uvloop, pyyaml, xxhash and numpy):
# pydantic (+ pydantic-core, annotated-types, typing-inspection), pytest (+ pluggy, iniconfig),
# pytest-asyncio, hypothesis (+ sortedcontainers) and redis. Carry the folder beside the checkout as
# shared/wheels; gpu-check.sh installs from it with `pip install --no-index --find-links shared/wheels`.
#
#   scripts/gpu-wheels.sh [DIR]     (default: shared/wheels)
set -euo pipefail
DIR="${1:-shared/wheels}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
"$PY" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$DIR" \
    "pydantic>=2.5,<3" "pytest>=8.4" "pytest-asyncio>=1.4" "hypothesis>=6.90" "redis>=5"
ls "$DIR"
