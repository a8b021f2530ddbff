# The README's two commands, `make demo` and `make test`, each do all the set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test demo bench lint clean

setup: $(STAMP)

# torch goes in first, pinned: a bare `torch` requirement would make pip fetch a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

demo: setup
	$(VENV)/bin/dikkat demo

bench: setup
	$(PY) benchmarks/run.py

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache
