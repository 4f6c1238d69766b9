#!/usr/bin/env bash
# Creates .venv with everything hicache needs; idempotent. Installs libnuma headers when root.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.hicache-setup"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
echo "[setup] creating $VENV (first run takes a minute or two)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() {  # quiet pip; drops the "Location ... is ignored" noise some images' pip.conf causes
  local log rc=0
  log=$(mktemp)
  "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@" >"$log" 2>&1 || rc=$?
  grep -v "WARNING: Location" "$log" || true
  rm -f "$log"
  return "$rc"
}
pip install --upgrade pip setuptools wheel >/dev/null
# torch first, pinned to the CPU build that lies on this machine's disk; elsewhere any >=2.11.
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  pip install "torch==2.13.0" || pip install "torch>=2.11"
fi
# our own editable build: setuptools' notes about editable layouts are not the user's business
PYTHONWARNINGS=ignore pip install -e ".[test]"
# L3 tier (Mooncake Store): its client library links the system libibverbs1.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s libibverbs1 >/dev/null 2>&1; then
  echo "[setup] installing libibverbs1 (root; needed by the Mooncake L3 client)"
  (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null 2>&1 \
    || echo "[setup] WARNING: could not install libibverbs1; the L3 tests will fail to import Mooncake"
fi
if PYTHONWARNINGS=ignore pip install -e ".[l3]"; then
  echo "[setup] Mooncake client installed: --l3 mooncake available"
else
  echo "[setup] WARNING: the 'l3' extra did not install; --l3 mooncake is unavailable and its tests skip"
fi
# Optional NUMA binding: needs libnuma headers, Cython and no build isolation (numa 1.4.6).
if ! "$VENV/bin/python" -c 'import numa' 2>/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s libnuma-dev >/dev/null 2>&1; then
    echo "[setup] installing libnuma-dev (root)"
    (apt-get update -qq && apt-get install -y -qq libnuma-dev) >/dev/null 2>&1 \
      || echo "[setup] note: could not install libnuma-dev; NUMA binding will be off"
  fi
  # optional: a failed build is one line, not the compiler's log
  if pip install Cython >/dev/null && pip install --no-build-isolation "numa==1.4.6" >/dev/null 2>&1; then
    echo "[setup] numa installed: the host pool binds to the GPU's NUMA node"
  else
    echo "[setup] note: the optional numa package is not available here; host pools are not NUMA-bound (the daemon says so at start-up)"
  fi
fi
touch "$stamp"
echo "[setup] ready: $VENV"
