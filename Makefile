# meshplan: `make demo` runs the main job on a sample model, `make test` runs the tests.
# Both create the virtual environment (.venv) first when it is missing or stale.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NP ?= 4
MESH ?= 1x4
DEMO_MODEL ?= sample_models/gpt.onnx
DEMO_DIMS ?= --dim batch=8 --dim seq=32
DEMO := demo

.PHONY: all venv demo test test-all bench clean samples

all: test

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,mpi]"
	touch $(STAMP)

demo: $(STAMP)
	@mkdir -p $(DEMO)
	$(BIN)/meshplan inputs $(DEMO_MODEL) $(DEMO_DIMS) -o $(DEMO)/inputs.npz
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/mpiexec -n $(NP) $(BIN)/meshplan profile $(DEMO_MODEL) --mesh $(MESH) --device cpu $(DEMO_DIMS) --microbatches 4 --cache $(DEMO)/profile-cache.sqlite -o $(DEMO)/profile.json
	$(BIN)/meshplan plan $(DEMO_MODEL) --mesh $(MESH) --device cpu $(DEMO_DIMS) --microbatches 4 --profile $(DEMO)/profile.json -o $(DEMO)/plan
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/mpiexec -n $(NP) $(BIN)/meshplan run $(DEMO)/plan --inputs $(DEMO)/inputs.npz --output $(DEMO)/outputs.npz --repeat 5 --trace $(DEMO)/trace.json
	$(BIN)/meshplan verify $(DEMO)/plan --inputs $(DEMO)/inputs.npz --outputs $(DEMO)/outputs.npz

test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q

test-all: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -m ""

bench: $(STAMP)
	@mkdir -p bench-out
	$(BIN)/python benchmarks/stage_dp.py --json bench-out/stage_dp.json
	$(BIN)/python benchmarks/plan_time.py --json bench-out/plan_time.json
	$(BIN)/python benchmarks/ilp_time.py --json bench-out/ilp_time.json
	$(BIN)/python benchmarks/plan_quality.py --json bench-out/plan_quality.json
	$(BIN)/python benchmarks/reshard.py --json bench-out/reshard.json
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python benchmarks/profile_accuracy.py --json bench-out/profile_accuracy.json

samples: $(STAMP)
	$(BIN)/python -m sample_models

clean:
	rm -rf $(VENV) $(DEMO) bench-out .pytest_cache
