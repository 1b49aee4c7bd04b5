# Set-up and everyday commands. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
# torch 2.13.0: on the project's CPU machines pip takes a local CPU wheel; elsewhere PyPI's build.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
# pytest-xdist workers for `make test`: CI's two cores take the suite from ~14.5 to ~8 min.
TEST_WORKERS ?= 2

.PHONY: install extra demo test lint format clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# What the demo needs: torch and moetrace itself.
$(VENV)/.installed-core: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e .
	touch $@

# What the tests and the linters need besides.
$(VENV)/.installed: $(VENV)/.installed-core
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

# One optional extra into the venv: make extra EXTRA=serve (or parquet, pandas, plot).
extra: $(VENV)/.installed-core
	@test -n "$(EXTRA)" || { echo "name the extra: make extra EXTRA=serve (parquet, pandas, plot)"; exit 2; }
	$(BIN)/pip install -q -e ".[$(EXTRA)]"

demo: $(VENV)/.installed-core
	printf '%s\n' \
	  '{"id": "greeting", "prompt": "Hello! Tell me about experts."}' \
	  '{"id": "code", "prompt": "def fibonacci(n):", "max_tokens": 24}' \
	  '{"id": "chat", "messages": [{"role": "user", "content": "What is routing?"}]}' \
	  '{"id": "ids", "prompt_token_ids": [72, 101, 108, 108, 111]}' > $(VENV)/demo-prompts.jsonl
	$(BIN)/moetrace record demo $(VENV)/demo-prompts.jsonl -o demo-trace.h5 --overwrite
	$(BIN)/moetrace inspect demo-trace.h5

test: install
	$(BIN)/ruff check moetrace tests benchmarks tools examples
	$(BIN)/ruff format --check moetrace tests benchmarks tools examples
	$(BIN)/lint-imports --no-cache
	$(BIN)/pytest -q -n $(TEST_WORKERS)

format: install
	$(BIN)/ruff check --fix moetrace tests benchmarks tools examples
	$(BIN)/ruff format moetrace tests benchmarks tools examples

clean:
	rm -rf $(VENV) demo-trace.h5 .pytest_cache .ruff_cache .import_linter_cache .grimp_cache
