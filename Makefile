# The two set-up commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck deps bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/gpuledger demo --data-dir ./gpuledger-data

# Debian packages the test suite needs (real servers, browsers), installed only when missing.
deps:
	@bash .ci/ensure-debs

test: $(STAMP) deps
	$(PY) -m pytest -q

# ruff and mypy, configured in pyproject.toml
lint: $(STAMP)
	$(VENV)/bin/ruff check gpuledger tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Speed measurements (results in bench/RESULTS.md); gpu_check.py needs a real NVIDIA GPU and torch.
bench: $(STAMP) deps
	$(PY) bench/agent_overhead.py
	$(PY) bench/fairshare.py
	$(PY) bench/report.py
	$(PY) bench/ingest.py
	$(PY) bench/batch_cost.py

clean:
	rm -rf $(VENV) gpuledger-data .pytest_cache .hypothesis
