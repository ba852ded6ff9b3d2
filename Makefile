# Two commands on a fresh machine: `make run` (the main job) and `make test` (the test suite).
# Both create .venv with the pinned dependencies and unpack the ALFWorld games first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SHARED ?= ../shared
ALFWORLD_DATA ?= $(HOME)/.cache/alfworld
ARGS ?=
PYTEST_ARGS ?=

export ALFWORLD_DATA
export PYTHONPATH := $(CURDIR)
export DO_NOT_TRACK := true
export MLFLOW_DISABLE_TELEMETRY := true
export DVC_NO_ANALYTICS := 1
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export OMP_NUM_THREADS ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 90
export PYTHONUNBUFFERED := 1
export PREFECT_RESULTS_LOCAL_STORAGE_PATH ?= $(CURDIR)/runs/prefect-results

.PHONY: run test test-fast venv data clean-runs deploy deploy-stop evaluate lineage collect register-release

run: venv data
	$(PY) -m flows.pipeline $(ARGS)

test: venv data
	$(PY) -m pytest $(PYTEST_ARGS)

# For iteration: the suite without the tests marked slow (end-to-end flow runs and training); `make test` stays the
# whole suite, the one .ci/run runs.
test-fast: venv data
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Evaluation alone and the lineage audit, with this Makefile's offline environment:
#   make evaluate ARGS="--policy models:/evoharness-policy@candidate --split valid_seen --limit 20"
#   make lineage ARGS="models:/evoharness-policy@champion"
evaluate: venv data
	$(PY) -m flows.evaluate $(ARGS)

# Collection alone (check out, pull, regenerate or collect a profile's logs, then dvc push):
#   make collect ARGS="--profile full"
collect: venv data
	$(PY) -m flows.collect $(ARGS)

lineage: venv
	$(PY) -m evoharness.registry.lineage $(ARGS)

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	touch $@

# The games: $ALFWORLD_DATA/json_2.1.1 if it is there, else unpacked from $(SHARED)/alfworld (sha256 checked).
data:
	@if [ -d "$(ALFWORLD_DATA)/json_2.1.1/train" ]; then \
	  echo "ALFWorld games: $(ALFWORLD_DATA)/json_2.1.1"; \
	else \
	  archive="$(SHARED)/alfworld/json_2.1.1_tw-pddl.tar.xz"; \
	  test -f "$$archive" || { echo "ALFWorld archive not found at $$archive: set SHARED=<folder holding alfworld/> or ALFWORLD_DATA=<folder holding json_2.1.1/>" >&2; exit 1; }; \
	  echo "1a08af886ef7144daae04ee35fa20221be7a77c3f2bbfeb4a099d276ef3d748f  $$archive" | sha256sum -c --quiet - || { echo "$$archive: sha256 mismatch" >&2; exit 1; }; \
	  mkdir -p "$(ALFWORLD_DATA)"; echo "unpacking ALFWorld games into $(ALFWORLD_DATA)"; \
	  tmp=$$(mktemp -d "$(ALFWORLD_DATA)/.unpack.XXXXXX"); \
	  xz -dc "$$archive" | tar -x -C "$$tmp" && rm -rf "$(ALFWORLD_DATA)/json_2.1.1" \
	    && mv "$$tmp/json_2.1.1" "$(ALFWORLD_DATA)/" && rmdir "$$tmp" || { rm -rf "$$tmp"; exit 1; }; \
	fi

# A local Prefect server + process worker on 127.0.0.1 serving the deployments of prefect.yaml.
deploy: venv data
	scripts/deploy.sh start

deploy-stop:
	scripts/deploy.sh stop

clean-runs:
	rm -rf runs

# A release folder (models/<name>) into the local MLflow registry, its model card's lineage as version tags:
#   make register-release RELEASE=models/evoharness-full-sft
RELEASE ?= models/evoharness-full-sft
register-release: venv
	$(PY) -m evoharness.registry.release register $(RELEASE)
