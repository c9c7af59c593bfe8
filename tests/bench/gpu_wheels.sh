#!/usr/bin/env bash
# Wheels for a GPU machine that has no network (tests/bench/gpu_check.py's section c compares the fused
# loss with Liger's): downloads liger-kernel into .whl/ (git-ignored) on a machine that reaches the
# package index. Carry .whl/ to the GPU machine and install it there without the index:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# liger-kernel needs torch and triton, which a CUDA build of torch brings (so --no-deps). Its one file is
# pure python (py3-none-any): no platform or python-version flags are needed.
set -euo pipefail
cd "$(dirname "$0")/../.."
LIGER_VERSION=${LIGER_VERSION:-0.8.5}
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "liger-kernel==$LIGER_VERSION"
ls -l .whl
