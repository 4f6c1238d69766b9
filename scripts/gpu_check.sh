#!/usr/bin/env bash
# One batch of GPU checks for the lent H200 machine (or any CUDA box): the CUDA tests of every
# layer, then the transfer and pin benchmarks. Results land in ${OUT:-gpu_out}/.
# Expects pyzmq either installed or as a wheel in .whl/ (the GPU machine has no package index).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c 'import zmq' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
  --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c 'import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)' >> "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tail -40 > "$OUT/gpu_tests.log"
timeout ${BENCH_TIMEOUT:-200} python3 -m hicache.cli bench transfer --json ${TRANSFER_ARGS:-} > "$OUT/transfer.json" 2> "$OUT/transfer.log"
timeout 120 python3 -m hicache.cli bench pin --size 16GiB --json > "$OUT/pin.json" 2> "$OUT/pin.log"
timeout ${HISPARSE_TIMEOUT:-300} python3 -m hicache.cli bench hisparse --json > "$OUT/hisparse.json" 2> "$OUT/hisparse.log"
tail -3 "$OUT/gpu_tests.log"; echo "transfer rc=$(wc -c < "$OUT/transfer.json") bytes"; cat "$OUT/pin.json"
