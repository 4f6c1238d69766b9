#!/usr/bin/env bash
# One batch of GPU checks for the lent H200 machine (or any CUDA box): the CUDA tests of every
# layer, then the engine-visible bench (bench e2e). Results land in ${OUT:-gpu_out}/.
# Expects pyzmq either installed or as a wheel in .whl/ (the GPU machine has no package index).
# STEPS (default "tests e2e") may add: issue transfer pin hisparse soak. "issue" is a backup's
# issue cost with and without one id upload per backup, alternated in one process
# (scripts/backup_issue_cost.py --path rows,batch). "soak" is the full GPU soak
# (8 clients x 50000 operations, --mix all): 418 s at 956 ops/s on an H200 (2026-12-01), so it runs
# alone, in a call of its own, as STEPS=soak.
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
for step in ${STEPS:-tests e2e}; do
  case $step in
    tests) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m cuda tests \
             ${TEST_ARGS:-} 2>&1 | tail -40 > "$OUT/gpu_tests.log"; tail -3 "$OUT/gpu_tests.log" ;;
    e2e) timeout ${E2E_TIMEOUT:-300} python3 -m hicache.cli bench e2e ${E2E_ARGS:-} \
           > "$OUT/e2e.txt" 2> "$OUT/e2e.log"; cat "$OUT/e2e.txt"; tail -3 "$OUT/e2e.log" ;;
    issue) timeout ${ISSUE_TIMEOUT:-180} python3 scripts/backup_issue_cost.py --path rows,batch \
             --pages 1,8,32 --reps 40 --queued 0 > "$OUT/issue.jsonl" 2> "$OUT/issue.log"
           cat "$OUT/issue.jsonl"; tail -3 "$OUT/issue.log" ;;
    transfer) timeout ${BENCH_TIMEOUT:-200} python3 -m hicache.cli bench transfer --json \
                ${TRANSFER_ARGS:-} > "$OUT/transfer.json" 2> "$OUT/transfer.log" ;;
    pin) timeout 120 python3 -m hicache.cli bench pin --size 16GiB --json > "$OUT/pin.json" \
           2> "$OUT/pin.log"; cat "$OUT/pin.json" ;;
    hisparse) timeout ${HISPARSE_TIMEOUT:-300} python3 -m hicache.cli bench hisparse --json \
                > "$OUT/hisparse.json" 2> "$OUT/hisparse.log"; tail -14 "$OUT/hisparse.log" ;;
    soak) timeout ${SOAK_TIMEOUT:-585} python3 -m hicache.cli bench soak --clients 8 \
            --ops ${SOAK_OPS:-50000} --mix all --device cuda:0 --json > "$OUT/soak.json" \
            2> "$OUT/soak.log"; echo "soak exit $?"; grep -v WARNING "$OUT/soak.log" | tail -8 ;;
  esac
done
