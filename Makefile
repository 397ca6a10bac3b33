# The README's two commands: `make demo` and `make test`. Both make (or reuse) .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_WORKERS ?= 2
# The serving environment: the Python of Triton's Python-backend stub (numpy < 2 there), see requirements-triton.txt
TRITON_VENV ?= .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.installed

.PHONY: setup triton-env demo test clean

$(STAMP): pyproject.toml requirements.txt scripts/ort_headers.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0          # the CPU build on disk; never a CUDA one
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) scripts/ort_headers.py                   # what v4engine's CPU kernels compile against
	touch $(STAMP)

setup: $(STAMP)

$(TRITON_STAMP): pyproject.toml requirements-triton.txt scripts/ort_headers.py
	test -x $(TRITON_VENV)/bin/python || python3 -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRITON_VENV)/bin/python -m pip install -q -r requirements-triton.txt
	$(TRITON_VENV)/bin/python -m pip install -q --no-deps -e .
	$(TRITON_VENV)/bin/python scripts/ort_headers.py
	touch $(TRITON_STAMP)

triton-env: $(TRITON_STAMP)

demo: setup
	$(PY) examples/demo.py

test:
	$(MAKE) -j2 setup triton-env             # the two environments install side by side
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -q

clean:
	rm -rf $(VENV) $(TRITON_VENV) demo-out .pytest_cache
