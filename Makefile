# One command sets up and trains, one sets up and tests. Both create or reuse .venv.
# The CPU build of PyTorch is installed first so nothing pulls CUDA packages; if .venv already
# has a torch (e.g. your own CUDA build: make setup TORCH=skip after installing it), it is kept.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup run test test-all lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || [ "$(TORCH)" = skip ] || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

run: setup
	$(BIN)/distrain train

test: setup
	$(BIN)/python -m pytest -q

# Also the tests marked slow (stress and fault-injection runs), about 5 more minutes.
test-all: setup
	$(BIN)/python -m pytest -q -m "slow or not slow"

lint: setup
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
