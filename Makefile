# `make demo` runs the main job, `make test` the CPU test suite; both set up .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-quick gpu-test sanitize clean

# nvcc/ptxas: the system's CUDA toolkit where core.toolchain finds one, else NVIDIA's pip wheels.
# g++ is not installed here: tests that need it fail in CI (CI=true) without it.
HAVE_CUDA_TOOLS := $(PY) -c "import sys; from sparsecnn.core.toolchain import find_tool; \
	sys.exit(not (find_tool('nvcc') and find_tool('ptxas')))"

# --no-compile, then compileall on every core at once: pip compiles file by file, 30 s more on 2
# cores. Some of torch's test files use newer Python syntax and fail to compile, as under pip (-).
$(STAMP): pyproject.toml requirements-ci.txt requirements-cuda-tools.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -r requirements-ci.txt
	-$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null
	$(PY) -m pip install -q --no-deps -e .
	$(HAVE_CUDA_TOOLS) || $(PY) -m pip install -q -r requirements-cuda-tools.txt
	$(HAVE_CUDA_TOOLS) || echo "warning: no nvcc/ptxas found, even after requirements-cuda-tools.txt" >&2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m sparsecnn.cli demo

# The CPU suite in parallel, one pytest-xdist worker per core, in a random order each run
# (pytest-randomly prints its seed; `-p randomly --randomly-seed=N` repeats an order); worksteal:
# an idle worker takes queued tests from a busy one, so a long test does not end the run alone.
# test-quick: the same without the tests marked `slow` (every module still runs).
WORKERS ?= auto
test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(WORKERS) --dist worksteal

test-quick: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(WORKERS) --dist worksteal -m "not slow"

# On a GPU machine (torch with CUDA installed): the whole `gpu` suite in chunks, logs under $(OUT).
gpu-test:
	OUT=$${OUT:-out} bash scripts/gpu-test.sh all

# On a GPU machine: compute-sanitizer (memcheck, racecheck, initcheck) over one small layer of each
# backend and dtype; one log per tool under $(OUT).
sanitize:
	OUT=$${OUT:-out} bash scripts/sanitize.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info src/*.egg-info
