# Each target creates .venv (pinned by constraints.txt) when it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DATA := demo-data
DEMO_RUN := runs/demo

.PHONY: demo test test-fast test-under-load fuzz lint bench browser azurite clean

$(STAMP): pyproject.toml constraints.txt tests/azurite/package-lock.json
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-cache-dir -c constraints.txt -e '.[dev,onnx,openvino,tensorboard,formats,serve,lora,tune,s3,gcs,azure,audit]'
	@$(MAKE) --no-print-directory azurite || echo "make: Azurite is not installed (it needs npm: as root, apt-get install npm, then make azurite); the az:// tests will fail"
	touch $(STAMP)

# Azure's storage emulator for the az:// tests (tests/azureserver.py), exactly as tests/azurite/package-lock.json
# pins it, from npm into the virtual environment; npm from the distribution's packages when missing (apt-get: root).
azurite:
	command -v npm >/dev/null 2>&1 || (apt-get update && apt-get install -y npm)
	mkdir -p $(VENV)/azurite
	cp tests/azurite/package.json tests/azurite/package-lock.json $(VENV)/azurite/
	npm ci --prefix $(VENV)/azurite --no-audit --no-fund --silent

demo: $(STAMP)
	$(BIN)/visiontune sample-data $(DEMO_DATA) --per-class 200 --force
	rm -rf $(DEMO_RUN)  # the demo starts afresh each time (a run folder with checkpoints is never overwritten)
	$(BIN)/visiontune train --data $(DEMO_DATA) --model resnet18 --weights none \
		--image-size 64 --epochs 3 --batch-size 16 --lr 0.01 --output-dir $(DEMO_RUN)

# Headless Chromium for the report.html tests (marked `browser`), from the distribution's packages when
# missing (apt-get: root needed). `make test` goes on without it; the browser tests then fail saying so.
browser:
	command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
		(apt-get update && apt-get install -y chromium)

# Tests run in WORKERS processes (pytest-xdist); tests/conftest.py schedules them by module. A worker that
# dies ends the run at once with its test named (a replaced worker's module would run again, or wait).
WORKERS ?= 2
XDIST := -n $(WORKERS) --max-worker-restart=0

SUITE := $(BIN)/python -m pytest -q $(XDIST) --durations=15 tests

test: $(STAMP)
	@$(MAKE) --no-print-directory browser || echo "make test: Chromium is not installed (as root: apt-get install chromium); the browser tests will fail"
	$(SUITE)

# The whole suite beside two CPU-bound processes (stopped when it ends): it must pass on a busy machine.
test-under-load: $(STAMP)
	@$(MAKE) --no-print-directory browser || echo "make test-under-load: Chromium is not installed (as root: apt-get install chromium); the browser tests will fail"
	tests/under_load.sh $(SUITE)

# The unmarked tier: no multi-process, slow or browser tests (marked at each test; tests/tiers.py enforces it).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) --durations=15 -m "not slow and not distributed and not browser" tests

# The fuzz tier (tests/fuzzing.py): every hypothesis test (hypothesis marks them), 50x the examples that
# `make test` runs, drawn afresh each time. A case it finds becomes a plain regression test.
fuzz: $(STAMP)
	VISIONTUNE_FUZZ=1 $(BIN)/python -m pytest -q $(XDIST) --durations=15 -m hypothesis tests

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(DEMO_DATA) runs
