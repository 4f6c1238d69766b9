# The two commands of the README: `make demo` and `make test`. Each sets itself up.
VENV ?= .venv
PY := $(VENV)/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup sglang-env demo test test-gpu bench
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m hicache.cli demo $(ARGS)

# the SGLang adapter's tests run SGLang's own classes in a separate cached env (.venv-sglang)
sglang-env:
	@bash scripts/setup_sglang.sh

# two pytest-xdist workers: the suite mostly waits on its daemons, so one process left a core
# of the 2-core CI machine idle; TEST_WORKERS=0 runs it in one process. The tests that run
# real Mooncake processes stay on one worker (their xdist group: tests/conftest.py)
TEST_WORKERS ?= 2
test: setup sglang-env
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

test-gpu: setup
	$(PY) -m pytest -q -p no:cacheprovider -m cuda $(ARGS)
