# Two entry points: `make train` (set up + train the demo model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints.txt
EXTRAS ?= test
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: train test test-unit install clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-install when the project's metadata or pins change.
$(STAMP): $(PY) pyproject.toml $(CONSTRAINTS)
	$(PIP) install --quiet --disable-pip-version-check -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/keel train $(ARGS)

# Both tiers, one pytest-xdist worker per core (at most 4; each worker runs one torch thread).
# The long end-to-end tests start first so that no worker is left with one at the end.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist worksteal $(PYTEST_ARGS)

# The fast unit tier for development: no subprocess, no training on the real-text dataset.
test-unit: $(STAMP)
	$(PY) -m pytest -q -m "not e2e and not slow" $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
