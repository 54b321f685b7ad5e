# One virtual environment in .venv; every target installs what it needs first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: venv demo test lint bench clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch (from local disk on this kind of machine); a GPU user who already has
	# torch installs paratwin into that environment with `pip install -e .` instead.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $@

demo: venv
	$(BIN)/paratwin demo

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

bench: venv
	$(BIN)/python benchmarks/sim_speed.py
	$(BIN)/python benchmarks/profile_overhead.py

clean:
	rm -rf $(VENV) runs
