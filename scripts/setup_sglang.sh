#!/usr/bin/env bash
# Creates .venv-sglang: SGLang 0.5.23 on the CPU torch, lean (no CUDA libraries), for the SGLang
# adapter tests. Idempotent and cached (a stamp newer than this script means done).
#
# - torch is pinned to 2.13.0 by a constraints file for every pip call: unconstrained, a
#   dependency (torchvision) would pull torch 2.14.1 and 3 GB of CUDA libraries.
# - sglang is installed --no-deps; only the packages its imports of the cache stack need follow
#   (SGLang's own pins where it pins one).
# - torchvision: the registry's build needs the CUDA torch, and SGLang imports it only at module
#   level for vision models; an import-only stand-in is written whose every attribute raises
#   when called (so a vision path that is reached fails loudly).
# hicache itself is not installed here: the tests put the checkout on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_VENV:-.venv-sglang}
PY=${PYTHON:-python3}
stamp="$VENV/.hicache-sglang-setup"
if [ -f "$stamp" ] && [ "$stamp" -nt scripts/setup_sglang.sh ]; then
  exit 0
fi
echo "[setup_sglang] creating $VENV (first run: several minutes, about 2.8 GB)"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
cons=$(mktemp)
trap 'rm -f "$cons"' EXIT
echo "torch==2.13.0" >"$cons"
pip() {
  local log rc=0
  log=$(mktemp)
  "$VENV/bin/python" -m pip -q --disable-pip-version-check "$@" -c "$cons" >"$log" 2>&1 || rc=$?
  grep -v -E "WARNING: Location|^sglang 0\.5\.23 requires|dependency resolver" "$log" || true
  rm -f "$log"
  return "$rc"
}
pip install "torch==2.13.0"
pip install --no-deps "sglang==0.5.23"
pip install numpy==2.4.6 orjson==3.13.0 psutil==7.2.2 pydantic==2.14.4 aiohttp==3.14.5 \
  apache-tvm-ffi==0.1.11 transformers==5.19.0 dill==0.4.1 sentencepiece==0.2.1 \
  compressed-tensors==0.18.0 gguf==0.19.0 openai==2.8.0 partial-json-parser==0.2.1.1.post7 \
  datasets==5.2.0 pillow==13.0.0 pybase64==1.5.1 triton==3.9.0 starlette==1.10.0 msgspec==0.23.0 \
  ipython==9.18.1 \
  pyzmq==27.3.0 prometheus-client==0.26.0 pytest==9.2.0
"$VENV/bin/python" - <<'PY'
import pathlib, sysconfig
root = pathlib.Path(sysconfig.get_paths()["purelib"]) / "torchvision"
stub = '''"""Import-only torchvision stand-in written by hicache's scripts/setup_sglang.sh."""
class _Unavailable:
    def __init__(self, name):
        self._name = name
    def __getattr__(self, attr):
        return _Unavailable(f"{self._name}.{attr}")
    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"torchvision is a stub here: {self._name} is unavailable")
__version__ = "0.0.0+hicache.stub"
def __getattr__(name):
    return _Unavailable(f"torchvision.{name}")
'''
sub = '''from torchvision import _Unavailable
def __getattr__(name):
    return _Unavailable(f"{__name__}.{name}")
'''
files = {"__init__.py": stub, "transforms/__init__.py": sub, "transforms/functional.py": sub,
         "transforms/v2/__init__.py": sub, "transforms/v2/functional.py": sub,
         "io.py": sub, "ops.py": sub}
for rel, text in files.items():
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
PY
"$VENV/bin/python" -W ignore -c 'import torch, sglang.srt.mem_cache.unified_radix_cache, sglang.test.kits.unified_radix_cache.mixins; assert torch.__version__.startswith("2.13.0"), torch.__version__'
"$VENV/bin/python" -c 'import torch; assert not torch.version.cuda, "a CUDA torch got in"'
touch "$stamp"
echo "[setup_sglang] ready: $VENV ($(du -sh "$VENV" | cut -f1))"
