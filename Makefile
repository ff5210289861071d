# Set-up and checks from a fresh checkout. `make demo` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install demo test test-all lint format

$(BIN)/hivegrpo: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test,dev,plots]"
	touch $@

install: $(BIN)/hivegrpo

demo: install
	$(BIN)/hivegrpo demo

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest

test-all: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "slow or not slow"

lint: install
	$(BIN)/ruff check peer coordinator tests
	$(BIN)/ruff format --check peer coordinator tests

format: install
	$(BIN)/ruff format peer coordinator tests
	$(BIN)/ruff check --fix peer coordinator tests
