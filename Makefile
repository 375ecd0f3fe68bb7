# meshplan: `make demo` runs the main job on a sample model, `make test` runs the tests,
# `make serve` serves a sample LLM with the OpenAI API, `make train` trains a sample GPT on 1x2.
# Both create the virtual environment (.venv) first when it is missing or stale: it holds
# exactly the versions in uv.lock (the set the tests passed with), installed by uv, which
# `make` itself installs into .tools/ at a pinned version. `make lock` re-resolves uv.lock
# from pyproject.toml's ranges (docs/install.md).

PYTHON ?= python3
UV_VERSION := 0.13.8
TOOLS := .tools
UV := $(TOOLS)/bin/uv
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NP ?= 4
TEST_WORKERS ?= 2
MESH ?= 1x4
DEMO_MODEL ?= sample_models/gpt.onnx
DEMO_DIMS ?= --dim batch=8 --dim seq=32
DEMO := demo
# uv uses the interpreter $(PYTHON) names and never downloads one.
UV_ENV := UV_PYTHON_DOWNLOADS=never UV_PROJECT_ENVIRONMENT=$(VENV)

.PHONY: all venv demo serve train test test-all bench clean samples lock

all: test

venv: $(STAMP)

$(UV):
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -qq --disable-pip-version-check uv==$(UV_VERSION)

# --locked: install uv.lock as it is, and stop if pyproject.toml changed without it.
$(STAMP): pyproject.toml uv.lock | $(UV)
	$(UV_ENV) $(UV) sync --quiet --locked --extra test --extra mpi --python $(PYTHON)
	touch $(STAMP)

lock: | $(UV)
	$(UV_ENV) $(UV) lock --quiet --upgrade --python $(PYTHON)

demo: $(STAMP)
	@mkdir -p $(DEMO)
	$(BIN)/meshplan inputs $(DEMO_MODEL) $(DEMO_DIMS) -o $(DEMO)/inputs.npz
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/mpiexec -n $(NP) $(BIN)/meshplan profile $(DEMO_MODEL) --mesh $(MESH) --device cpu $(DEMO_DIMS) --microbatches 4 --cache $(DEMO)/profile-cache.sqlite -o $(DEMO)/profile.json
	$(BIN)/meshplan plan $(DEMO_MODEL) --mesh $(MESH) --device cpu $(DEMO_DIMS) --microbatches 4 --profile $(DEMO)/profile.json -o $(DEMO)/plan
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/mpiexec -n $(NP) $(BIN)/meshplan run $(DEMO)/plan --inputs $(DEMO)/inputs.npz --output $(DEMO)/outputs.npz --repeat 5 --trace $(DEMO)/trace.json
	$(BIN)/meshplan verify $(DEMO)/plan --inputs $(DEMO)/inputs.npz --outputs $(DEMO)/outputs.npz

# the sample builder Llama, 4 slots on 1x2 (heads and cache split), served on localhost:$(PORT)
PORT ?= 8000
SERVE_MODEL ?= sample_models/genai/llama_fp32/model.onnx
serve: $(STAMP)
	$(BIN)/meshplan plan $(SERVE_MODEL) --mesh 1x2 --generate --batch 4 --max-length 256 --policy megatron --max-stages 1 -o $(DEMO)/serve_plan
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/mpiexec -n 2 $(BIN)/meshplan serve $(DEMO)/serve_plan --port $(PORT)

# the sample GPT of sample_models/training trained on 1x2 (AdamW, cosine schedule), then exported
TRAIN_MODEL ?= sample_models/training/gpt_adamw.onnx
TRAIN_DATA ?= sample_models/training/gpt_adamw.data.npz
train: $(STAMP)
	@mkdir -p $(DEMO)
	$(BIN)/meshplan plan $(TRAIN_MODEL) --train --loss cross_entropy:logits:target --optimizer adamw --mesh 1x2 --device cpu --dim batch=8 -o $(DEMO)/train_plan
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/mpiexec -n 2 $(BIN)/meshplan train $(DEMO)/train_plan --data $(TRAIN_DATA) --steps 40 --lr 3e-3 --betas 0.9,0.95 --weight-decay 0.1 --clip-norm 1 --schedule cosine --warmup 3 --checkpoint $(DEMO)/train_checkpoints --log $(DEMO)/train_log.json
	$(BIN)/meshplan export $(DEMO)/train_plan --checkpoint $(DEMO)/train_checkpoints -o $(DEMO)/trained.onnx

# The suite runs in two parts: most of it side by side in $(TEST_WORKERS) processes (pytest-xdist,
# a test file to one process), then the tests marked `serial` alone (servers with timeouts,
# measurements, killed ranks: docs/testing.md).
test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not serial"
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -m "serial and not slow"

# (the slow cases, models of several GB, run alone too: two side by side would need twice the memory)
test-all: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not serial"
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -m "serial or slow"

bench: $(STAMP)
	@mkdir -p bench-out
	$(BIN)/python benchmarks/stage_dp.py --json bench-out/stage_dp.json
	$(BIN)/python benchmarks/plan_time.py --json bench-out/plan_time.json
	$(BIN)/python benchmarks/ilp_time.py --json bench-out/ilp_time.json
	$(BIN)/python benchmarks/plan_quality.py --json bench-out/plan_quality.json
	$(BIN)/python benchmarks/reshard.py --json bench-out/reshard.json
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python benchmarks/profile_accuracy.py --json bench-out/profile_accuracy.json
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python benchmarks/mixed_precision.py --json bench-out/mixed_precision.json

samples: $(STAMP)
	$(BIN)/python -m sample_models

clean:
	rm -rf $(VENV) $(TOOLS) $(DEMO) bench-out .pytest_cache
