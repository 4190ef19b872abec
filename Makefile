# Two entry points: `make train` (set up + train the demo model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints.txt
EXTRAS ?= test
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: train test install clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-install when the project's metadata or pins change.
$(STAMP): $(PY) pyproject.toml $(CONSTRAINTS)
	$(PIP) install --quiet --disable-pip-version-check -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/keel train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
