# Two entry points, each doing its own set-up in a local virtual environment:
#   make train   -> installs the package (with the plots extra: loss.png) and runs the main job
#                   (2 islands on CPU, ~2 min)
#   make test    -> installs the package with the dev and elastic extras (every optional
#                   feature the tests exercise, the tools, setuptools for the offline wheel
#                   test), runs lint, type check and tests
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: venv install dev train test lint typecheck bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[plots]'

dev: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev,elastic]'

train: install
	$(BIN)/swarm-train $(ARGS)

lint: dev
	$(BIN)/ruff check lightning_swarm tests benchmarks examples
	$(BIN)/ruff format --check lightning_swarm tests benchmarks examples

typecheck: dev
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs lightning_logs .pytest_cache .mypy_cache .ruff_cache
