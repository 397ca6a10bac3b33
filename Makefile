# The README's two commands: `make demo` and `make test`. Both make (or reuse) .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2

.PHONY: setup demo test clean

$(STAMP): pyproject.toml requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0          # the CPU build on disk; never a CUDA one
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -n $(PYTEST_WORKERS) -q

clean:
	rm -rf $(VENV) demo-out .pytest_cache
