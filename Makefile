# `make demo` runs the main job, `make test` the CPU test suite; both set up .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test gpu-test clean

$(STAMP): pyproject.toml requirements-ci.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-ci.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m sparsecnn.cli demo

test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q

# On a GPU machine (torch with CUDA installed): the whole `gpu` suite in chunks, logs under $(OUT).
gpu-test:
	OUT=$${OUT:-out} bash scripts/gpu-test.sh all

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info src/*.egg-info
