# The two commands of the README: `make demo` and `make test`. Each sets itself up.
VENV ?= .venv
PY := $(VENV)/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup bytecode sglang-env demo test test-gpu bench
setup:
	@bash scripts/setup.sh

# the project's own modules compiled to bytecode once (incremental: changed files only). A
# machine that sets PYTHONDONTWRITEBYTECODE (the development VM does, and CI runs on one like
# it) reads cached bytecode but never writes it, so each Python process compiled them again:
# ~0.5 s of CPU per daemon start on a 2-core VM, and the suite starts ~300 daemons
bytecode: setup
	@$(PY) -m compileall -q -j 0 hicache controllers kernels host_pools tests scripts examples

demo: setup bytecode
	$(PY) -m hicache.cli demo $(ARGS)

# the SGLang adapter's tests run SGLang's own classes in a separate cached env (.venv-sglang)
sglang-env:
	@bash scripts/setup_sglang.sh

# two pytest-xdist workers: the suite mostly waits on its daemons, so one process left a core
# of the 2-core CI machine idle; TEST_WORKERS=0 runs it in one process. The tests that run
# real Mooncake processes stay on one worker (their xdist group: tests/conftest.py)
TEST_WORKERS ?= 2
test: setup bytecode sglang-env
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

test-gpu: setup bytecode
	$(PY) -m pytest -q -p no:cacheprovider -m cuda $(ARGS)
