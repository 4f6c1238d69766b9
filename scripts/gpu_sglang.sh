#!/usr/bin/env bash
# The SGLang adapter tests with CUDA pools and a CUDA daemon, on a GPU machine that has a full
# SGLang 0.5.23 CUDA environment (sglang, sglang-kernel 0.4.10, torch 2.14.1 as SGLang pins, and
# pyzmq/pytest/prometheus-client). Usage: SGLANG_PYTHON=/path/to/venv/bin/python scripts/gpu_sglang.sh
# The lean CPU environment of scripts/setup_sglang.sh cannot do this: SGLang imports
# sgl_kernel.kvcacheio whenever CUDA is available, and that compiled wheel is not in it.
# Wheels for an offline machine (cp312, manylinux x86_64): sglang==0.5.23, sglang-kernel==0.4.10,
# torch==2.14.1 (the CUDA build SGLang pins; the lent H200's torch 2.11 does not match it), and
# the packages scripts/setup_sglang.sh lists (numpy ... ipython, pyzmq, prometheus-client, pytest)
# with their dependencies; install with pip --no-index --find-links <dir>.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${SGLANG_PYTHON:-python3}
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests:$PWD/tests/sglang${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" -W ignore -c 'import torch, sgl_kernel.kvcacheio, sglang; from hicache.engine.sglang import check_sglang_version as c; c(); assert torch.cuda.is_available()' 2>"$OUT/sglang_preflight.log"; then
  echo "gpu_sglang: $PY has no usable SGLang 0.5.23 CUDA environment: $(tail -1 "$OUT/sglang_preflight.log")"
  exit 2
fi
HICACHE_SGLANG_TEST_DEVICE=${DEVICE:-cuda:0} timeout ${TEST_TIMEOUT:-600} "$PY" -m pytest -q \
  -p no:cacheprovider -W ignore::UserWarning tests/sglang/check_dsv4_l2.py \
  tests/sglang/check_dynamic_backend.py 2>&1 | tail -40 \
  | tee "$OUT/sglang_gpu.log"
