# Two entry points a newcomer needs: `make demo` and `make test`.
# Each one builds .venv from nothing the first time.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

NOTEBOOKS := quickstart 01-multi-process 02-parallel-programming 03-distributed-initialize pitfalls

demo: $(STAMP)
	$(BIN)/python -m spmd.kernel install --sys-prefix
	$(BIN)/python -m spmd.demo $(NOTEBOOKS:%=notebooks/%.ipynb)

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check spmd tests benchmarks

clean:
	rm -rf $(VENV) notebooks/*.executed.ipynb
