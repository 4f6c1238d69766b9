# The two commands of the README: `make demo` and `make test`. Each sets itself up.
VENV ?= .venv
PY := $(VENV)/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup demo test test-gpu bench
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m hicache.cli demo $(ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)

test-gpu: setup
	$(PY) -m pytest -q -p no:cacheprovider -m cuda $(ARGS)
