# One command sets up and trains, one sets up and tests. Both create or reuse .venv.
# torch is installed first, from pip's default index unless TORCH_INDEX names another; on Linux
# PyPI serves CUDA builds, so for the CPU-only build (no CUDA packages) run
#     make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
# If .venv already has a torch that imports (e.g. your own CUDA build: make setup TORCH=skip
# after installing it), it is kept. distrain is installed with every extra (data sets, plots,
# YAML) and the test tools.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
BIN := $(VENV)/bin

.PHONY: setup run test test-all lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || [ "$(TORCH)" = skip ] || $(BIN)/pip install -q $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

run: setup
	$(BIN)/distrain train

test: setup
	$(BIN)/python -m pytest -q

# Also the tests marked slow (stress and fault-injection runs, README examples end to end).
test-all: setup
	$(BIN)/python -m pytest -q -m "slow or not slow"

lint: setup
	$(BIN)/ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) runs .pytest_cache
