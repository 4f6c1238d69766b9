#!/usr/bin/env bash
# Fetch the peer kernel `bench transfer` runs beside ours: SGLang's HiCache transfer op, from the
# sglang-kernel wheel (only sgl_kernel/sm90/common_ops.abi3.so, 16 MB for 0.4.6), into .peer/,
# with .peer/common_ops.abi3.so.version naming the wheel (the bench names the peer from it).
# Usage: bash scripts/fetch_peer.sh [VERSION]   (default 0.4.6: torch 2.11, CUDA 13, sm90)
# Needs a package index (run it here, then carry .peer to the GPU machine, which has none).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-0.4.6}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "[fetch_peer] downloading sglang-kernel==$VERSION (the wheel is large; only one file is kept)" >&2
"$PY" -m pip download -q --no-deps -d "$tmp" "sglang-kernel==$VERSION"
wheel=$(ls "$tmp"/*.whl)
mkdir -p .peer
"$PY" - "$wheel" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    name = "sgl_kernel/sm90/common_ops.abi3.so"
    if name not in z.namelist():
        sys.exit(f"[fetch_peer] {sys.argv[1]} has no {name}")
    with z.open(name) as src, open(".peer/common_ops.abi3.so", "wb") as dst:
        dst.write(src.read())
PY
echo "sglang-kernel $VERSION" > .peer/common_ops.abi3.so.version
echo "[fetch_peer] .peer/common_ops.abi3.so ($(du -h .peer/common_ops.abi3.so | cut -f1)), sglang-kernel $VERSION" >&2
